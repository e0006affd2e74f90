"""A stand-in vLLM server that hangs, for the bound on every request of a server-mode run (`vllm_request_timeout`,
`rpg_trl/reliability/vllm_server.py`; issue 62, item 1).

[`HangingServer`]: an HTTP server in threads on 127.0.0.1 that answers what TRL 1.16's `VLLMClient` asks of a vLLM
server (`/health`, `/v1/models`, `/server_info`, `/get_world_size`, `/v1/completions` with fixed completions and
log-probs, the weight-update endpoints, `/reset_prefix_cache`) and, from the `hang_at`-th request to the path `hang_on`,
accepts the request and never answers it (until [`HangingServer.close`]): a hung engine whose HTTP front still answers
`/health`.

[`patch_trl`] lets TRL's server mode run without vLLM installed: its availability check passes, the NCCL communicator
is not opened (`init_communicator`, which needs CUDA) and the weights' broadcast only reads them; every HTTP request of
the client is TRL's own, made to the stand-in.

`python -m helpers.hung_server PATH AT SECONDS MODEL OUTPUT_DIR` (from `tests/`): a single-process RPGTrainer run whose
server hangs at the AT-th request to PATH, bounded to SECONDS (for a hang that ends the process: the weight sync).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


#: The token id of every completion token ("7" in the tiny model's character tokenizer) and its log-prob.
TOKEN, LOGPROB = 15, -1.5


class HangingServer:
    """The stand-in server, started; `url` is its address. `counts[path]`: the requests to each path so far."""

    def __init__(self, model: str, hang_on: str | None = None, hang_at: int = 1):
        self.model, self.hang_on, self.hang_at = model, hang_on, hang_at
        self.counts: dict[str, int] = {}
        self.hung_at: float | None = None  # `time.monotonic()` when the held request arrived
        self._release = threading.Event()
        self._lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - the name http.server calls
                stand_in._answer(self)

            def do_POST(self):  # noqa: N802
                stand_in._answer(self)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Let a held request go (its connection is closed without an answer) and stop the server."""
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler) -> None:
        path = urlparse(handler.path).path
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length) or b"{}") if length else {}
        with self._lock:
            count = self.counts[path] = self.counts.get(path, 0) + 1
        if path == self.hang_on and count >= self.hang_at:
            self.hung_at = time.monotonic()
            # Wall clock, for a test in another process; one write (a `print` with its newline is two when unbuffered).
            print(f"request held at {time.time():.3f}\n", end="", flush=True)
            self._release.wait()  # accepted, never answered
            handler.close_connection = True
            return
        payload = self._payload(path, body)
        data = json.dumps(payload).encode()
        handler.send_response(200 if payload is not None else 404)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _payload(self, path: str, body: dict):
        if path == "/health":
            return {}
        if path == "/v1/models":
            return {"data": [{"id": self.model}]}
        if path == "/server_info":
            return {
                "vllm_config": {
                    "model_config": {"model": self.model, "logprobs_mode": "processed_logprobs"},
                    "weight_transfer_config": {"backend": "nccl"},
                }
            }
        if path == "/get_world_size":
            return {"world_size": 1}
        if path == "/v1/completions":
            length = body["max_tokens"]
            choice = {
                "token_ids": [TOKEN] * length,
                "logprobs": {
                    "tokens": [f"token_id:{TOKEN}"] * length,
                    "token_logprobs": [LOGPROB] * length,
                    "top_logprobs": [None] * length,
                },
            }
            return {"choices": [dict(choice, prompt_token_ids=p) for p in body["prompt"] for _ in range(body["n"])]}
        if path in ("/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"):
            return {}
        return None


def patch_trl(setattr_) -> None:
    """TRL's server mode without vLLM installed (see the module); `setattr_(obj, name, value)` sets each attribute, e.g.
    `monkeypatch.setattr` (undone after the test) or `setattr`."""
    import trl.generation.vllm_client as vllm_client
    import trl.generation.vllm_generation as vllm_generation

    class Weights:  # vLLM's NCCL engine: the trainer's side of the broadcast reads the weights
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            for _ in iterator:
                pass

    setattr_(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    setattr_(vllm_generation, "is_vllm_available", lambda *args, **kwargs: True)
    setattr_(vllm_client.VLLMClient, "init_communicator", lambda self, device=0: None)
    setattr_(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", False)
    setattr_(vllm_client, "NCCLWeightTransferEngine", Weights)
    setattr_(vllm_client, "NCCLTrainerSendWeightsArgs", lambda **kwargs: kwargs)


def server_mode_args(output_dir, url: str, seconds: float, **overrides) -> dict:
    """`RPGConfig` keyword arguments of a tiny server-mode run (one generation per optimizer step) with the stand-in at
    `url` and `vllm_request_timeout=seconds`."""
    from helpers.tiny_runs import tiny_run_args

    return tiny_run_args(
        output_dir,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=10,
        vllm_request_timeout=seconds,
        **overrides,
    )


def build_trainer(model: str, output_dir, url: str, seconds: float, **overrides):
    """A tiny server-mode RPGTrainer (TRL patched by the caller) on the stand-in at `url`."""
    from rpg_trl import RPGConfig, RPGTrainer

    from helpers.tiny_runs import PROMPTS, count_sevens

    args = RPGConfig(**server_mode_args(output_dir, url, seconds, **overrides))
    return RPGTrainer(model, reward_funcs=count_sevens, args=args, train_dataset=PROMPTS)


def main(path: str, at: int, seconds: float, model: str, output_dir: str) -> None:
    patch_trl(setattr)
    server = HangingServer(model, hang_on=path, hang_at=at)
    trainer = build_trainer(model, output_dir, server.url, seconds, max_steps=5)
    print(f"stand-in server: {server.url}", flush=True)
    try:
        trainer.train()
    finally:
        print(f"finally ran at step {trainer.state.global_step}", flush=True)
    sys.exit("the run finished")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5])
