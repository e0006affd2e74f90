"""What the tests of the asynchronous trainers share: a quiet CPU configuration, a local rollout worker on the tiny
Qwen3, packed batches built by TRL's own packer, and the log-probabilities of a plain (unpacked) forward pass.

The rollout worker, the weight transfer and the CPU stand-ins for TRL's GPU-only parts are those of the library's
testing package, `rpg_trl.testing.cpu_rollouts` (the `rpg-trl bench-async` command uses them too); this module only
wires them for tests.
"""

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow

from rpg_trl.testing import no_activation_checkpointing
from rpg_trl.testing.cpu_rollouts import LocalRolloutWorker, LocalWeightTransfer


#: "a+b=" prompts with their sum, covered by the character tokenizer of `rpg_trl.testing`.
PROMPTS = Dataset.from_dict(
    {
        "prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)],
        "solution": [str(a + b) for a in range(10) for b in range(10)],
    }
)
NUM_GENERATIONS = 4
SAMPLES_PER_STEP = 16
MAX_COMPLETION_LENGTH = 6


def digit_reward(completions, **kwargs):
    """Fraction of digits in the completion: cheap, and it varies within a group of an untrained model. A completion is
    a string, or (conversational prompts, as TRL's vLLM rollout worker scores them) a list of messages."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [sum(c.isdigit() for c in text) / MAX_COMPLETION_LENGTH for text in texts]


def async_args(output_dir, **overrides) -> dict:
    """Keyword arguments of an `AsyncRPGConfig`/`AsyncGRPOConfig` for a short, quiet CPU run: one micro-batch of 16
    samples (4 groups of 4) per optimizer step, completions of at most 6 tokens, learning rate 1e-2."""
    return {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": SAMPLES_PER_STEP,
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": MAX_COMPLETION_LENGTH,
        "token_budget": 0,
        "max_staleness": 4,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "max_steps": 2,
        "use_cpu": True,
        "bf16": False,
        **no_activation_checkpointing(),
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }


def make_worker(model_dir, lag=1, **overrides) -> LocalRolloutWorker:
    kwargs = dict(
        num_generations=NUM_GENERATIONS,
        samples_per_step=SAMPLES_PER_STEP,
        max_completion_length=MAX_COMPLETION_LENGTH,
        lag=lag,
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LocalRolloutWorker(model_dir, tokenizer, PROMPTS, digit_reward, **{**kwargs, **overrides})


def trainer_kwargs(model_dir, worker: LocalRolloutWorker) -> dict:
    """The trainer arguments that plug `worker` in (and keep TRL from looking for a vLLM server)."""
    return dict(
        train_dataset=PROMPTS,
        processing_class=worker.tokenizer,
        rollout_worker=worker,
        weight_transfer=worker.weight_transfer,
    )


class RecordingWeightTransfer(LocalWeightTransfer):
    """A [`LocalWeightTransfer`] that also keeps the weights of every sync, in order."""

    def __init__(self, versions):
        super().__init__(versions)
        self.sent: list[dict[str, torch.Tensor]] = []

    def send_weights(self, iterator):
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in iterator}
        self.sent.append(weights)
        self.versions.stage(weights)


def random_rollouts(tokenizer, num_samples=8, group_size=4, seed=0) -> list[dict]:
    """Rollout samples as TRL's `RolloutQueueDataset` yields them: random completions (3-6 tokens, end-of-sequence
    excluded) of the first prompts, advantages of both signs; `old_log_probs` are left at zero (set by the test)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        group = i // group_size
        prompt = tokenizer(PROMPTS[group]["prompt"], add_special_tokens=False)["input_ids"]
        length = int(torch.randint(3, 7, (1,), generator=generator))
        completion = torch.randint(2, len(tokenizer), (length,), generator=generator).tolist()
        samples.append(
            {
                "input_ids": torch.tensor(prompt + completion),
                "completion_mask": torch.tensor([0] * len(prompt) + [1] * length),
                "old_log_probs": torch.zeros(len(prompt) + length),
                "advantage": float(torch.randn((), generator=generator)),
                "group_id": group,
                "metrics": {},
            }
        )
    return samples


def pack(samples, pad_token_id) -> dict:
    """One micro-batch of `samples` for one process, packed and collated by TRL's own `TreeRow` and collator."""
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return DataCollatorForRollout(pad_token_id, num_processes=1)([[row]])


def completion_log_probs(model, samples, temperature=1.0):
    """log π(token | prefix) of every completion token of `samples` from a plain forward pass of `model` (padded batch,
    no packing), as a right-padded (B, T) tensor with its mask; differentiable."""
    lengths = [int(s["completion_mask"].sum()) for s in samples]
    rows, masks = [], []
    for sample, length in zip(samples, lengths, strict=True):
        ids = sample["input_ids"].unsqueeze(0)
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[-length:]
        rows.append(torch.nn.functional.pad(logps, (0, max(lengths) - length)))
        masks.append(torch.tensor([1.0] * length + [0.0] * (max(lengths) - length)))
    return torch.stack(rows), torch.stack(masks)


def plain_model(model_dir):
    """The tiny model with SDPA attention, for reference computations."""
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
