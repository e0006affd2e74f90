# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""examples/rpg_math.py, run unchanged (its parser and `main`), recording what each training step trains on: the e2e
stage of research/gpu/gpu_run.sh launches this instead of the example, so that its check (research/gpu/gpu_stages.py
`e2e_check`) can tell whether a resumed run trained on the very batches of the uninterrupted one.

With `RPG_E2E_BATCHES=PATH`, every batch the trainer's `_prepare_inputs` hands to a training step appends one JSON
line: the step (1-based), the process, a SHA-256 of its prompt and completion token ids and masks ("tokens"), and one
of its advantages ("advantages", float32 bytes: the rewards' normalisation). Logged metrics only summarise the
completions (lengths, rewards); two different samples with the same lengths and rewards pass them. The digests cost a
copy of a few kB to the CPU per step.
"""

import hashlib
import json
import os
import sys

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import rpg_math  # noqa: E402  (examples/, put on the path above)


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        # The raw bytes whatever the dtype (bf16 has no numpy type), with the shape: equal digests, equal tensors.
        h.update(str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        h.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def record_batches(trainer_cls, path: str) -> None:
    original = trainer_cls._prepare_inputs

    def _prepare_inputs(self, generation_batch):
        inputs = original(self, generation_batch)
        if self.model.training:
            record = {
                "step": self.state.global_step + 1,  # the step about to train on `inputs`
                "process": self.accelerator.process_index,
                "tokens": digest(
                    *(inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
                ),
                "advantages": digest(inputs["advantages"]),
            }
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return inputs

    trainer_cls._prepare_inputs = _prepare_inputs


if __name__ == "__main__":
    if os.environ.get("RPG_E2E_BATCHES"):
        for cls in (rpg_math.MathRPGTrainer, rpg_math.BaselineTrainer, rpg_math.ReinforcePlusPlusBaselineTrainer):
            record_batches(cls, os.environ["RPG_E2E_BATCHES"])
    rpg_math.main(*rpg_math.make_parser().parse_args_and_config())
