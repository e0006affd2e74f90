"""Two-process runs for the crash tests of `tests/test_multiprocess.py`: a process dies, the job ends, the run resumes.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/save_crash_two_proc.py MODEL_DIR OUTPUT_DIR [--resume]
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --use_cpu --num_processes 2 ... \
        tests/helpers/cpu_launch.py tests/helpers/save_crash_two_proc.py MODEL_DIR OUTPUT_DIR [--resume]

trains the "sampling" run of `tests/helpers/crash_worker.py` (sampling at temperature 1, a generation every 3 steps, a
checkpoint every 2) for 5 steps with 2 processes of 4 completions each (DDP over gloo, or DeepSpeed ZeRO-2 under
`accelerate launch`); with `--resume`, from the newest complete checkpoint of OUTPUT_DIR. `RPG_TEST_KILL` kills a
process where it says (`tests/helpers/save_faults.py`). Process 0 writes OUTPUT_DIR/result.json: the log history, the
digest of the final weights and the distributed type.
"""

import argparse
import json
import os
import sys
from pathlib import Path


if __name__ == "__main__":  # run as a script: `tests/` on the path, for `helpers.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import crash_worker  # noqa: E402
from helpers.save_faults import install_from_env  # noqa: E402


MAX_STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--resume", action="store_true")
    opts = parser.parse_args()
    install_from_env()
    result = crash_worker.run(opts.model_dir, opts.output_dir, "sampling", resume=opts.resume, max_steps=MAX_STEPS)
    if result["process_index"] == 0:
        with open(os.path.join(opts.output_dir, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
