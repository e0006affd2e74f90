"""The shipped launch configs for real, on CPU: `accelerate launch --config_file accelerate_configs/<x>.yaml
examples/rpg_math.py` with 2 processes over gloo, for multi_gpu.yaml (DDP), deepspeed_zero2.yaml, deepspeed_zero3.yaml,
fsdp2.yaml and multi_node.yaml (two machines of one process each on 127.0.0.1), each changed only by command-line
overrides for the CPU (`--num_processes 2 --mixed_precision no`, and the script's `--use_cpu true --bf16 false`).

Every run proves that its back-end ran (ZeRO partition files in its checkpoints, FSDP2's sharded parameters and
checkpoint files, two processes), so a silent fallback to DDP or to one process fails; then its losses, saved model and
synced reference equal 2-process DDP's at the same seed and data, and a resume from the step-2 checkpoint equals the
uninterrupted run. Runs: the sampling anchor under every config; a reference model with KL-triggered syncs under ZeRO-3
and FSDP2; LoRA (with its "ref" adapter synced) under ZeRO-2. Each run launches once (module-scoped fixtures) and
trains 4 steps. `tests/helpers/cpu_launch.py` applies the two CPU shims in the launched processes; docs/scaling.md,
"Launch configs on a CPU", has the commands.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rpg_trl.reliability.checkpoints import COMMIT_RECORD, is_complete
from rpg_trl.testing import no_activation_checkpointing, sessions

from helpers.ports import free_port
from helpers.tiny_runs import assert_close_in_norm, save_math_assets


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
SHIM = ROOT / "tests" / "helpers" / "cpu_launch.py"
SCRIPT = ROOT / "examples" / "rpg_math.py"
TIMEOUT = 300

pytestmark = pytest.mark.slow
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="needs deepspeed (in the test extra: pip install -e '.[test]')",
)

#: Tolerance of every comparison between two runs, norm-relative (`assert_close_in_norm`): ‖a − b‖ ≤ 64 ε·‖b‖, ε of
#: float32, for a tensor or for the series of a logged value over the 4 steps. Both runs compute in float32 with the
#: same kernels and data; they differ only in the order in which gradients are summed over the processes (DDP's
#: all-reduce buckets, ZeRO's and FSDP's reduce-scatter), a few float32 roundings per step, carried through 4 steps
#: (measured with ATEN_CPU_CAPABILITY=avx2 and =default: at most 2.3 ε on a logged series, 0.4 ε on a weight tensor;
#: resumes equal exactly). 64 ε (7.6e-6) leaves room for other CPU kernels and stays far below what a wrong sync,
#: restore or update changes (the reference moves by 5e5 ε between its syncs; the policy by more than 1e-2 relative in
#: 4 steps: `test_ddp_run_has_signal_to_compare`).
ULPS = 64

#: The run, shared by all configs: 4 optimizer steps, 2 per generation (generations at steps 1 and 3), a checkpoint at
#: steps 2 and 4, seed 0, 16 completions of 16 tokens per step (one group of 8 per process). RPG-UFKL's differentiable
#: estimator, whose loss value is non-zero on every step (the REINFORCE estimator's value is 0 on the first step of
#: each generation, which would compare nothing). AdamW with ε = 1 (update ≈ lr·m, smooth in the gradient): with the
#: default ε = 1e-8 the first update is lr·sign(g), so an entry of g near 0 whose rounding differs between the reduction
#: orders moves by 2·lr, and two correct back-ends end up to 3e-5 apart (measured). The tiny model rarely
#: answers; DAPO's overlong punishment (reward −len/16 beyond 0 tokens) gives rewards that differ within groups.
TRAIN = [
    "--max_steps", "4", "--steps_per_generation", "2", "--save_strategy", "steps", "--save_steps", "2",
    "--save_only_model", "false", "--seed", "0",
    "--per_device_train_batch_size", "8", "--num_generations", "8", "--max_completion_length", "16",
    "--overlong_buffer", "16", "--divergence", "ufkl", "--estimator", "differentiable", "--beta", "0.1",
    "--optim", "adamw_torch", "--adam_epsilon", "1.0", "--learning_rate", "2.0",
    "--logging_steps", "1", "--report_to", "none", "--eval_strategy", "no",
    f"--{next(iter(no_activation_checkpointing()))}", "false",  # activation_checkpointing where it exists
    "--disable_tqdm", "true",
    "--use_cpu", "true", "--bf16", "false",  # the CPU overrides of the script's arguments
]  # fmt: skip
#: A reference model moved to the policy whenever the token KL to it exceeds κ = 1e-4 at a generation boundary (no
#: averaging); the KL at steps 2 and 4 is above 5e-3, so it syncs at both.
KAPPA = 1e-4
REFERENCE = ["--kl_anchor", "reference", "--ref_model_sync_kl_threshold", str(KAPPA), "--ref_model_sync_kl_ema", "0"]
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear"]


# ------------------------------------------------------------------------------------------------------------ launching


class Run:
    """A finished launch: its output folder, the launchers' output, and what it wrote."""

    def __init__(self, output_dir: Path, output: str):
        self.output_dir, self.output = output_dir, output

    def history(self) -> list[dict]:
        """The logged training steps (full precision: the final checkpoint's trainer_state.json)."""
        state = json.loads((self.output_dir / "checkpoint-4" / "trainer_state.json").read_text())
        return [entry for entry in state["log_history"] if "loss" in entry]

    def series(self, key, after_step=0) -> list[float]:
        return [entry[key] for entry in self.history() if entry["step"] > after_step]

    def tensors(self, relative_path) -> dict[str, torch.Tensor]:
        return load_file(self.output_dir / relative_path)

    def reports(self) -> list[dict]:
        """What each process ran (`tests/helpers/cpu_launch.py`), by process index."""
        files = sorted((self.output_dir / "backend").glob("rank*.json"))
        return [json.loads(f.read_text()) for f in files]


def _launch(assets, name, config, script_args, machines=1) -> Run:
    """`accelerate launch --config_file accelerate_configs/<config> ... examples/rpg_math.py` with 2 CPU processes: one
    launcher for 1 machine, or one launcher per machine of 1 process each (`--machine_rank`) on 127.0.0.1."""
    output_dir = assets["root"] / name
    port = str(free_port())
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(assets["root"] / "torch_extensions"),  # empty: a JIT build would show
        "RPG_LAUNCH_REPORT": str(output_dir / "backend"),
    }
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
    launcher += ["--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no"]
    script = [str(SHIM), str(SCRIPT), "--model_name_or_path", assets["model"], "--train_dataset", assets["train"]]
    script += ["--output_dir", str(output_dir), *TRAIN, *script_args]
    if machines == 1:
        commands = [[*launcher, "--num_machines", "1", "--main_process_port", port, *script]]
    else:
        commands = [
            [*launcher, "--num_machines", str(machines), "--machine_rank", str(rank)]
            + ["--main_process_ip", "127.0.0.1", "--main_process_port", port, *script]
            for rank in range(machines)
        ]
    output_dir.mkdir(parents=True)
    logs = [output_dir / f"launcher{rank}.log" for rank in range(machines)]
    processes = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as f:  # each launcher leads its own process group, killed with it if it hangs
                process = sessions.popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=assets["root"])
                processes.append(process)
        for process in processes:
            process.wait(timeout=TIMEOUT)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    outputs = [log.read_text() for log in logs]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-6000:]
    for output in outputs:
        assert "with 2 process(es)" in output, output[-3000:]  # the script's own count, on each machine
        # No op was compiled: DeepSpeed's g++ build of its shared-memory all-reduce stayed skipped
        # (tests/helpers/cpu_launch.py)
        assert "shm_comm_op" not in output and "extensions root" not in output
    return Run(output_dir, "\n".join(outputs))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return save_math_assets(tmp_path_factory.mktemp("launch"))


def _resumed(assets, run, config, script_args):
    checkpoint = str(run.output_dir / "checkpoint-2")
    return _launch(
        assets, f"{run.output_dir.name}-resumed", config, [*script_args, "--resume_from_checkpoint", checkpoint]
    )


@pytest.fixture(scope="module")
def ddp(assets):
    return _launch(assets, "ddp", "multi_gpu.yaml", [])


@pytest.fixture(scope="module")
def ddp_lora(assets):
    return _launch(assets, "ddp-lora", "multi_gpu.yaml", [*LORA, *REFERENCE])


@pytest.fixture(scope="module")
def ddp_lora_resumed(assets, ddp_lora):
    return _resumed(assets, ddp_lora, "multi_gpu.yaml", [*LORA, *REFERENCE])


@pytest.fixture(scope="module")
def zero2(assets):
    return _launch(assets, "zero2", "deepspeed_zero2.yaml", [])


@pytest.fixture(scope="module")
def zero2_lora(assets):
    return _launch(assets, "zero2-lora", "deepspeed_zero2.yaml", [*LORA, *REFERENCE])


@pytest.fixture(scope="module")
def zero2_lora_resumed(assets, zero2_lora):
    return _resumed(assets, zero2_lora, "deepspeed_zero2.yaml", [*LORA, *REFERENCE])


#: Each position's KL exactly over the vocabulary (the sampling anchor, π_old's head copied at each generation).
VOCABULARY = ["--kl_estimate", "vocabulary"]


@pytest.fixture(scope="module")
def ddp_vocabulary(assets):
    return _launch(assets, "ddp-vocabulary", "multi_gpu.yaml", VOCABULARY)


@pytest.fixture(scope="module")
def zero2_vocabulary(assets):
    return _launch(assets, "zero2-vocabulary", "deepspeed_zero2.yaml", VOCABULARY)


@pytest.fixture(scope="module")
def zero3(assets):
    return _launch(assets, "zero3", "deepspeed_zero3.yaml", [])


@pytest.fixture(scope="module")
def zero3_ref(assets):
    return _launch(assets, "zero3-ref", "deepspeed_zero3.yaml", REFERENCE)


@pytest.fixture(scope="module")
def zero3_ref_resumed(assets, zero3_ref):
    return _resumed(assets, zero3_ref, "deepspeed_zero3.yaml", REFERENCE)


@pytest.fixture(scope="module")
def fsdp2(assets):
    return _launch(assets, "fsdp2", "fsdp2.yaml", [])


@pytest.fixture(scope="module")
def fsdp2_ref(assets):
    return _launch(assets, "fsdp2-ref", "fsdp2.yaml", REFERENCE)


@pytest.fixture(scope="module")
def fsdp2_ref_resumed(assets, fsdp2_ref):
    return _resumed(assets, fsdp2_ref, "fsdp2.yaml", REFERENCE)


@pytest.fixture(scope="module")
def multi_node(assets):
    return _launch(assets, "multi-node", "multi_node.yaml", [], machines=2)


# ---------------------------------------------------------------------------------------------------------- comparing
def assert_close(actual, expected, what):
    """‖actual − expected‖ ≤ 64 float32 ε · ‖expected‖ (see ULPS)."""
    assert_close_in_norm(actual, expected, ulps=ULPS, dtype=torch.float32, what=what)


def _untied(tensors):
    """The tiny model ties its output layer to the embeddings: DeepSpeed and FSDP state dicts list the tied tensor under
    both names, DDP's save once; keep one name (after checking that the two are the same tensor)."""
    tensors = dict(tensors)
    if "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        assert torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"])
    return tensors


def assert_same_weights(actual, expected, what):
    actual, expected = _untied(actual), _untied(expected)
    assert sorted(actual) == sorted(expected), what
    for name in expected:
        assert_close(actual[name], expected[name], f"{what}: {name}")


def assert_same_history(actual: Run, expected: Run, after_step=0):
    """The same steps, losses, KL, gradient norms and reference syncs."""
    assert [e["step"] for e in actual.history() if e["step"] > after_step] == [
        e["step"] for e in expected.history() if e["step"] > after_step
    ]
    for key in ("loss", "kl", "grad_norm"):
        assert_close(actual.series(key, after_step), expected.series(key, after_step), key)
    syncs = [e.get("ref/syncs") for e in actual.history() if e["step"] > after_step]
    assert syncs == [e.get("ref/syncs") for e in expected.history() if e["step"] > after_step]


def expected_syncs(kl: list[float]) -> list[float]:
    """The reference syncs after each step, from the KL of a run that syncs alike: with ref_model_sync_kl_ema 0 the
    trigger compares each step's KL to κ, and syncs only where the next step generates (even steps here)."""
    count, syncs = 0, []
    for step, value in enumerate(kl, start=1):
        count += step % 2 == 0 and value > KAPPA
        syncs.append(float(count))
    return syncs


def _numel(tensors) -> int:
    return sum(t.numel() for t in _untied(tensors).values())


# ------------------------------------------------------------------------------------------- each back-end really ran
def _zero_checkpoint(run, stage, trainable_numel):
    """DeepSpeed's own checkpoint layout in both checkpoints: per-rank optimizer partitions (ZeRO-1/2/3) of the
    stage asked for, together holding the trainable parameters once, half on each rank; per-rank model states
    without weights under ZeRO-3 (partitioned), one full model-states file under ZeRO-2."""
    for step in (2, 4):
        folder = run.output_dir / f"checkpoint-{step}" / f"global_step{step}"
        names = sorted(p.name for p in folder.iterdir())
        ranks = [f"zero_pp_rank_{r}_mp_rank_00_" for r in range(2)]
        assert [f"{r}optim_states.pt" for r in ranks] == [n for n in names if n.endswith("optim_states.pt")], names
        partition_sizes = []
        for r in ranks:
            state = torch.load(folder / f"{r}optim_states.pt", map_location="cpu", weights_only=False)
            optimizer = state["optimizer_state_dict"]
            assert int(optimizer["zero_stage"]) == stage and state["ds_config"]["zero_optimization"]["stage"] == stage
            groups = optimizer["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
            partition_sizes.append(sum(t.numel() for t in groups))
        assert partition_sizes[0] == partition_sizes[1], partition_sizes
        # Each rank holds half of the fp32 parameters (DeepSpeed pads to an even split: a few elements at most).
        padding = sum(partition_sizes) - trainable_numel
        assert 0 <= padding <= 256, (partition_sizes, trainable_numel)
        if stage == 3:
            for r in ranks:
                states = torch.load(folder / f"{r}model_states.pt", map_location="cpu", weights_only=False)
                assert sum(t.numel() for t in states["module"].values()) == 0  # no rank holds full weights
        else:  # one model-states file for both ranks (the weights are not partitioned)
            assert [n for n in names if n.endswith("model_states.pt")] == ["mp_rank_00_model_states.pt"], names


def _processes(run, distributed_type):
    reports = run.reports()
    assert [r["process_index"] for r in reports] == [0, 1]
    for report in reports:
        assert report["num_processes"] == 2 and report["distributed_type"] == distributed_type, report
        assert Path(report["rpg_trl"]).resolve().is_relative_to(ROOT), report["rpg_trl"]  # the code under test
    return reports


def _sharded(reports, model, full_numel):
    """Every process holds part of `model` ("policy" or "reference"), together all of it."""
    local = [r[model]["local_numel"] for r in reports]
    assert all(r[model]["full_numel"] == full_numel for r in reports), (model, reports)
    # (ZeRO-3 pads each parameter's partition to an even split: at most one element per parameter)
    padding = reports[0][model]["parameters"]
    assert all(0 < n < full_numel for n in local) and full_numel <= sum(local) <= full_numel + padding, local


def test_ddp_run_has_signal_to_compare(ddp, assets):
    """multi_gpu.yaml: 2 DDP processes; and what the other runs are compared with is not vacuous: non-zero losses, a
    KL at every second step of a generation, different rewards within groups, and a policy that moved."""
    for report in _processes(ddp, "MULTI_CPU"):
        assert report["wrapper"] == "DistributedDataParallel" and report["policy"]["dtensors"] == 0
    assert (ddp.output_dir / "checkpoint-2" / "optimizer.pt").is_file()
    assert not (ddp.output_dir / "checkpoint-2" / "global_step2").exists()
    losses, kl = ddp.series("loss"), ddp.series("kl")
    assert all(abs(x) > 1e-3 for x in losses), losses
    assert kl[0] == kl[2] == 0.0 and min(kl[1], kl[3]) > 10 * KAPPA, kl  # π_θ = π_old on a generation's first step
    assert all(entry["reward_std"] > 0 for entry in ddp.history() if "reward_std" in entry)
    initial, final = load_file(Path(assets["model"]) / "model.safetensors"), ddp.tensors("model.safetensors")
    moved = {n: float((final[n] - initial[n]).norm() / initial[n].norm()) for n in initial if "norm" not in n}
    assert min(moved.values()) > 1e-3 and sum(moved.values()) / len(moved) > 1e-2, moved


@needs_deepspeed
@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_ref", "multi_node"])
def test_deepspeed_runs_partition_their_checkpoints(request, ddp, name):
    run = request.getfixturevalue(name)
    stage = 3 if name.startswith("zero3") else 2
    reports = _processes(run, "DEEPSPEED")
    full_numel = _numel(ddp.tensors("model.safetensors"))
    _zero_checkpoint(run, stage, trainable_numel=full_numel)
    for report in reports:
        assert report["wrapper"] == "DeepSpeedEngine"
    if stage == 3:
        _sharded(reports, "policy", full_numel)
        if name == "zero3_ref":
            _sharded(reports, "reference", full_numel)
    else:
        assert all(r["policy"]["zero3_partitioned"] == 0 for r in reports)


@needs_deepspeed
def test_zero2_lora_partitions_the_adapter(zero2_lora, ddp_lora):
    _processes(zero2_lora, "DEEPSPEED")
    _zero_checkpoint(zero2_lora, 2, trainable_numel=_numel(ddp_lora.tensors("adapter_model.safetensors")))


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_ref"])
def test_fsdp2_runs_shard_their_parameters(request, ddp, name):
    """FSDP2 (with the test-side shim that applies accelerate's FSDP plugin on CPU): every parameter of the policy, and
    of the reference, is a DTensor sharded on dim 0 (`Shard(dim=0)`); checkpoints in accelerate's FSDP layout."""
    run = request.getfixturevalue(name)
    reports = _processes(run, "FSDP")
    full_numel = _numel(ddp.tensors("model.safetensors"))
    for model in ("policy", "reference") if name == "fsdp2_ref" else ("policy",):
        for report in reports:
            layout = report[model]
            assert layout["dtensors"] == layout["parameters"] > 0 and layout["placements"] == ["(Shard(dim=0),)"]
        _sharded(reports, model, full_numel)
    for step in (2, 4):
        names = {p.name for p in (run.output_dir / f"checkpoint-{step}").iterdir()}
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= names and "optimizer.pt" not in names, names


# ------------------------------------------------------------------------------------------------- the same as DDP
@pytest.mark.parametrize(
    "name", [pytest.param("zero2", marks=needs_deepspeed), pytest.param("zero3", marks=needs_deepspeed), "fsdp2"]
)
def test_sampling_anchor_equals_ddp(request, ddp, name):
    run = request.getfixturevalue(name)
    assert_same_history(run, ddp)
    for path in ("checkpoint-2/model.safetensors", "model.safetensors"):
        assert_same_weights(run.tensors(path), ddp.tensors(path), f"{name} {path}")


@pytest.mark.parametrize("name", [pytest.param("zero3_ref", marks=needs_deepspeed), "fsdp2_ref"])
def test_synced_reference_equals_ddp(request, ddp, name):
    """A reference synced at both generation boundaries (steps 2 and 4) is, whenever it scores a batch, the policy that
    sampled it: the run equals DDP's sampling-anchor run, and each checkpoint's reference is DDP's policy at that step."""
    run = request.getfixturevalue(name)
    assert run.series("ref/syncs") == expected_syncs(ddp.series("kl")) == [0.0, 1.0, 1.0, 2.0]
    for key in ("loss", "kl", "grad_norm"):
        assert_close(run.series(key), ddp.series(key), key)
    assert_same_weights(run.tensors("model.safetensors"), ddp.tensors("model.safetensors"), name)
    for step, policy in ((2, "checkpoint-2/model.safetensors"), (4, "model.safetensors")):
        reference = run.tensors(f"checkpoint-{step}/rpg_reference.safetensors")
        assert_same_weights(reference, ddp.tensors(policy), f"{name}: reference at step {step}")


@needs_deepspeed
def test_the_vocabulary_kl_under_zero2_equals_ddp(zero2_vocabulary, ddp_vocabulary, ddp):
    """kl_estimate="vocabulary" with 2 processes: ZeRO-2 equals DDP (the KL runs inside the fused head of the wrapped
    forward, so its head gradient is reduced with the others). Its KL is 0 on the first step of each generation (no
    optimizer step since π_old's pass) and not the sampled run's on the second."""
    assert_same_history(zero2_vocabulary, ddp_vocabulary)
    for path in ("checkpoint-2/model.safetensors", "model.safetensors"):
        assert_same_weights(zero2_vocabulary.tensors(path), ddp_vocabulary.tensors(path), f"zero2 vocabulary {path}")
    kl, sampled = ddp_vocabulary.series("kl"), ddp.series("kl")
    assert kl[0] == kl[2] == 0.0 and kl[1] > 0 and kl[3] > 0
    assert kl[1] != pytest.approx(sampled[1], rel=1e-3)


@needs_deepspeed
def test_lora_under_zero2_equals_ddp(zero2_lora, ddp_lora):
    """LoRA with its "ref" adapter synced by the KL trigger: ZeRO-2 equals DDP, and the ref adapter in the step-2
    checkpoint is the trained adapter of that step."""
    assert_same_history(zero2_lora, ddp_lora)
    assert zero2_lora.series("ref/syncs") == expected_syncs(ddp_lora.series("kl"))
    assert zero2_lora.series("ref/syncs")[1] == 1.0  # a sync at step 2, before the checkpoint a resume starts from
    for path in ("checkpoint-2/adapter_model.safetensors", "adapter_model.safetensors"):
        assert_same_weights(zero2_lora.tensors(path), ddp_lora.tensors(path), path)
    reference = zero2_lora.tensors("checkpoint-2/rpg_reference.safetensors")
    assert_same_weights(reference, ddp_lora.tensors("checkpoint-2/rpg_reference.safetensors"), "reference")
    adapter = zero2_lora.tensors("checkpoint-2/adapter_model.safetensors")
    assert_same_weights({n.replace(".ref.", "."): t for n, t in reference.items()}, adapter, "ref adapter = adapter")


@needs_deepspeed
def test_multi_node_equals_single_node(multi_node, zero2, ddp):
    """multi_node.yaml as two machines of one process each (`--machine_rank 0/1`, 127.0.0.1): each launcher reports 2
    processes, and the run equals the 2-process single-node ZeRO-2 run of the same settings, and DDP."""
    assert multi_node.output.count("with 2 process(es)") == 2
    for reference in (zero2, ddp):
        assert_same_history(multi_node, reference)
        assert_same_weights(multi_node.tensors("model.safetensors"), reference.tensors("model.safetensors"), "model")


# ------------------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize(
    "name, config, model_file",
    [
        # DDP on 2 CPU processes: each has the device `cpu:0`, which transformers 5.17 passes to torch.load as the
        # optimizer's map_location (refused by torch); newer transformers load it on plain "cpu" (docs/scaling.md).
        ("ddp_lora", "multi_gpu.yaml", "adapter_model.safetensors"),
        pytest.param("zero2_lora", "deepspeed_zero2.yaml", "adapter_model.safetensors", marks=needs_deepspeed),
        pytest.param("zero3_ref", "deepspeed_zero3.yaml", "model.safetensors", marks=needs_deepspeed),
        ("fsdp2_ref", "fsdp2.yaml", "model.safetensors"),
    ],
)
def test_resume_from_mid_checkpoint_equals_uninterrupted_run(request, name, config, model_file):
    """Resumed from checkpoint-2 (after the sync at step 2): steps 3-4, the saved model and the synced reference of the
    final checkpoint equal the run that was not interrupted."""
    run, resumed = request.getfixturevalue(name), request.getfixturevalue(f"{name}_resumed")
    assert resumed.output.count("{'loss'") == 2  # trained steps 3 and 4 only
    assert [e["step"] for e in resumed.history()] == [1, 2, 3, 4]
    assert_same_history(resumed, run, after_step=2)
    assert_same_weights(resumed.tensors(model_file), run.tensors(model_file), model_file)
    path = "checkpoint-4/rpg_reference.safetensors"
    assert_same_weights(resumed.tensors(path), run.tensors(path), "reference")
    # Every checkpoint was committed once both processes had written their files (their shards included).
    for folder in (run.output_dir / "checkpoint-2", resumed.output_dir / "checkpoint-4"):
        record = json.loads((folder / COMMIT_RECORD).read_text())
        assert record["complete"] and record["world_size"] == 2 and is_complete(str(folder)), folder
        assert {"rng_state_0.pth", "rng_state_1.pth", "rpg_generation_state_1.pt"} <= set(record["files"])
        # ZeRO: one optimizer partition per process; FSDP2 (FULL_STATE_DICT) and DDP: one optimizer, from process 0
        suffix, count = {"fsdp2_ref": ("optimizer.bin", 1), "ddp_lora": ("optimizer.pt", 1)}.get(
            name, ("optim_states.pt", 2)
        )
        assert len([f for f in record["files"] if f.endswith(suffix)]) == count, sorted(record["files"])


# ------------------------------------------------------------------------------------------------ the silent fallbacks
FALLBACK_PROBE = textwrap.dedent("""
    import json, sys
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    sys.path.insert(0, sys.argv[1])
    from helpers.cpu_launch import apply_fsdp_plugin_on_cpu

    def state(label, cpu):
        accelerator = Accelerator(cpu=cpu)
        entry = {"label": label, "rank": accelerator.process_index, "processes": accelerator.num_processes,
                 "type": accelerator.distributed_type.value}
        # One write per line (print may write the text and its newline apart): the two processes share the pipe.
        sys.stdout.write(json.dumps(entry) + "\\n")
        sys.stdout.flush()
        AcceleratorState._reset_state(reset_partial_state=True)

    state("no --use_cpu", cpu=False)
    state("--use_cpu", cpu=True)
    apply_fsdp_plugin_on_cpu()
    state("--use_cpu + shim", cpu=True)
""")


def test_the_two_silent_fallbacks_and_the_fsdp_shim(tmp_path):
    """What docs/scaling.md warns of, under fsdp2.yaml with 2 processes on a machine without GPU: without the CPU flag
    each process is alone (1 process, no distribution); with it, accelerate drops the FSDP plugin and runs DDP
    (MULTI_CPU); the test-side shim makes it FSDP. If accelerate changes either, this test says so."""
    script = tmp_path / "probe.py"
    script.write_text(FALLBACK_PROBE)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "fsdp2.yaml")]
    command += ["--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port())]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(ROOT / "tests")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            seen.setdefault(entry["label"], []).append((entry["rank"], entry["processes"], entry["type"]))
    assert sorted(seen["no --use_cpu"]) == [(0, 1, "NO"), (0, 1, "NO")]  # two trainings of one process each
    assert sorted(seen["--use_cpu"]) == [(0, 2, "MULTI_CPU"), (1, 2, "MULTI_CPU")]  # DDP, not FSDP
    assert sorted(seen["--use_cpu + shim"]) == [(0, 2, "FSDP"), (1, 2, "FSDP")]


# -------------------------------------------------------------------------------------------------- the SLURM script
def test_slurm_script_hands_accelerate_the_cluster_layout(tmp_path):
    """accelerate_configs/slurm_multinode.sbatch run with stand-ins for `scontrol`, `srun` (runs its command once per
    node with SLURM_PROCID set), `curl`, `trl` and `accelerate` (records its arguments): for 3 and 5 nodes, node 0
    serves vLLM and every other node launches one `accelerate launch` of multi_node.yaml with the cluster's machine
    count, process count (8 GPUs per node), its own machine rank, the first training node as main process and the
    batch kept at 512 completions per step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": 'printf "%s\\n" $FAKE_NODES',
        "srun": textwrap.dedent("""\
            nodes=1
            while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
            for ((i = 0; i < nodes; i++)); do SLURM_PROCID=$i "$@" || exit $?; done"""),
        "curl": "exit 0",
        "trl": 'echo "$@" > "$RECORD/trl.args"',
        "accelerate": 'printf "%s\\n" "$@" > "$RECORD/accelerate.$SLURM_PROCID.args"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    config = {}
    for line in (CONFIGS / "multi_node.yaml").read_text().splitlines():
        if re.match(r"\w+: \S", line):
            key, value = line.split(": ", 1)
            config[key] = value
    for num_nodes in (3, 5):
        record = tmp_path / f"nodes{num_nodes}"
        record.mkdir()
        nodes = [f"node{i}" for i in range(num_nodes)]
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_NODES": " ".join(nodes)}
        env.update(SLURM_JOB_NODELIST=f"node[0-{num_nodes - 1}]", RECORD=str(record))
        result = subprocess.run(
            ["bash", str(CONFIGS / "slurm_multinode.sbatch")], capture_output=True, text=True, timeout=60, env=env,
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "--host 0.0.0.0" in (record / "trl.args").read_text()
        train_nodes = num_nodes - 1
        for rank in range(train_nodes):
            args = (record / f"accelerate.{rank}.args").read_text().splitlines()
            assert args[0] == "launch"
            options = {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}
            assert options["--config_file"] == "accelerate_configs/multi_node.yaml"
            assert options["--num_machines"] == str(train_nodes)
            assert options["--num_processes"] == str(8 * train_nodes)
            assert options["--machine_rank"] == str(rank)  # each node its own rank (escaped for the node's shell)
            assert options["--main_process_ip"] == "node1"  # the first training node, not the vLLM server's
            assert options["--main_process_port"] == config["main_process_port"]
            assert options["--vllm_server_host"] == "node0"
            # 4 completions per GPU x 8 GPUs x nodes x accumulation = 512 completions per optimizer step
            assert 4 * 8 * train_nodes * int(options["--gradient_accumulation_steps"]) == 512
        assert not (record / f"accelerate.{train_nodes}.args").exists()
    # multi_node.yaml's own values are those of 2 training nodes (the script overrides them on the command line).
    assert (config["num_machines"], config["num_processes"], config["distributed_type"]) == ("2", "16", "DEEPSPEED")
