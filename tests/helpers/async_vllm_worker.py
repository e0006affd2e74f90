"""`AsyncRPGTrainer` as it runs at scale, for `tests/test_vllm.py`: several training processes (`accelerate launch`,
e.g. `accelerate_configs/fsdp2.yaml` with 2 CPU processes through `tests/helpers/cpu_launch.py`) against one real
`trl vllm-serve`, TRL's `AsyncRolloutWorker` sampling from it on the main process, the weights pushed after each
update by the test-side `helpers.vllm_async_transfer.FileWeightTransfer` (in place of TRL's NCCL transfer).

    accelerate launch ... tests/helpers/cpu_launch.py tests/helpers/async_vllm_worker.py MODEL URL OUTPUT_DIR RECORD \
        [--max-steps N] [--save-steps N] [--max-staleness N] [--resume CHECKPOINT]

Writes, under RECORD: `taken.pt` (main process: every sample taken from the rollout queue, with the trainer's policy
version then), `sent.pt` (main process: the weights of every version pushed, in order), `history.json` (main process:
the logged steps, the last version pushed, and what the server sampled for a fixed prompt right after each push) and
`trained_rank{R}.json` (each process: the sampler's log-probs of every completion it trained on, one list per
completion, in the order of its packed rows). Test code only.
"""

import argparse
import json
import string
import sys
from pathlib import Path


if __name__ == "__main__":  # run as a script: `tests/` on the path, for `helpers.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def printable_tokenizer():
    """The character tokenizer over `string.printable` (as `tests/test_vllm.py` builds it), with Qwen3's chat
    template, whose response template TRL's rollout worker parses."""
    from tokenizers import Regex, pre_tokenizers
    from trl.chat_template_utils import qwen3_chat_template

    from rpg_trl.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer(string.printable)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def async_prompts():
    from datasets import Dataset

    pairs = [(a, b) for a in range(10) for b in range(10)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs]})


class RecordingQueue:
    """TRL's rollout queue as the trainer reads it, keeping what each sample taken carries and the trainer's policy
    version then."""

    def __init__(self, rollout_queue, trainer, taken: list):
        self.queue, self.trainer, self.taken = rollout_queue, trainer, taken

    def get(self, *args, **kwargs):
        sample = self.queue.get(*args, **kwargs)
        self.taken.append(
            {
                "input_ids": [int(i) for i in sample.input_ids],
                "completion_mask": [int(m) for m in sample.completion_mask],
                "old_log_probs": [float(p) for p in sample.old_log_probs],
                "model_version": int(sample.model_version),
                "trainer_version": int(self.trainer.model_version),
            }
        )
        return sample

    def __getattr__(self, name):
        return getattr(self.queue, name)


class ProbingTransfer:
    """The test's weight transfer, which right after each push (once the server resumed) samples one completion of a
    fixed prompt from the server, seeded, and keeps its tokens and vLLM's log-prob of each (`probes`)."""

    def __init__(self, transfer, prompt_ids: list[int], max_tokens: int = 8):
        self.transfer, self.prompt_ids, self.max_tokens, self.probes = transfer, prompt_ids, max_tokens, []

    def resume(self) -> None:
        import requests

        self.transfer.resume()
        url = self.transfer.vllm.server_url
        model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        payload = {"model": model, "prompt": self.prompt_ids, "max_tokens": self.max_tokens, "temperature": 1.0}
        payload.update({"n": 1, "return_token_ids": True, "logprobs": 0, "seed": 0})
        response = requests.post(f"{url}/v1/completions", json=payload, timeout=30)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        self.probes.append({"completion": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]})

    def __getattr__(self, name):
        return getattr(self.transfer, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("server_url")
    parser.add_argument("output_dir")
    parser.add_argument("record")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--resume", default=None)
    opts = parser.parse_args()

    import torch

    from rpg_trl import AsyncRPGConfig, AsyncRPGTrainer
    from rpg_trl.testing.cpu_rollouts import cpu_backend

    from helpers.async_harness import async_args, digit_reward
    from helpers.vllm_async_transfer import FileWeightTransfer

    record = Path(opts.record)
    trained = []

    class RecordingAsyncRPGTrainer(AsyncRPGTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            _, terms = self._packed_row(inputs)
            for segment in terms["segment_id"].unique(sorted=True).tolist():
                trained.append(terms["old_log_probs"][terms["segment_id"] == segment].tolist())
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = AsyncRPGConfig(
        **async_args(
            opts.output_dir,
            vllm_server_base_url=opts.server_url,
            per_device_train_batch_size=8,  # 16 samples (4 groups) per optimizer step over the 2 processes
            max_completion_length=8,
            max_staleness=opts.max_staleness,
            max_steps=opts.max_steps,
            learning_rate=3e-2,
            request_timeout=30,
            max_inflight_tasks=8,
            queue_maxsize=16,
            save_strategy="steps",
            save_steps=opts.save_steps,
        )
    )
    tokenizer = printable_tokenizer()
    text = tokenizer.apply_chat_template(async_prompts()[0]["prompt"], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    transfer = ProbingTransfer(FileWeightTransfer(opts.server_url), prompt_ids)
    with cpu_backend():
        trainer = RecordingAsyncRPGTrainer(
            opts.model,
            reward_funcs=digit_reward,
            args=args,
            train_dataset=async_prompts(),
            processing_class=tokenizer,
            weight_transfer=transfer,
        )
        taken = []
        if trainer.accelerator.is_main_process:  # the rollout queue lives there
            trainer.rollout_queue = RecordingQueue(trainer.rollout_queue, trainer, taken)
        trainer.train(resume_from_checkpoint=opts.resume)
    record.mkdir(parents=True, exist_ok=True)
    rank = trainer.accelerator.process_index
    (record / f"trained_rank{rank}.json").write_text(json.dumps(trained))
    if trainer.accelerator.is_main_process:
        torch.save(taken, record / "taken.pt")
        torch.save(transfer.sent, record / "sent.pt")
        losses = [entry for entry in trainer.state.log_history if "loss" in entry]
        logged = {"history": losses, "version": trainer.model_version, "prompt": prompt_ids, "probes": transfer.probes}
        (record / "history.json").write_text(json.dumps(logged))
    trainer.accelerator.wait_for_everyone()
    print(f"process {rank}: trained {len(trained)} completions", flush=True)


if __name__ == "__main__":
    main()
