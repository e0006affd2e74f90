"""What the tests that train a tiny local Qwen3 on CPU share: the prompts and the settings of a short, quiet run."""

import json
import logging
import string

import torch
from datasets import Dataset

from rpg_research.toy import no_activation_checkpointing


#: 100 "a+b=" prompts, all covered by the character tokenizer of `rpg_research.toy`.
PROMPTS = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)]})


def save_math_assets(root) -> dict:
    """The inputs of `examples/rpg_math.py` runs, written under the folder `root`: a tiny Qwen3 whose character tokenizer
    covers the paper's prompt (`model`), 24 "What is a+b?" training problems (`train.jsonl`) and 4 "What is a*2?"
    evaluation problems (`tiny_eval.jsonl`). Returns their paths by those names (the tiny model answers wrong; fine)."""
    from tokenizers import Regex, pre_tokenizers

    from rpg_research.toy import build_char_tokenizer, save_tiny_model

    tokenizer = build_char_tokenizer(string.printable)
    # One token per character, newlines included (the prompt has blank lines).
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    model = save_tiny_model(root / "model", tokenizer=tokenizer, max_position_embeddings=512)
    train = root / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"problem": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n"
            for a in range(1, 9)
            for b in range(1, 4)
        )
    )
    evaluation = root / "tiny_eval.jsonl"
    evaluation.write_text(
        "".join(json.dumps({"question": f"What is {a}*2?", "answer": str(2 * a)}) + "\n" for a in range(1, 5))
    )
    return {"root": root, "model": model, "train": str(train), "eval": str(evaluation)}


def quiet_cpu_args(output_dir, **overrides) -> dict:
    """`RPGConfig` keyword arguments of a short CPU run that logs every step with seed 0 and writes nothing else (no
    report, no checkpoint, no progress bar); `overrides` add to or replace them."""
    return {
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }


def tiny_run_args(output_dir, **overrides) -> dict:
    """[`quiet_cpu_args`] of a 2-step run on the tiny Qwen3: 2 groups of 4 completions of 8 tokens per step,
    learning rate 1e-2, no gradient checkpointing; `overrides` add to or replace them."""
    defaults = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        **no_activation_checkpointing(),
        learning_rate=1e-2,
    )
    return quiet_cpu_args(output_dir, **{**defaults, **overrides})


def count_sevens(completions, **kwargs):
    """An obvious reward: the fraction of '7' characters in an 8-character completion."""
    return [c.count("7") / 8 for c in completions]


def sevens_unless_even(completions, prompts, **kwargs):
    """Constant (zero-variance) reward for prompts starting with an even digit, the count of '7's otherwise: the groups
    of even prompts have no signal (dynamic sampling drops them)."""
    return [0.0 if int(p[0]) % 2 == 0 else c.count("7") / 8 for p, c in zip(prompts, completions)]


def make_trainer(model_dir, tmp_path, trainer_cls=None, config_cls=None, reward=count_sevens, **overrides):
    """A trainer (`RPGTrainer` by default, or e.g. TRL's `GRPOTrainer` with `GRPOConfig`) of a [`tiny_run_args`] run
    on the tiny model in `model_dir`, with the [`PROMPTS`] and the character tokenizer."""
    from rpg_research.toy import build_char_tokenizer
    from rpg_trl import RPGConfig, RPGTrainer

    args = (config_cls or RPGConfig)(**tiny_run_args(tmp_path, **overrides))
    return (trainer_cls or RPGTrainer)(
        model_dir, reward, args=args, train_dataset=PROMPTS, processing_class=build_char_tokenizer()
    )


def logged(trainer, key):
    """Every logged value of `key`, in order."""
    return [h[key] for h in trainer.state.log_history if key in h]


def rpg_warnings(caplog):
    """The warnings that `rpg_trl` logged, as captured by pytest's `caplog`."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("rpg_trl") and r.levelno == logging.WARNING]


def policy_logps(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The trainer's per-token log-probs of the completion tokens under its current model (no gradient), (B, T)."""
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.size(1),
        )[0]


def fixed_inputs(trainer, batch_size=8, completion_len=6, seed=0, spread=0.5):
    """A scored batch in the format `GRPOTrainer._compute_loss` receives, off-policy: π_old and π_ref are the
    current policy's log-probs shifted by independent uniform noise in [-spread, spread] (spread 0.2 keeps every
    importance weight inside RPG-Style Clip's trust region [0.8, 1.28]); ragged completions."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.processing_class.vocab_size
    prompt_ids = torch.randint(2, vocab, (batch_size, 4), generator=g)
    completion_ids = torch.randint(2, vocab, (batch_size, completion_len), generator=g)
    completion_mask = torch.ones(batch_size, completion_len, dtype=torch.long)
    for i in range(batch_size):
        completion_mask[i, completion_len - (i % 4) :] = 0
    logps = policy_logps(trainer, prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask)

    def noise():
        return (2 * torch.rand(logps.shape, generator=g) - 1) * spread

    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch_size, generator=g),
        "old_per_token_logps": logps + noise(),
        "ref_per_token_logps": logps + noise(),
        "num_items_in_batch": completion_mask.sum(),
    }


def assert_close_in_norm(actual, expected, ulps=64, dtype=None, what="tensor"):
    """`actual` equals `expected` up to floating-point rounding, on any CPU: ‖actual − expected‖ ≤ ulps · eps · ‖expected‖,
    with eps the machine epsilon of `dtype` (default: `expected`'s dtype). The bound is relative to the norm of the
    whole tensor, so entries near zero, whose value depends on the order in which the CPU's kernels sum, cannot fail
    it (an elementwise relative tolerance does); a missing or wrong term of the loss is orders of magnitude above it."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    eps = torch.finfo(dtype or expected.dtype).eps
    error = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert error <= ulps * eps * scale, f"{what}: |actual - expected| = {error:.3e} > {ulps} * {eps:.2e} * {scale:.3e}"


def loss_and_grad(trainer, inputs, accumulation_steps=1, with_logps_grad=False):
    """The training loss of `trainer._compute_loss` on `inputs` and the flattened gradient it gives; with
    `with_logps_grad`, also the gradient of the loss with respect to the policy's per-token log-probs (B, T): the part
    of the gradient that the loss itself decides, before the model's backward pass, which is the same code for any
    two trainers of the same model."""
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation_steps
    seen = []
    compute_logps = trainer._get_per_token_logps_and_entropies

    def keep_logps(*args, **kwargs):
        logps, *rest = compute_logps(*args, **kwargs)
        if logps.requires_grad:
            logps.retain_grad()
            seen.append(logps)
        return (logps, *rest)

    trainer._get_per_token_logps_and_entropies = keep_logps
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    if not with_logps_grad:
        return loss.detach(), grads
    assert len(seen) == 1, f"expected one differentiable log-prob computation, got {len(seen)}"
    return loss.detach(), grads, seen[0].grad
