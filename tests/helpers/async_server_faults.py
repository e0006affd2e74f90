"""An `AsyncRPGTrainer` whose TRL rollout worker (`AsyncRolloutWorker`, a spawned process) samples from the stand-in
vLLM server of `helpers.hung_server`, for the bound on its completion requests (`vllm_request_timeout`,
`rpg_trl/async_rpg/rollouts.py`; issue 73, item 2).

[`FailingServer`]: the stand-in, answering every request to one path with HTTP 500 (a server that keeps failing).
[`patch_trl`]: TRL's rollout worker without vLLM installed (its availability check passes; the worker's requests are
TRL's own aiohttp requests, made to the stand-in). [`build_trainer`]: the trainer on the stand-in, its weight sync a
no-op ([`NullWeightTransfer`]: TRL's is NCCL), its prompts conversational (the worker applies the chat template).
"""

from __future__ import annotations

from helpers.hung_server import HangingServer


class FailingServer(HangingServer):
    """The stand-in server, answering each request to `fail_on` with `500 Internal Server Error` (and an empty JSON
    body); `counts` as the stand-in's."""

    def __init__(self, model: str, fail_on: str):
        super().__init__(model)
        self.fail_on = fail_on

    def _answer(self, handler) -> None:
        from urllib.parse import urlparse

        path = urlparse(handler.path).path
        if path != self.fail_on:
            return super()._answer(handler)
        length = int(handler.headers.get("Content-Length") or 0)
        handler.rfile.read(length)
        with self._lock:
            self.counts[path] = self.counts.get(path, 0) + 1
        handler.send_response(500)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "2")
        handler.end_headers()
        handler.wfile.write(b"{}")


class AnsweringServer(HangingServer):
    """The stand-in server, answering every completion request with the tokens `completion_ids` (at most the request's
    `max_tokens` of them, each with the stand-in's log-prob): the same completion for every prompt, e.g. a hostile
    answer for the reward; `counts` as the stand-in's."""

    def __init__(self, model: str, completion_ids: list[int]):
        super().__init__(model)
        self.completion_ids = list(completion_ids)

    def _payload(self, path: str, body: dict):
        from helpers.hung_server import LOGPROB

        if path != "/v1/completions":
            return super()._payload(path, body)
        ids = self.completion_ids[: body["max_tokens"]]
        choice = {
            "token_ids": ids,
            "logprobs": {
                "tokens": [f"token_id:{i}" for i in ids],
                "token_logprobs": [LOGPROB] * len(ids),
                "top_logprobs": [None] * len(ids),
            },
        }
        return {"choices": [dict(choice, prompt_token_ids=p) for p in body["prompt"] for _ in range(body["n"])]}


class NullWeightTransfer:
    """TRL's `WeightTransferProtocol`, doing nothing (the stand-in server takes no weights)."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def patch_trl(setattr_) -> None:
    """TRL's `AsyncRolloutWorker` without vLLM installed: `setattr_(obj, name, value)` sets each attribute (e.g.
    `monkeypatch.setattr`). The spawned worker process checks nothing."""
    from trl.experimental.async_grpo import async_rollout_worker

    setattr_(async_rollout_worker, "is_vllm_available", lambda *args, **kwargs: True)


def digits(completions, **kwargs):
    """A reward (module level: TRL's worker pickles it into its process)."""
    return [float(sum(ch.isdigit() for m in c for ch in m["content"])) for c in completions]


def build_trainer(model: str, output_dir, url: str, seconds, **overrides):
    """A 2-step `AsyncRPGTrainer` on the stand-in at `url` with `vllm_request_timeout=seconds`, TRL's own rollout worker
    and a no-op weight sync (TRL patched by the caller, [`patch_trl`])."""
    from transformers import AutoTokenizer

    from rpg_trl.async_rpg import AsyncRPGConfig, AsyncRPGTrainer

    from helpers.async_harness import async_args
    from helpers.async_vllm_worker import async_prompts

    args = AsyncRPGConfig(
        **async_args(
            output_dir,
            vllm_server_base_url=url,
            vllm_request_timeout=seconds,
            max_inflight_tasks=4,
            **overrides,
        )
    )
    return AsyncRPGTrainer(
        model,
        reward_funcs=digits,
        args=args,
        train_dataset=async_prompts(),
        processing_class=AutoTokenizer.from_pretrained(model),
        weight_transfer=NullWeightTransfer(),
    )
