"""One process of a 2-process gloo run under `torch.distributed.run` with a stand-in vLLM server (an HTTP server of the
main process that answers `/health`), for the failure coordination of `rpg_trl/reliability/process_failure.py`.

`python -m torch.distributed.run --nproc_per_node 2 failure_two_proc.py MODE`, MODE one of:

- `report`: the server fails in the middle of a request of the main process (a `requests.ConnectionError` inside
  `server_errors_named`) while process 1 waits for its answer in a broadcast, as TRL's server mode does. The main
  process's `finally` and `atexit` handler print what they ran;
- `exit` / `exit-atexit`: a short run that finishes: a few probed collectives with process 1's watcher polling the
  store without pause (`WATCH_INTERVAL = 0`, the widest window for a thread inside a store call at exit); with `exit`
  the watcher is stopped by `watching` when the "training" ends, with `exit-atexit` only by the `atexit` handler.
- `deadline`: the main process's weight sync to the server hangs (a sleep) past its deadline (1 s);
- `hung-generation`: the server accepts the main process's generation request (through the trainer's client, bounded
  by `bound_server_requests` to `vllm_request_timeout=2`) and never answers it, while process 1 waits for the answer
  in a broadcast. The main process's `finally` prints how long the request took;
- `queue-dry`: the main process waits on an empty rollout queue (AsyncRPGTrainer's health check with the server's probe,
  `ProbeWhileWaiting`) when the server has gone, while process 1 waits for its batch in a broadcast.

[`launch`] runs it from a test.

The rpg_trl modules are loaded without the package's `__init__` ([`import_alone`]).
"""

import atexit
import importlib
import os
import re
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace


ROOT = Path(__file__).resolve().parents[2]


def launch(mode: str, timeout: float = 120, tag: str = "") -> tuple[int, str, float]:
    """This script with `mode` in 2 gloo processes under `torch.distributed.run`; returns (exit code, the launcher's
    output with both processes' stdout and stderr, seconds from the moment both processes were up, past their first
    barrier, to the launcher's exit): what a test bounds is how long the run takes to stop once it runs, not the
    start-up (two interpreters importing torch), which depends on the machine's load. On a quiet 2-core machine the
    `report` run takes 10.4 s, 7.8 s of it start-up; in CI, beside the other jobs, 62 s. `tag`: an extra argument on
    every process's command line (unused by the script), by which a test finds its processes."""
    from helpers.ports import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), __file__, mode] + ([tag] if tag else [])
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)  # fmt: skip
    ended = time.time()
    # Not anchored to a line: both processes write to one pipe, and where Python's output is unbuffered
    # (PYTHONUNBUFFERED=1) a `print` is two writes, the text and then its newline, between which the other process's
    # output can land.
    up = re.search(r"both processes up at (\d+\.\d{3})", proc.stdout)
    assert up, f"the run never got past its first barrier:\n{proc.stdout[-3000:]}"
    return proc.returncode, proc.stdout, ended - float(up.group(1))


def import_alone(name: str) -> types.ModuleType:
    """The module `rpg_trl.reliability.<name>` without the packages' `__init__` (which import transformers' Trainer,
    TRL and peft: seconds of start-up in every process of every launch): `rpg_trl` and `rpg_trl.reliability` are
    registered as bare packages first. For a worker process only, never in the test process, which imports the real
    packages."""
    for package_name, path in (
        ("rpg_trl", ROOT / "rpg_trl"),
        ("rpg_trl.reliability", ROOT / "rpg_trl" / "reliability"),
    ):
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [str(path)]
            sys.modules[package_name] = package
    return importlib.import_module(f"rpg_trl.reliability.{name}")


def root_cause(output):
    """torchrun's summary of the first observed failure: (rank, exit code)."""
    found = re.search(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)",
                      output, re.S)  # fmt: skip
    assert found, output[-3000:]
    return int(found.group(1)), int(found.group(2))


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the name http.server calls
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # noqa: N802 - a request that the server accepts and never answers (`hung-generation`)
        threading.Event().wait()

    def log_message(self, *args):
        pass


def main(mode: str) -> None:
    rank = int(os.environ["RANK"])
    if rank == 0:  # registered first: runs last of all exit handlers
        atexit.register(lambda: print("process 0: atexit ran", flush=True))
    process_failure = import_alone("process_failure")
    vllm_server = import_alone("vllm_server")
    teardown = import_alone("teardown")

    import requests
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    port = torch.tensor([0])
    if rank == 0:
        server = HTTPServer(("127.0.0.1", 0), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port[0] = server.server_address[1]
    dist.broadcast(port, src=0)
    url = f"http://127.0.0.1:{int(port)}"
    accelerator = SimpleNamespace(num_processes=2, is_main_process=rank == 0, process_index=rank)
    args = SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, output_dir="/nonexistent")
    trainer = SimpleNamespace(accelerator=accelerator, args=args, state=SimpleNamespace(global_step=2))
    teardown.hold_process_group_until_exit()  # as RPGTrainer does: the group is destroyed at exit
    if mode.startswith("exit"):
        process_failure.WATCH_INTERVAL = 0.0
    print(f"process {rank} watching: {vllm_server.watch_for_server_failure(trainer)}", flush=True)
    dist.barrier()
    if rank == 0:  # what `launch` measures from (wall clock: the launcher is another process)
        print(f"both processes up at {time.time():.3f}\n", end="", flush=True)  # one write: see `launch`

    if mode == "report":
        with process_failure.watching(trainer):
            if rank == 1:
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
    elif mode == "hung-generation":
        args.vllm_request_timeout = 2.0

        class Client:  # TRL's VLLMClient.generate: a POST without a timeout
            base_url = url

            def generate(self):
                return requests.post(f"{url}/v1/completions", json={"prompt": [[1, 2]]}).json()

        trainer.vllm_generation = SimpleNamespace(vllm_client=Client() if rank == 0 else None)
        print(f"process {rank} bounds its requests: {vllm_server.bound_server_requests(trainer)}", flush=True)
        with process_failure.watching(trainer):
            answer = torch.zeros(1)
            with vllm_server.server_errors_named(trainer):
                if rank == 1:
                    dist.broadcast(answer, src=0)  # the main process's answer, which never comes
                    sys.exit("process 1 got an answer")
                started = time.monotonic()
                try:
                    trainer.vllm_generation.vllm_client.generate()
                finally:
                    print(f"process 0: finally ran after {time.monotonic() - started:.2f} s", flush=True)
            sys.exit("process 0 got an answer")
    elif mode == "queue-dry":
        with process_failure.watching(trainer):
            if rank == 1:
                dist.broadcast(torch.zeros(1), src=0)  # the batch the main process would dispatch
                sys.exit("process 1 got a batch")
            server.shutdown()
            server.server_close()  # the server is gone
            ProbeWhileWaiting = vllm_server.ProbeWhileWaiting
            ProbeWhileWaiting(lambda stale_after_s: None, trainer, url)(300.0)  # TRL's worker check passes
            sys.exit("process 0: the probe passed")
    elif mode == "deadline":
        with process_failure.watching(trainer):
            message = f"The weight sync to the vLLM server at {url} did not finish within 1 s (test)."
            with process_failure.deadline(trainer, 1.0, message, "VLLMServerError"):
                if rank == 0:
                    time.sleep(120)  # a transfer to a server that died in the middle of it
                dist.barrier()
            sys.exit(f"process {rank} left the weight sync")
    elif mode in ("exit", "exit-atexit"):
        if mode == "exit":
            with process_failure.watching(trainer):
                for _ in range(3):
                    with vllm_server.server_errors_named(trainer):
                        dist.barrier()
        else:
            for _ in range(3):
                with vllm_server.server_errors_named(trainer):
                    dist.barrier()
        print(f"process {rank} done", flush=True)
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
