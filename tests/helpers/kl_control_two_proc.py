"""Two-process CPU (gloo) runs of the adaptive KL coefficient for `tests/test_kl_control.py`.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/kl_control_two_proc.py MODEL_DIR OUT_DIR

[`run`] trains 4 optimizer steps with `kl_target` and a reference model, the global batch of 8 completions split over
the processes (the deterministic, ragged rollout of `tests/helpers/mp_worker.py`), in float64 with SGD, so that one
process and two see the same completions and take the same steps. Each process writes OUT_DIR/rank{r}.pt: the β that
each step's loss used (logged `beta`), the KL the controller saw (`kl_control/kl`), the final β of its controller and
of its loss specification.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3ForCausalLM

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.testing import build_char_tokenizer


if __name__ == "__main__":  # run as a script: `tests/` on the path, for `helpers.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.mp_worker import GLOBAL_BATCH, make_rollout  # noqa: E402
from helpers.tiny_runs import PROMPTS, quiet_cpu_args  # noqa: E402


def run(model_dir, output_dir, world_size: int) -> dict:
    def digit_reward(completions, **kwargs):
        return [sum(ch.isdigit() for ch in c) / 8 for c in completions]

    tokenizer = build_char_tokenizer()
    args = RPGConfig(
        **quiet_cpu_args(
            output_dir,
            per_device_train_batch_size=GLOBAL_BATCH // world_size,
            num_generations=4,
            max_completion_length=8,
            steps_per_generation=1,
            num_iterations=2,
            max_steps=4,
            optim="sgd",
            learning_rate=2.0,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            kl_anchor="reference",
            beta=0.1,
            kl_target=0.005,
            kl_horizon=8.0,  # 8 samples per step: β moves by up to ±20% a step
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
    history = trainer.state.log_history
    return {
        "beta": [h["beta"] for h in history if "beta" in h],
        "kl": [h["kl_control/kl"] for h in history if "kl_control/kl" in h],
        "controller_beta": trainer.kl_control_callback.beta,
        "loss_beta": trainer.rpg_beta,
    }


if __name__ == "__main__":
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    result = run(model_dir, f"{out_dir}/run", world_size=2)
    torch.save(result, f"{out_dir}/rank{dist.get_rank()}.pt")
