"""Tests of `RPGTrainer` / `RPGConfig` on a tiny local Qwen3 (CPU, no hub)."""

import math

import pytest
import torch
from trl import GRPOConfig

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.losses import DIAGNOSTIC_METRICS, DIVERGENCES, ESTIMATORS, rpg_loss
from rpg_trl.testing import build_char_tokenizer

from helpers.tiny_runs import (
    PROMPTS,
    count_sevens,
    fixed_inputs,
    logged,
    loss_and_grad,
    make_trainer,
    policy_logps,
    tiny_run_args,
)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_variant_trains_with_finite_loss(tiny_model_dir, tmp_path, divergence, estimator, off_policy):
    extra = dict(steps_per_generation=2, num_iterations=2, max_steps=4) if off_policy else {}
    trainer = make_trainer(tiny_model_dir, tmp_path, divergence=divergence, estimator=estimator, beta=0.05, **extra)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = logged(trainer, "loss")
    assert len(losses) == trainer.args.max_steps and all(math.isfinite(x) for x in losses)
    assert all(math.isfinite(x) for x in logged(trainer, "kl"))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    if off_policy:  # later steps reuse the generation: importance weights move away from 1
        assert max(logged(trainer, "importance_weight/max")) > 1.0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_sequence_level_kl_trains_and_logs_both_kl_estimates(tiny_model_dir, tmp_path, estimator):
    # The exact sequence-level KL (kl_level="sequence") toward a reference, off-policy after the first step.
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        kl_level="sequence",
        loss_type="luspo",
        kl_anchor="reference",
        beta=0.1,
        estimator=estimator,
        steps_per_generation=2,
        max_steps=4,
    )
    assert trainer.loss_spec.kl_level == "sequence" and trainer.loss_spec.aggregation == "seq-mean-token-sum"
    trainer.train()
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))
    token_kl, sequence_kl = logged(trainer, "kl"), logged(trainer, "kl/sequence")
    assert len(sequence_kl) == 4 and all(math.isfinite(x) for x in sequence_kl)
    # After the first update the policy has left the reference; URKL's estimates are never negative.
    assert token_kl[-1] > 0 and sequence_kl[-1] > 0
    # The diagnostics of the whole-completion weights and of the KL's share of the gradient, once per step.
    for key in DIAGNOSTIC_METRICS:
        values = logged(trainer, key)
        assert len(values) == 4 and all(math.isfinite(x) for x in values), key
    assert all(0 < x <= 1 + 1e-6 for x in logged(trainer, "kl/prefix_ess"))
    shares = logged(trainer, "kl/weight_share")  # 0 at the first step, whose policy is the reference
    assert all(0 <= x <= 1 for x in shares) and any(0 < x < 1 for x in shares)
    assert logged(trainer, "kl/log_prefix_weight/max")[1] > logged(trainer, "kl/log_prefix_weight/min")[1]


def test_sequence_kl_metric_is_the_sum_of_token_terms_on_policy(tiny_model_dir, tmp_path):
    # On-policy (w = W = 1) the whole-completion estimate is the sum over a completion of the per-token terms.
    trainer = make_trainer(tiny_model_dir, tmp_path, kl_anchor="reference", beta=0.1, divergence="rkl")
    inputs = fixed_inputs(trainer, spread=0.3)
    logps = policy_logps(
        trainer, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
    )
    inputs["old_per_token_logps"] = logps
    trainer.model.eval()
    trainer._compute_loss(trainer.model, inputs)
    mask = inputs["completion_mask"].double()
    per_token = logps.double() - inputs["ref_per_token_logps"].double()  # log ρ_t, the rkl term at W = 1
    expected = ((per_token * mask).sum(-1)).mean().item()
    assert trainer._metrics["eval"]["kl/sequence"][-1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kl_level", ["token", "sequence"])
def test_the_loss_and_its_metrics_wait_for_the_device_once(tiny_model_dir, tmp_path, kl_level):
    """No `.item()`, `if` on a device value or boolean indexing in `_compute_loss` and its backward pass (on a GPU each
    makes the host wait for the device): the metrics are reduced on the device and copied to the host once."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from trl import GRPOTrainer

    class CountWaits(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.waits = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket
            if op in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
                self.waits.append(op.__name__)
            elif op is torch.ops.aten.index and any(t is not None and t.dtype == torch.bool for t in args[1]):
                self.waits.append("boolean index")
            return func(*args, **(kwargs or {}))

    def waits(trainer, inputs):
        # The model's forward pass (transformers' mask checks wait too) runs first; the loss gets its log-probs.
        logps = policy_logps(
            trainer, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
        )
        logps.requires_grad_(True)
        trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.rand_like(logps), None)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        counter = CountWaits()
        with counter:
            trainer._compute_loss(trainer.model, inputs).backward()
        assert logps.grad is not None and logps.grad.abs().sum() > 0
        return counter.waits

    trainer = make_trainer(tiny_model_dir, tmp_path / "rpg", kl_anchor="reference", beta=0.1, kl_level=kl_level)
    inputs = fixed_inputs(trainer, spread=0.6)
    assert waits(trainer, inputs) == []
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    assert metrics["importance_weight/max"] > 1.2 and 0 < metrics["clip_ratio/high_max"] <= 1
    # The counter is not blind: GRPOTrainer's loss on the same batch waits for each of its metrics.
    grpo = make_trainer(tiny_model_dir, tmp_path / "grpo", GRPOTrainer, GRPOConfig, beta=0.1)
    assert waits(grpo, inputs).count("_local_scalar_dense") >= 5


def test_mean_reward_rises(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=20, logging_steps=5, steps_per_generation=2)
    trainer.train()
    rewards = logged(trainer, "reward")
    assert rewards[-1] > rewards[0] + 0.2, rewards


def test_sampling_anchor_loads_no_reference_model(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, beta=1e-4)
    assert trainer.ref_model is None
    assert trainer.args.beta == 1e-4 and trainer.rpg_beta == 1e-4
    ref_trainer = make_trainer(tiny_model_dir, tmp_path, beta=1e-4, kl_anchor="reference")
    assert ref_trainer.ref_model is not None


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_gradient_accumulation_8x1_equals_1x8(tiny_model_dir, tmp_path, aggregation):
    big = make_trainer(tiny_model_dir, tmp_path / "a", aggregation=aggregation, beta=0.1, kl_anchor="reference")
    small = make_trainer(
        tiny_model_dir,
        tmp_path / "b",
        aggregation=aggregation,
        beta=0.1,
        kl_anchor="reference",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        num_generations=4,
    )
    assert small.args.steps_per_generation == 8
    # float64: a float32 model's own backward differs by ~1e-3 between batch shapes, which would hide the loss's.
    big.model.double()
    small.model.double()
    inputs = fixed_inputs(big, spread=0.2)
    loss_big, grad_big = loss_and_grad(big, inputs)
    small.model.train()
    small.model.zero_grad()
    small.current_gradient_accumulation_steps = 8
    total = 0.0
    for i in range(8):
        micro = {k: (v[i : i + 1] if k != "num_items_in_batch" else v) for k, v in inputs.items()}
        loss = small._compute_loss(small.model, micro)
        loss.backward()
        total += loss.item()
    grad_small = torch.cat([p.grad.flatten() for p in small.model.parameters() if p.grad is not None])
    assert total == pytest.approx(loss_big.item(), rel=1e-6, abs=1e-9)
    assert torch.allclose(grad_small, grad_big, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kl_level", ["token", "sequence"])
def test_diagnostics_are_exact_over_the_micro_batches_of_an_optimizer_step(tiny_model_dir, tmp_path, kl_level):
    """The diagnostics of an optimizer step of 4 micro-batches are logged once, at its last micro-batch, and equal
    those of `rpg_loss` on the whole batch (not a mean over the micro-batches)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, beta=0.1, kl_anchor="sampling", kl_level=kl_level)
    inputs = fixed_inputs(trainer, spread=0.6)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 4
    state = trainer.accelerator.gradient_state
    try:
        for i in range(4):
            state._set_sync_gradients(i == 3)
            micro = {k: (v[2 * i : 2 * i + 2] if k != "num_items_in_batch" else v) for k, v in inputs.items()}
            trainer._compute_loss(trainer.model, micro)
    finally:
        state._set_sync_gradients(True)
    metrics = trainer._metrics["train"]
    assert len(metrics["kl"]) == 4 and all(len(metrics[key]) == 1 for key in DIAGNOSTIC_METRICS)
    logps = policy_logps(
        trainer, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
    )
    _, whole = rpg_loss(
        logps, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"], trainer.loss_spec
    )
    for key in DIAGNOSTIC_METRICS:
        assert metrics[key][0] == pytest.approx(float(whole[key]), rel=1e-4, abs=1e-6), key


def test_lora_trains_adapter_and_leaves_base_untouched(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    args = RPGConfig(**tiny_run_args(tmp_path, steps_per_generation=2, max_steps=3))
    trainer = RPGTrainer(
        tiny_model_dir,
        count_sevens,
        args=args,
        train_dataset=PROMPTS,
        processing_class=build_char_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert lora and trainer.ref_model is None
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in base.items())
    assert any(not torch.equal(params[n], v) for n, v in lora.items())
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))


def test_grpo_config_is_refused_with_a_clear_message(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="RPGConfig"):
        RPGTrainer(tiny_model_dir, count_sevens, args=GRPOConfig(**tiny_run_args(tmp_path)), train_dataset=PROMPTS)


def test_model_card_names_rpg_and_cites_the_paper(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    trainer.create_model_card(model_name="tiny-rpg")
    card = (tmp_path / "README.md").read_text()
    assert "2505.17508" in card and "rpg-reinforce-urkl" in card


GRPO_USER_SCRIPT = """
from trl import GRPOConfig, GRPOTrainer

def reward_len(completions, **kwargs):
    return [-abs(6 - len(c)) for c in completions]

training_args = GRPOConfig(
    output_dir=OUTPUT_DIR, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
    max_steps=2, beta=0.04, loss_type="grpo", report_to="none", use_cpu=True, save_strategy="no",
)
trainer = GRPOTrainer(
    model=MODEL, reward_funcs=reward_len, args=training_args, train_dataset=DATASET
)
trainer.train()
"""


def test_a_grpo_user_script_runs_with_only_the_class_names_swapped(tiny_model_dir, tmp_path):
    script = GRPO_USER_SCRIPT.replace(
        "from trl import GRPOConfig, GRPOTrainer", "from rpg_trl import RPGConfig, RPGTrainer"
    )
    script = script.replace("GRPOConfig(", "RPGConfig(").replace("GRPOTrainer(", "RPGTrainer(")
    namespace = dict(OUTPUT_DIR=str(tmp_path), MODEL=tiny_model_dir, DATASET=PROMPTS)
    exec(compile(script, "user_script.py", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, RPGTrainer) and trainer.state.global_step == 2
    assert trainer.args.aggregation == "seq-mean-token-mean"  # loss_type="grpo" keeps choosing the aggregation
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))


# ---------------------------------------------------------------------------------------------------- bad prompt rows
@pytest.mark.parametrize("split", ["training", "evaluation"])
def test_a_bad_prompt_row_is_refused_when_the_trainer_is_built_not_when_sampled(tiny_model_dir, tmp_path, split):
    from datasets import Dataset
    from trl import GRPOTrainer

    prompts = list(PROMPTS["prompt"])
    prompts[57] = None if split == "training" else "5+é="  # None; a character the tokenizer cannot encode
    bad = Dataset.from_dict({"prompt": prompts})
    datasets = {"train_dataset": bad} if split == "training" else {"train_dataset": PROMPTS, "eval_dataset": bad}
    what = "is None" if split == "training" else "makes the tokenizer raise"
    args = RPGConfig(**tiny_run_args(tmp_path, eval_strategy="no"))
    with pytest.raises(ValueError, match=rf"^Row 57 of the {split} dataset: its 'prompt' column {what}"):
        RPGTrainer(tiny_model_dir, count_sevens, args=args, processing_class=build_char_tokenizer(), **datasets)
    # TRL builds its trainer on the same data without a word: it would fail only when row 57 is sampled.
    GRPOTrainer(
        tiny_model_dir,
        count_sevens,
        args=GRPOConfig(**tiny_run_args(tmp_path)),
        processing_class=build_char_tokenizer(),
        **datasets,
    )


def test_a_bad_row_of_an_iterable_dataset_is_refused_naming_it_when_it_arrives(tiny_model_dir, tmp_path):
    from datasets import IterableDataset

    prompts = list(PROMPTS["prompt"])
    prompts[9] = ""
    stream = IterableDataset.from_generator(lambda: ({"prompt": p} for p in prompts))
    good = IterableDataset.from_generator(lambda: ({"prompt": p} for p in PROMPTS["prompt"]))
    args = RPGConfig(**tiny_run_args(tmp_path))
    tokenizer = build_char_tokenizer()
    trainer = RPGTrainer(tiny_model_dir, count_sevens, args=args, train_dataset=stream, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"^Row 9 of the training dataset: its 'prompt' column is an empty string"):
        trainer.train()  # (built without reading the stream)
    assert trainer.train_dataset is stream  # checked by the dataloader, not replaced (TRL's contract)
    trainer = RPGTrainer(tiny_model_dir, count_sevens, args=args, train_dataset=good, processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 2 and all(math.isfinite(x) for x in logged(trainer, "loss"))


def test_a_bad_row_of_an_iterable_evaluation_dataset_in_a_dict_is_refused_naming_it_when_evaluated(
    tiny_model_dir, tmp_path
):
    """The rows of an iterable evaluation dataset are checked as the evaluation dataloader reads them (the dataset of a
    dict named in the error), and the trainer keeps the user's dict and datasets; a map-style one beside it was checked
    when the trainer was built."""
    from datasets import IterableDataset

    prompts = list(PROMPTS["prompt"][:4])
    prompts[2] = None
    stream = IterableDataset.from_generator(lambda: ({"prompt": p} for p in prompts))
    eval_dataset = {"map": PROMPTS.select(range(2)), "stream": stream}
    args = RPGConfig(**tiny_run_args(tmp_path))
    trainer = RPGTrainer(
        tiny_model_dir,
        count_sevens,
        args=args,
        train_dataset=PROMPTS,
        eval_dataset=eval_dataset,
        processing_class=build_char_tokenizer(),
    )
    assert trainer.eval_dataset is eval_dataset and trainer.eval_dataset["stream"] is stream
    assert math.isfinite(trainer.evaluate(eval_dataset="map")["eval_loss"])  # the map-style one: fine
    with pytest.raises(
        ValueError, match=r"^Row 2 of the evaluation \('stream'\) dataset: its 'prompt' column is None"
    ):
        trainer.evaluate()
    assert trainer.eval_dataset is eval_dataset and trainer.eval_dataset["stream"] is stream
    # A dataset passed to `evaluate` is checked as well.
    with pytest.raises(ValueError, match=r"^Row 2 of the evaluation dataset: its 'prompt' column is None"):
        trainer.evaluate(eval_dataset=stream)


def test_a_prompt_too_long_for_the_context_is_reported_when_the_trainer_is_built_naming_the_bound(
    tiny_model_dir, tmp_path, caplog
):
    import logging

    from datasets import Dataset
    from transformers import AutoConfig

    from helpers.tiny_runs import rpg_warnings

    context = AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    fits = "1+2=" * ((context - 8) // 4)  # with max_completion_length = 8: exactly the context
    too_long = fits + "3+4="
    dataset = Dataset.from_dict({"prompt": ["1+2=", fits, too_long, "5+6=", too_long]})
    args = RPGConfig(**tiny_run_args(tmp_path, max_completion_length=8))
    with caplog.at_level(logging.WARNING):
        trainer = RPGTrainer(
            tiny_model_dir, count_sevens, args=args, train_dataset=dataset, processing_class=build_char_tokenizer()
        )
    messages = [m for m in rpg_warnings(caplog) if "max_position_embeddings" in m]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        f"A prompt of {len(too_long)} tokens (row 2 of the training dataset, and 1 other row(s); the text of a "
        f"conversational prompt, without its chat template) plus max_completion_length = 8 exceeds the model's "
        f"max_position_embeddings = {context}."
    )
    assert "is the model's `config.max_position_embeddings` minus `max_completion_length`" in messages[0]
    assert "no `max_prompt_length`" in messages[0]
    assert trainer._warned_sequence_length  # the run's one length warning


# ---------------------------------------------------------------------------------------------------- vLLM log-probs
def test_nonfinite_vllm_sampling_logps_are_counted_logged_and_reported_once(tiny_model_dir, tmp_path, caplog):
    """vLLM's sampling log-probs with NaN (vLLM sends `None`, TRL makes it NaN) and -inf: TRL's importance-sampling
    correction gives those tokens a ratio of exactly 1; RPGTrainer counts them per generation batch
    (`vllm/nonfinite_logps`) and warns once. The server is faked at `_generate_single_turn`, which returns what TRL's
    vLLM branch returns (completion ids and the sampled tokens' log-probs)."""
    import logging

    from helpers.tiny_runs import rpg_warnings

    trainer = make_trainer(tiny_model_dir, tmp_path)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # the branch TRL takes with vLLM
    trainer.vllm_importance_sampling_mode = "token_truncate"
    tokenizer = trainer.processing_class
    bad = {(0, 1): None, (3, 0): float("nan"), (6, 2): float("-inf")}  # (row, token) -> what the server sent

    def fake_server(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, logprobs = [], []
        for row in range(len(prompt_ids)):
            ids = tokenizer("7" * (3 + row % 4), add_special_tokens=False).input_ids  # ragged: 3 to 6 tokens
            completions.append(ids)
            logprobs.append([bad.get((row, t), -1.5) for t in range(len(ids))])
        return completions, logprobs

    trainer._generate_single_turn = fake_server
    inputs = [{"prompt": p} for p in PROMPTS["prompt"][:2] for _ in range(4)]  # 2 groups of 4
    tokens = sum(3 + row % 4 for row in range(8))
    trainer.model.train()
    with caplog.at_level(logging.WARNING):
        batches = [trainer._generate_and_score_completions(inputs) for _ in range(2)]
    assert trainer._metrics["train"]["vllm/nonfinite_logps"] == [3.0, 3.0]
    warnings = [m for m in rpg_warnings(caplog) if "non-finite" in m]
    assert len(warnings) == 1 and f"3 of the {tokens} completion tokens" in warnings[0]
    assert "`vllm/nonfinite_logps`" in warnings[0]
    # What is reported: TRL's ratio is exactly 1 for those tokens, and it corrects every other one.
    ratio = batches[0]["importance_sampling_ratio"]
    mask = batches[0]["completion_mask"].bool()
    flagged = torch.zeros_like(mask)
    for row, token in bad:
        flagged[row, token] = True
    assert ratio[0, 1] == 1.0 and ratio[3, 0] == 1.0  # NaN: no correction, silently
    assert ratio[6, 2] == trainer.vllm_importance_sampling_clip_max  # -inf: an infinite ratio, truncated
    assert not torch.any(ratio[mask & ~flagged] == 1.0)
    # Without vLLM's log-probs (transformers generation) nothing is logged.
    del trainer._generate_single_turn
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
    trainer._generate_and_score_completions(inputs)
    assert trainer._metrics["train"]["vllm/nonfinite_logps"] == [3.0, 3.0]
