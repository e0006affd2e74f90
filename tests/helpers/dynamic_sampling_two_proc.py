"""Two-process (CPU, gloo) run for `tests/test_dynamic_sampling.py`: replacement prompts under DDP.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/dynamic_sampling_two_proc.py MODEL_DIR OUT_DIR

A 2-step run (one generation batch of 4 groups per process) with dynamic sampling and a reward that is constant for
the prompts starting with an even digit, so that extra rounds draw replacement prompts. Each process writes
OUT_DIR/rank{R}.json: the prompts of its generation batches (one per group), the number of generation rounds and the
state of its replacement-prompt stream at the end.
"""

import json
import os
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `tests/` on the path, for `helpers.*`

from rpg_trl import RPGConfig, RPGTrainer  # noqa: E402
from rpg_trl.testing import build_char_tokenizer  # noqa: E402

from helpers.tiny_runs import PROMPTS, sevens_unless_even, tiny_run_args  # noqa: E402


class RecordingRPGTrainer(RPGTrainer):
    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:
            prompts = self.processing_class.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
            self.recorded.append(prompts[:: self.num_generations])
        return batch


if __name__ == "__main__":
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    args = RPGConfig(
        **tiny_run_args(
            out_dir, steps_per_generation=2, max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=8
        )
    )
    tokenizer = build_char_tokenizer()
    trainer = RecordingRPGTrainer(
        model_dir, sevens_unless_even, args=args, train_dataset=PROMPTS, processing_class=tokenizer
    )
    trainer.recorded = []
    trainer.train()
    rounds = [h["dynamic_sampling/rounds"] for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    stream = trainer.prompt_stream
    report = {"batches": trainer.recorded, "rounds": rounds, "stream": stream and stream.state_dict()}
    with open(os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
