"""One process of a 2-process gloo run under `torch.distributed.run` with a stand-in vLLM server (an HTTP server of the
main process that answers `/health`), for the failure coordination of `rpg_trl/reliability/process_failure.py`.

`python -m torch.distributed.run --nproc_per_node 2 failure_two_proc.py MODE`, MODE one of:

- `report`: the server fails in the middle of a request of the main process (a `requests.ConnectionError` inside
  `server_errors_named`) while process 1 waits for its answer in a broadcast, as TRL's server mode does. The main
  process's `finally` and `atexit` handler print what they ran;
- `exit` / `exit-atexit`: a short run that finishes: a few probed collectives with process 1's watcher polling the
  store without pause (`WATCH_INTERVAL = 0`, the widest window for a thread inside a store call at exit); with `exit`
  the watcher is stopped by `watching` when the "training" ends, with `exit-atexit` only by the `atexit` handler.
- `deadline`: the main process's weight sync to the server hangs (a sleep) past its deadline (1 s).

The rpg_trl modules are loaded without the package's `__init__` (which imports transformers' Trainer: seconds).
"""

import atexit
import importlib
import os
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace


MODE = sys.argv[1]
RANK = int(os.environ["RANK"])
if RANK == 0:  # registered first: runs last of all exit handlers
    atexit.register(lambda: print("process 0: atexit ran", flush=True))

ROOT = Path(__file__).resolve().parents[2]
for name, path in (("rpg_trl", ROOT / "rpg_trl"), ("rpg_trl.reliability", ROOT / "rpg_trl" / "reliability")):
    package = types.ModuleType(name)
    package.__path__ = [str(path)]
    sys.modules[name] = package
process_failure = importlib.import_module("rpg_trl.reliability.process_failure")
vllm_server = importlib.import_module("rpg_trl.reliability.vllm_server")
teardown = importlib.import_module("rpg_trl.reliability.teardown")

import requests  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the name http.server calls
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


dist.init_process_group("gloo")
port = torch.tensor([0])
if RANK == 0:
    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port[0] = server.server_address[1]
dist.broadcast(port, src=0)
url = f"http://127.0.0.1:{int(port)}"
accelerator = SimpleNamespace(num_processes=2, is_main_process=RANK == 0, process_index=RANK)
args = SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, output_dir="/nonexistent")
trainer = SimpleNamespace(accelerator=accelerator, args=args, state=SimpleNamespace(global_step=2))
teardown.hold_process_group_until_exit()  # as RPGTrainer does: the group is destroyed at exit
if MODE.startswith("exit"):
    process_failure.WATCH_INTERVAL = 0.0
print(f"process {RANK} watching: {vllm_server.watch_for_server_failure(trainer)}", flush=True)
dist.barrier()

if MODE == "report":
    with process_failure.watching(trainer):
        if RANK == 1:
            answer = torch.zeros(1)
            with vllm_server.server_errors_named(trainer):
                dist.broadcast(answer, src=0)  # the main process's answer, which never comes
            sys.exit("process 1 got an answer")
        try:
            with vllm_server.server_errors_named(trainer):
                time.sleep(0.5)
                raise requests.ConnectionError("test: the server died mid-request")
        finally:
            print("process 0: finally ran", flush=True)
elif MODE == "deadline":
    with process_failure.watching(trainer):
        message = f"The weight sync to the vLLM server at {url} did not finish within 1 s (test)."
        with process_failure.deadline(trainer, 1.0, message, "VLLMServerError"):
            if RANK == 0:
                time.sleep(120)  # a transfer to a server that died in the middle of it
            dist.barrier()
        sys.exit(f"process {RANK} left the weight sync")
elif MODE in ("exit", "exit-atexit"):
    if MODE == "exit":
        with process_failure.watching(trainer):
            for _ in range(3):
                with vllm_server.server_errors_named(trainer):
                    dist.barrier()
    else:
        for _ in range(3):
            with vllm_server.server_errors_named(trainer):
                dist.barrier()
    print(f"process {RANK} done", flush=True)
else:
    sys.exit(f"unknown mode {MODE!r}")
