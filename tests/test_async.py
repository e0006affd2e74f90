"""AsyncRPGTrainer (rpg_trl.async_rpg): configuration, the loss on TRL's packed stream against independent references
(TRL's AsyncGRPOTrainer, and `rpg_loss` on a plain padded forward), staleness, and end-to-end CPU training under a
policy lag of two versions with a resume from a checkpoint (local rollout worker of rpg_trl.testing.cpu_rollouts). On a
TRL older than 1.16 (the oldest releases of the library's window) the module skips, with the library's refusal as
reason. The `rpg-trl bench-async` command that runs on the same worker is tested with the research package
(research/tests/test_bench_async.py)."""

# ruff: noqa: E402 - the skip below comes before the imports of TRL's asynchronous trainer, which TRL 1.14 lacks

import json
import math
import re
import subprocess
import sys

import pytest

from helpers.trl_release import skip_module_without_async_trl


skip_module_without_async_trl()

import torch
from safetensors.torch import load_file
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

import rpg_trl
from rpg_trl.async_rpg import AsyncRPGConfig, AsyncRPGTrainer
from rpg_trl.losses import DIVERGENCES, ESTIMATORS, rpg_loss
from rpg_trl.reliability.checkpoints import COMMIT_RECORD, is_complete
from rpg_trl.testing.cpu_rollouts import cpu_backend

from helpers.async_harness import (
    RecordingWeightTransfer,
    async_args,
    completion_log_probs,
    make_worker,
    pack,
    plain_model,
    random_rollouts,
    trainer_kwargs,
)


torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cpu_backend():
    with cpu_backend():
        yield


# ----------------------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------------------


def test_trainer_refuses_a_grpo_config(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="AsyncRPGConfig"):
        AsyncRPGTrainer(tiny_model_dir, args=AsyncGRPOConfig(**async_args(tmp_path)))


def test_local_worker_refuses_bad_values(tiny_model_dir):
    with pytest.raises(ValueError, match="lag"):
        make_worker(tiny_model_dir, lag=0)
    with pytest.raises(ValueError, match="multiple of `num_generations`"):
        make_worker(tiny_model_dir, samples_per_step=6)


@pytest.mark.slow
def test_import_rpg_trl_does_not_import_trl_experimental():
    """`trl.experimental` warns when imported: `import rpg_trl` leaves it alone, the attribute loads it on use."""
    code = "import sys, rpg_trl; assert 'trl.experimental' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert rpg_trl.AsyncRPGTrainer is AsyncRPGTrainer and rpg_trl.AsyncRPGConfig is AsyncRPGConfig


# ----------------------------------------------------------------------------------------------------------------------
# The loss on the packed stream
# ----------------------------------------------------------------------------------------------------------------------


def _build(trainer_class, config_class, model_dir, output_dir, **overrides):
    worker = make_worker(model_dir)
    trainer = trainer_class(
        model_dir, args=config_class(**async_args(output_dir, **overrides)), **trainer_kwargs(model_dir, worker)
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _off_policy_batch(model_dir, tokenizer, seed=0, noise=0.5):
    """Random rollouts whose sampler log-probabilities are the model's own plus noise (so that importance weights
    range over every clip region), packed by TRL; also returns them unpacked."""
    samples = random_rollouts(tokenizer, seed=seed)
    with torch.no_grad():
        logps, mask = completion_log_probs(plain_model(model_dir), samples)
    generator = torch.Generator().manual_seed(seed + 1)
    old = logps + noise * torch.randn(logps.shape, generator=generator)
    for i, sample in enumerate(samples):
        length = int(mask[i].sum())
        sample["old_log_probs"][-length:] = old[i, :length]
    return samples, old, mask, pack(samples, tokenizer.pad_token_id)


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def test_loss_and_gradient_equal_async_grpo_where_the_math_coincides(tiny_model_dir, tmp_path):
    """β = 0, the differentiable estimator and a dual-clip bound that never acts: RPG-Style Clip is PPO's clip, so the
    loss and every gradient equal TRL's AsyncGRPOTrainer on the same packed batch (with clipping in both regions)."""
    common = {"epsilon": 0.2, "epsilon_high": 0.28}
    grpo = _build(AsyncGRPOTrainer, AsyncGRPOConfig, tiny_model_dir, tmp_path / "grpo", **common)
    rpg = _build(
        AsyncRPGTrainer, AsyncRPGConfig, tiny_model_dir, tmp_path / "rpg",
        beta=0.0, estimator="differentiable", clip_c=1e6, **common,
    )  # fmt: skip
    _, _, _, batch = _off_policy_batch(tiny_model_dir, grpo.processing_class)
    losses, grads = [], []
    for trainer in (grpo, rpg):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        losses.append(loss.detach())
        grads.append(_grads(trainer.model))
    assert (
        grpo._metrics["train"]["clip_ratio/low_mean"][-1] > 0
        and grpo._metrics["train"]["clip_ratio/high_mean"][-1] > 0
    )
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def rpg_and_batch(tiny_model_dir, tmp_path_factory):
    with cpu_backend():
        trainer = _build(AsyncRPGTrainer, AsyncRPGConfig, tiny_model_dir, tmp_path_factory.mktemp("rpg"), beta=0.3)
    return trainer, _off_policy_batch(tiny_model_dir, trainer.processing_class, seed=3)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_packed_loss_equals_rpg_loss_of_a_plain_forward(rpg_and_batch, tiny_model_dir, divergence, estimator):
    """The packed, tree-attention loss (β = 0.3, clip on) equals `rpg_loss` on the padded batch of a plain SDPA
    forward of the same model, in value and gradient, for every divergence × estimator."""
    trainer, (samples, old, mask, batch) = rpg_and_batch
    trainer.loss_spec = trainer.loss_spec.replace(divergence=divergence, estimator=estimator)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()

    reference = plain_model(tiny_model_dir)
    logps, _ = completion_log_probs(reference, samples)
    advantages = torch.tensor([s["advantage"] for s in samples])
    expected, stats = rpg_loss(
        logps, old, advantages, mask, divergence=divergence, estimator=estimator, beta=0.3, clip_c=10.0
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    expected_grads = _grads(reference)
    for name, grad in _grads(trainer.model).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    logged = trainer._metrics["train"]
    assert logged["kl"][-1] == pytest.approx(stats["kl"].item(), rel=1e-5, abs=1e-7)
    assert logged["clip_ratio/region_mean"][-1] == pytest.approx(stats["clip_ratio/region_mean"].item())
    assert logged["importance_weight/max"][-1] == pytest.approx(stats["importance_weight/max"].item(), rel=1e-5)


def test_reference_anchor_uses_the_initial_model(tiny_model_dir, tmp_path):
    """kl_anchor="reference": the KL is to a frozen copy of the initial model; after the policy moves, the loss is
    `rpg_loss` with the reference log-probabilities of the initial model."""
    trainer = _build(AsyncRPGTrainer, AsyncRPGConfig, tiny_model_dir, tmp_path, kl_anchor="reference", beta=0.5)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    samples, old, mask, batch = _off_policy_batch(tiny_model_dir, trainer.processing_class, seed=5)
    loss = trainer.compute_loss(trainer.model, dict(batch))

    policy = plain_model(tiny_model_dir)
    policy.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        logps, _ = completion_log_probs(policy, samples)
        ref_logps, _ = completion_log_probs(plain_model(tiny_model_dir), samples)
    advantages = torch.tensor([s["advantage"] for s in samples])
    expected, stats = rpg_loss(logps, old, advantages, mask, ref_logps=ref_logps, beta=0.5)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(stats["kl"].item(), rel=1e-4)


def test_reference_anchor_watches_the_kl_drift(tiny_model_dir, tmp_path):
    """With a reference model the asynchronous trainer watches the KL to it as RPGTrainer does (periods of 8 optimizer
    steps: it has no generation batches), from the metrics its log hands on; `kl_drift_warning=False` turns it off."""
    from rpg_trl.reliability.kl_drift import KLDriftWarning

    trainer = _build(AsyncRPGTrainer, AsyncRPGConfig, tiny_model_dir, tmp_path / "on", kl_anchor="reference", beta=0.5)
    monitor = trainer.kl_drift_monitor
    assert monitor is not None and monitor.steps_per_generation == 8 and monitor.min_kl == 0.01
    trainer.model.train()
    with pytest.warns(KLDriftWarning, match="went 0.1, 0.3, 0.9"):
        for period, kl in enumerate([0.05, 0.1, 0.3, 0.9, 2.0]):
            trainer._metrics["train"].update({"kl": [kl], "entropy": [0.5], "importance_weight/max": [3.0]})
            trainer.state.global_step = 1 + 8 * period
            trainer.log({})
    assert monitor.warned
    off = _build(
        AsyncRPGTrainer,
        AsyncRPGConfig,
        tiny_model_dir,
        tmp_path / "off",
        kl_anchor="reference",
        beta=0.5,
        kl_drift_warning=False,
    )
    assert off.kl_drift_monitor is None


def test_reference_anchor_with_peft_is_the_base_model(tiny_model_dir, tmp_path):
    """With PEFT the reference is the policy with its adapter disabled: no copy is loaded, and the reference
    log-probabilities of the packed row are the base model's (a plain forward), while the policy's differ."""
    from peft import LoraConfig

    worker = make_worker(tiny_model_dir)
    trainer = AsyncRPGTrainer(
        tiny_model_dir,
        args=AsyncRPGConfig(**async_args(tmp_path, kl_anchor="reference", beta=0.5)),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        **trainer_kwargs(tiny_model_dir, worker),
    )
    assert trainer.ref_model is None
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    samples = random_rollouts(trainer.processing_class, seed=7)
    forward_inputs, terms = trainer._packed_row(pack(samples, trainer.processing_class.pad_token_id))
    ref = trainer._reference_log_probs(trainer.model, forward_inputs)[terms["token_index"]]
    with torch.no_grad():
        policy = trainer.model(**forward_inputs, fused_lm_head=True).log_probs.flatten()[terms["token_index"]]
        base, mask = completion_log_probs(plain_model(tiny_model_dir), samples)
    torch.testing.assert_close(ref, base[mask.bool()], rtol=1e-5, atol=1e-5)
    assert (policy - ref).abs().max() > 1e-2


def test_staleness_is_the_trainer_version_minus_each_sample_version(rpg_and_batch):
    trainer, (samples, _, _, batch) = rpg_and_batch
    versions = [7, 7, 7, 7, 4, 4, 5, 5]
    batch = {**batch, "sample_model_version": torch.tensor([versions])}
    trainer.model_version = 9
    trainer.compute_loss(trainer.model, batch)
    logged = trainer._metrics["train"]
    assert logged["staleness/mean"][-1] == pytest.approx(9 - sum(versions) / len(versions))
    assert logged["staleness/max"][-1] == 9 - 4


# ----------------------------------------------------------------------------------------------------------------------
# End to end: a local rollout worker two policy versions behind the trainer
# ----------------------------------------------------------------------------------------------------------------------


def _history(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_trains_end_to_end_two_versions_stale(tiny_model_dir, tmp_path):
    steps, lag = 6, 2
    worker = make_worker(tiny_model_dir, lag=lag)
    trainer = AsyncRPGTrainer(
        tiny_model_dir,
        args=AsyncRPGConfig(**async_args(tmp_path, max_steps=steps, max_staleness=lag)),
        **trainer_kwargs(tiny_model_dir, worker),
    )
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    # Step s trained on samples of version max(1, s - lag): lag 0, 1, then 2 for the rest of the run.
    assert worker.sampled_versions[:steps] == [(s, max(1, s - lag)) for s in range(1, steps + 1)]
    assert _history(trainer, "staleness/max") == [0, 1, 2, 2, 2, 2]
    assert _history(trainer, "staleness/mean") == [0, 1, 2, 2, 2, 2]
    # TRL's own measure is taken when a sample leaves the queue, one micro-batch ahead of its gradient step.
    assert _history(trainer, "sample/staleness_max")[2:] == [1, 1, 1, 1]
    # Step 1 is on-policy: the packed tree-attention forward reproduces the sampler's log-probabilities.
    assert _history(trainer, "importance_weight/max")[0] == pytest.approx(1.0, abs=1e-4)
    assert _history(trainer, "importance_weight/min")[0] == pytest.approx(1.0, abs=1e-4)
    assert abs(_history(trainer, "kl")[0]) < 1e-6
    # Later batches are off-policy: the policy moved away from the sampler.
    assert max(_history(trainer, "importance_weight/max")[2:]) > 1.05
    assert all(math.isfinite(loss) for loss in _history(trainer, "loss"))
    assert len(_history(trainer, "loss")) == steps
    moved = [name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), initial[name])]
    assert moved


def test_resumes_from_a_checkpoint(tiny_model_dir, tmp_path):
    """A run saved at step 2 resumes with the checkpoint's weights (sent to the worker as version 1), its optimizer
    state (AdamW's step counter continues) and its step counter."""
    args = async_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, max_staleness=2)
    first = AsyncRPGTrainer(
        tiny_model_dir,
        args=AsyncRPGConfig(**args),
        **trainer_kwargs(tiny_model_dir, make_worker(tiny_model_dir, lag=2)),
    )
    first.train()
    checkpoint = tmp_path / "checkpoint-2"
    # Committed once written (CommittedCheckpointsMixin, docs/guarantees.md).
    record = json.loads((checkpoint / COMMIT_RECORD).read_text())
    assert record["complete"] and {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(record["files"])
    assert is_complete(str(checkpoint))

    worker = make_worker(tiny_model_dir, lag=2)
    worker.weight_transfer = RecordingWeightTransfer(worker.versions)
    resumed = AsyncRPGTrainer(tiny_model_dir, args=AsyncRPGConfig(**args), **trainer_kwargs(tiny_model_dir, worker))
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.state.global_step == 4
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4]  # 1-2 from the checkpoint
    saved = load_file(checkpoint / "model.safetensors")
    for name, tensor in worker.weight_transfer.sent[0].items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    adam_steps = {int(state["step"]) for state in resumed.optimizer.state_dict()["state"].values()}
    assert adam_steps == {4}


def test_local_worker_samples_from_the_published_version(tiny_model_dir):
    """The worker draws step s from version s - lag: with two published versions it loads the requested one."""
    worker = make_worker(tiny_model_dir, lag=1)
    names = dict(worker.model.named_parameters())
    version_1 = {name: p.detach().clone() for name, p in names.items()}
    version_2 = {name: p + 1.0 for name, p in version_1.items()}
    for version, weights in ((1, version_1), (2, version_2)):
        worker.weight_transfer.send_weights(iter(weights.items()))
        worker.update_model_version(version)
    worker.start()
    samples = [worker.rollout_buffer.get(timeout=60) for _ in range(3 * 16)]
    worker.stop()
    assert [s.model_version for s in samples] == [1] * 32 + [2] * 16
    for name, p in worker.model.named_parameters():
        torch.testing.assert_close(p.detach(), version_2[name])
    assert {len(s.input_ids) - int(s.completion_mask.sum()) for s in samples} == {4}  # the prompt "a+b="
    assert all(len(s.old_log_probs) == len(s.input_ids) for s in samples)


def test_example_script_reads_the_async_recipe(tmp_path):
    """`examples/async_rpg.py --config recipes/async/rpg_urkl.yaml` parses (no training): RPG-URKL anchored to the
    sampler, the staleness bound and token budget of the recipe, and the same run as TRL's `AsyncGRPOConfig`."""
    import importlib.util
    from pathlib import Path

    from trl import TrlParser

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("async_rpg_example", root / "examples" / "async_rpg.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # the dataclasses of a module with postponed annotations look themselves up there
    spec.loader.exec_module(example)
    argv = ["--config", str(root / "recipes" / "async" / "rpg_urkl.yaml"), "--output_dir", str(tmp_path)]
    argv += ["--use_cpu", "true", "--bf16", "false"]  # this machine has no GPU for `bf16: true`
    script_args, args = TrlParser((example.AsyncScriptArguments, AsyncRPGConfig)).parse_args_and_config(argv)
    assert (script_args.algorithm, script_args.model_name_or_path) == ("rpg", "Qwen/Qwen3-1.7B")
    assert (args.divergence, args.estimator, args.kl_anchor, args.beta) == ("urkl", "differentiable", "sampling", 1e-4)
    assert (args.max_staleness, args.token_budget, args.epsilon_high, args.learning_rate) == (4, 16384, 0.28, 1e-6)
    grpo = example.grpo_config(args)
    assert type(grpo) is AsyncGRPOConfig and (grpo.max_staleness, grpo.token_budget) == (4, 16384)


@pytest.mark.slow
def test_waiting_on_an_empty_rollout_queue_names_a_dead_vllm_server(tmp_path):
    """While the trainer waits on an empty rollout queue, TRL polls the rollout worker's health; AsyncRPGTrainer adds a
    probe of the vLLM server there, so a dead server is named at once (TRL's worker would retry its requests first).
    Checked on the health check itself: the worker's check runs first, then the probe of a port nobody listens on."""
    import http.server
    import threading
    from types import SimpleNamespace

    from rpg_trl.reliability import VLLMServerError
    from rpg_trl.reliability.vllm_server import ProbeWhileWaiting

    from helpers.ports import free_port

    calls = []
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True)
    trainer = SimpleNamespace(
        accelerator=accelerator, state=SimpleNamespace(global_step=7), args=SimpleNamespace(output_dir=str(tmp_path))
    )
    dead = f"http://127.0.0.1:{free_port()}"
    check = ProbeWhileWaiting(lambda stale_after_s: calls.append(stale_after_s), trainer, dead)
    with pytest.raises(VLLMServerError, match=rf"{re.escape(dead)} stopped answering .* at training step 7"):
        check(300.0)
    assert calls == [300.0]  # TRL's own check (worker crashed or hung) still runs, first

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ProbeWhileWaiting(calls.append, trainer, f"http://127.0.0.1:{server.server_port}")(60.0)  # answers: no error
    finally:
        server.shutdown()
    assert calls == [300.0, 60.0]

    def crashed(stale_after_s):
        raise RuntimeError("Rollout worker child has failed")

    with pytest.raises(RuntimeError, match="child has failed"):  # the worker's failure is not hidden by the probe
        ProbeWhileWaiting(crashed, trainer, dead)(300.0)


@pytest.mark.slow
def test_every_process_stops_naming_a_dead_vllm_server_found_while_the_rollout_queue_is_dry():
    """2 processes under `torch.distributed.run`: the main process waits on an empty rollout queue and its health check
    finds the (stand-in) vLLM server gone, while process 1 waits for the main process's batch in a broadcast (as
    accelerate's dispatching data loader does). The main process raises `VLLMServerError` naming the server (the root
    cause, exit 1), and process 1 logs the same error as its own and stops after it, instead of waiting."""
    from helpers import failure_two_proc

    returncode, output, seconds = failure_two_proc.launch("queue-dry")
    assert returncode != 0 and failure_two_proc.root_cause(output) == (0, 1), output[-3000:]
    cause = "stopped answering (ConnectionError: "
    assert re.search(rf"\[rank0\]: rpg_trl\.reliability\.vllm_server\.VLLMServerError: The vLLM server at \S+ {re.escape(cause)}",
                     output), output[-4000:]  # fmt: skip
    assert re.search(rf"^VLLMServerError on process 1: The vLLM server at \S+ {re.escape(cause)}", output, re.M)
    assert "got a batch" not in output and "the probe passed" not in output
    assert seconds < 40, seconds
