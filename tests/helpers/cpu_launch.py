"""Runs a training script under `accelerate launch` on CPU with the shipped (GPU) configs, bridging two CPU-only gaps.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 --num_machines 1 \
        --main_process_port 29511 --mixed_precision no --dynamo_backend no \
        tests/helpers/cpu_launch.py examples/rpg_math.py ... --use_cpu true --bf16 false

In each launched process it applies the shims below, then runs the script with its own arguments as `__main__`, as
`accelerate launch SCRIPT` would. With `RPG_LAUNCH_REPORT=DIR` set, each process also writes what it really ran
(`DIR/rank{R}.json`: distributed type, process count, how the parameters are laid out, which `rpg_trl` it imported),
for `tests/test_launch_configs.py` to tell a run that sharded from a silent fallback; with `RPG_VLLM_RECORD=DIR`, how
vLLM's log-probs compared with the trainer's at every generation (`DIR/rank{R}.jsonl`); with
`RPG_TEST_KILL_SERVER=PGID:N:STAMP`, the vLLM server is killed in the middle of a request (and each process says when
its `finally` around the script and its last `atexit` handler ran). Test-side only: nothing in `rpg_trl/` imports this file.
"""

import importlib
import json
import os
import runpy
import sys


def skip_deepspeed_shm_build() -> None:
    # Gap: DeepSpeed's CPU comm set-up JIT-compiles a shared-memory all-reduce with g++ (~2 min, once); gloo suffices.
    try:  # (`import deepspeed.comm.torch as m` would bind the `torch` module that `deepspeed.comm` imports)
        deepspeed_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    deepspeed_comm.build_shm_op = lambda: None


def apply_fsdp_plugin_on_cpu() -> None:
    # Gap: with `--use_cpu` accelerate enables FSDP for GPU back-ends only and silently trains DDP; FSDP2 shards over gloo.
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def parameter_layout(module) -> dict:
    """How the parameters of `module` are held by this process: FSDP2 DTensors (and their placements), DeepSpeed
    ZeRO-3 partitions (`ds_tensor`), or plain tensors; elements held locally against the full count."""
    from torch.distributed.tensor import DTensor

    layout = {"parameters": 0, "dtensors": 0, "zero3_partitioned": 0, "local_numel": 0, "full_numel": 0}
    placements = set()
    for param in module.parameters():
        layout["parameters"] += 1
        if isinstance(param, DTensor):
            layout["dtensors"] += 1
            placements.add(str(param.placements))
            local, full = param.to_local().numel(), param.numel()
        elif hasattr(param, "ds_tensor"):
            layout["zero3_partitioned"] += 1
            local, full = param.ds_tensor.numel(), param.ds_numel
        else:
            local = full = param.numel()
        layout["local_numel"] += local
        layout["full_numel"] += full
    layout["placements"] = sorted(placements)
    return layout


def report_backend(directory: str) -> None:
    """Not a shim: after `Trainer.train`, each process writes what it ran (read-only; the training is unchanged)."""
    from transformers import Trainer

    train = Trainer.train

    def recorded_train(self, *args, **kwargs):
        output = train(self, *args, **kwargs)
        import rpg_trl

        accelerator = self.accelerator
        report = {
            "rpg_trl": rpg_trl.__file__,
            "process_index": accelerator.process_index,
            "num_processes": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "wrapper": type(self.model_wrapped).__name__,
            "policy": parameter_layout(self.model_wrapped),
            "reference": None if getattr(self, "ref_model", None) is None else parameter_layout(self.ref_model),
        }
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"rank{accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)
        return output

    Trainer.train = recorded_train


def record_vllm_logps(directory: str) -> None:
    """Not a shim: each process appends, for every round of TRL's `_generate_and_score_completions` (every vLLM
    generation), how vLLM's log-probs of the sampled tokens compare with the trainer's (`old_per_token_logps`, TRL's
    forward pass of the weights just synced) to `DIR/rank{R}.jsonl`: the step, the number of completion tokens, how
    many of them have a finite log-prob on each side, and the largest gap over them (the training is unchanged)."""
    from trl import GRPOTrainer

    generate = GRPOTrainer._generate_and_score_completions

    def recorded(self, inputs):
        output = generate(self, inputs)
        mask = output["completion_mask"].bool()
        vllm, old = output.get("sampling_per_token_logps"), output.get("old_per_token_logps")
        row = {"step": self.state.global_step, "tokens": int(mask.sum()), "old_logps": old is not None}
        if vllm is not None and old is not None:
            vllm, old = vllm.detach().float()[mask], old.detach().float()[mask]
            row["finite_vllm"], row["finite_trainer"] = int(vllm.isfinite().sum()), int(old.isfinite().sum())
            row["max_gap"] = (vllm - old).abs().max().item() if vllm.numel() else None
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"rank{self.accelerator.process_index}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        return output

    GRPOTrainer._generate_and_score_completions = recorded


def kill_server_mid_request(spec: str) -> None:
    """The fault, from the main process: `PGID:N:STAMP` kills the vLLM server's process group (SIGKILL) right after
    the N-th generation request (`/v1/completions`) has been sent to it, before its answer (the request is in flight), and writes the
    time of the kill (`time.time()`) to the file STAMP. TRL's client then retries 5 times with an exponential back-off
    (about a minute); the retries are made back to back here, so that the test measures what follows them."""
    import signal
    import time

    from urllib3.connection import HTTPConnection
    from urllib3.util.retry import Retry

    pgid, nth, stamp = spec.split(":", 2)
    request, sent = HTTPConnection.request, []

    def request_then_kill(self, method, url, *args, **kwargs):
        result = request(self, method, url, *args, **kwargs)
        if url.rstrip("/").endswith("/v1/completions"):  # TRL's `VLLMClient.generate`
            sent.append(url)
            if len(sent) == int(nth):
                os.killpg(int(pgid), signal.SIGKILL)
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
        return result

    HTTPConnection.request = request_then_kill
    Retry.get_backoff_time = lambda self: 0.0
    # The cleanup of each process that runs it, for the test to see: registered before the script (and rpg_trl) are
    # imported, this handler runs after theirs.
    import atexit

    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: print(f"process {rank}: atexit ran", flush=True))


def main() -> None:
    skip_deepspeed_shm_build()
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        apply_fsdp_plugin_on_cpu()
    if os.environ.get("RPG_LAUNCH_REPORT"):
        report_backend(os.environ["RPG_LAUNCH_REPORT"])
    if os.environ.get("RPG_VLLM_RECORD"):
        record_vllm_logps(os.environ["RPG_VLLM_RECORD"])
    if os.environ.get("RPG_TEST_KILL_SERVER"):
        kill_server_mid_request(os.environ["RPG_TEST_KILL_SERVER"])
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as when the script is run directly (rpg_math imports its sibling)
    if not os.environ.get("RPG_TEST_KILL_SERVER"):
        runpy.run_path(script, run_name="__main__")
        return
    try:  # a user's `finally` around the training script
        runpy.run_path(script, run_name="__main__")
    finally:
        print(f"process {os.environ.get('RANK', '0')}: the script's finally ran", flush=True)


if __name__ == "__main__":
    main()
