"""Two-process CPU (gloo) runs for `tests/test_multiprocess.py`: one global batch, split over two processes.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/mp_worker.py MODEL_DIR OUT_DIR

(`accelerate launch --cpu --num_processes 2` starts one process unless MPI is set up; torchrun is what `accelerate
launch --multi_gpu` wraps, and accelerate then joins a gloo process group on CPU, as `use_cpu=True` asks.)

For each aggregation the run trains 2 optimizer steps with `per_device_train_batch_size = 8 / world_size` on
completions from a deterministic rollout function (ragged lengths, identical whatever the batch layout), in float64,
with SGD (the update is the gradient itself; Adam's first step, ≈ lr·sign(g), would amplify rounding noise) and
`num_iterations = 2` (the second step is off-policy: importance weights ≠ 1, clipping, a non-zero KL). Process 0
writes OUT_DIR/{aggregation}.pt: the log history, the final weights and the prompts that each process saw.
"""

import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3ForCausalLM

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.losses import AGGREGATIONS
from rpg_trl.testing import build_char_tokenizer, make_fixed_rollout


if __name__ == "__main__":  # run as a script: `tests/` on the path, for `helpers.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.tiny_runs import PROMPTS, quiet_cpu_args  # noqa: E402


GLOBAL_BATCH = 8


def make_rollout(tokenizer):
    """`make_fixed_rollout`, cut to a length in [2, 8] fixed by (prompt, occurrence): ragged, layout-independent."""
    fixed = make_fixed_rollout(8, 2, len(tokenizer), seed=0)

    def rollout(prompts, trainer):
        output = fixed(prompts, trainer)
        seen: dict[str, int] = {}
        for i, prompt in enumerate(prompts):
            k = seen.get(prompt, 0)
            seen[prompt] = k + 1
            length = 2 + (zlib.crc32(prompt.encode()) + 3 * k) % 7
            output["completion_ids"][i] = output["completion_ids"][i][:length]
        return output

    return rollout


#: Runs beside the aggregations: name -> (aggregation, config overrides).
VARIANTS = {
    # Each position's KL over the vocabulary, against π_old (its head copied at generation): the KL runs inside the
    # fused head of the DDP-wrapped forward, so its head gradient is reduced with the others.
    "vocabulary": ("token-mean", {"kl_estimate": "vocabulary", "kl_anchor": "sampling"}),
}


def run(model_dir, output_dir, aggregation: str, world_size: int, **overrides) -> dict:
    """Train 2 steps with the global batch split over `world_size` processes; return what process 0 reports."""
    seen_prompts: list[str] = []

    def digit_reward(prompts, completions, **kwargs):
        seen_prompts.extend(prompts)
        return [sum(ch.isdigit() for ch in c) / 8 for c in completions]

    tokenizer = build_char_tokenizer()
    args = RPGConfig(
        **quiet_cpu_args(
            output_dir,
            aggregation=aggregation,
            per_device_train_batch_size=GLOBAL_BATCH // world_size,
            num_generations=4,
            max_completion_length=8,
            steps_per_generation=1,
            num_iterations=2,
            max_steps=2,
            optim="sgd",
            learning_rate=2.0,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            beta=0.1,
            **overrides,
        )
    )
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    trainer = RPGTrainer(
        model,
        digit_reward,
        args=args,
        train_dataset=PROMPTS,
        processing_class=tokenizer,
        rollout_func=make_rollout(tokenizer),
    )
    assert trainer.accelerator.num_processes == world_size, trainer.accelerator.num_processes
    trainer.train()
    prompts_per_process = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(prompts_per_process, seen_prompts)
    else:
        prompts_per_process = [seen_prompts]
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"log_history": trainer.state.log_history, "weights": weights, "prompts": prompts_per_process}


if __name__ == "__main__":
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    runs = {aggregation: (aggregation, {}) for aggregation in AGGREGATIONS} | VARIANTS
    for name, (aggregation, overrides) in runs.items():
        result = run(model_dir, f"{out_dir}/{name}-run", aggregation, world_size=2, **overrides)
        if dist.get_rank() == 0:
            torch.save(result, f"{out_dir}/{name}.pt")
