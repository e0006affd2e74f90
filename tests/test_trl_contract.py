"""TRL's contract, kept by `RPGTrainer`: each scenario runs the same way with `GRPOTrainer` / `GRPOConfig` and with
`RPGTrainer` / `RPGConfig`, and the observable outcome is the same for both (the objects the trainer holds, steps,
logged metric keys, trained parameters, evaluation metrics, checkpoints and resume). RPG's deliberate differences,
the TRL options it refuses, are in one table, [`REFUSED`], checked against both configurations and against
docs/trl_options.md.

The numbers themselves (loss, gradient, metrics on the same batch) are compared in tests/test_grpo_parity.py; here the
contract is what a GRPO user's script observes, so every test asserts the outcome GRPOTrainer gives, for both."""

import math
import re
import typing
from pathlib import Path

import pytest
import torch
from datasets import DatasetDict
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rpg_trl import RPGConfig, RPGTrainer
from rpg_trl.config import LOSS_TYPE_TO_AGGREGATION
from rpg_trl.testing import build_char_tokenizer

from helpers.tiny_runs import PROMPTS, count_sevens, logged, tiny_run_args


DOCS = Path(__file__).resolve().parent.parent / "docs" / "trl_options.md"


# ================================================================================================ RPG's differences
class Refusal(typing.NamedTuple):
    """A TRL option (or value) that `GRPOConfig` accepts and `RPGConfig` refuses, with a message naming it."""

    #: The option as the "Refused" table of docs/trl_options.md names it (its first column), or, for a value TRL accepts
    #: and that fails or gives NaN later (`RPGConfig._check_trl_values`), the option and value.
    option: str
    #: `GRPOConfig` keyword arguments: GRPOConfig accepts them; RPGConfig, with `rpg` added, refuses them.
    grpo: dict
    #: RPG's own fields that make the refused combination (empty when the TRL value alone is refused).
    rpg: dict
    why: str


#: Every TRL option or value that RPG deliberately refuses, and why: exactly the rows of the "Refused" table of
#: docs/trl_options.md (`test_the_refusal_table_is_the_one_of_the_docs`).
REFUSED = [
    Refusal('`loss_type="cispo"`', dict(loss_type="cispo"), {}, "another surrogate loss, which RPG replaces"),
    Refusal('`loss_type="sapo"`', dict(loss_type="sapo"), {}, "a soft gate instead of the clip; RPG-Style Clip"),
    Refusal('`loss_type="vespo"`', dict(loss_type="vespo"), {}, "its own sequence weights; RPG's are Sec. 3's"),
    Refusal("`delta` (two-sided clipping)", dict(delta=2.0), {}, "RPG-Style Clip bounds the weights with clip_c"),
    Refusal(
        "`aggregation` together with a non-default `loss_type` that asks for another normaliser",
        dict(loss_type="grpo"),
        dict(aggregation="token-mean"),
        "two normalisers asked for at once",
    ),
    Refusal(
        '`use_bias_correction_kl=False` with `divergence` other than `"urkl"`',
        dict(use_bias_correction_kl=False, beta=0.04),
        dict(divergence="fkl"),
        "GRPO's uncorrected k3 estimates the reverse KL only",
    ),
    Refusal(
        '`sync_ref_model` or `ref_model_sync_kl_threshold` with an explicit `kl_anchor="sampling"`',
        dict(sync_ref_model=True, beta=0.04),
        dict(kl_anchor="sampling"),
        "a reference is asked for, but the KL is anchored to the sampling policy (no reference exists)",
    ),
    # Values TRL accepts and that fail, or give NaN, later in training (RPGConfig._check_trl_values).
    Refusal("`temperature=0`", dict(temperature=0.0), {}, "TRL divides the logits by it"),
    Refusal("`top_p=0`", dict(top_p=0.0), {}, "no token left to sample"),
    Refusal("`num_iterations=0`", dict(num_iterations=0), {}, "no optimizer pass per generation"),
    Refusal("`steps_per_generation=0`", dict(steps_per_generation=0), {}, "an empty generation"),
    Refusal("`max_completion_length=0`", dict(max_completion_length=0), {}, "empty completions"),
    Refusal("`reward_weights=[nan]`", dict(reward_weights=[math.nan]), {}, "NaN advantages"),
    Refusal("`scale_rewards='max'`", dict(scale_rewards="max"), {}, "not one of TRL's scalings"),
    Refusal(
        "`multi_objective_aggregation='max'`",
        dict(multi_objective_aggregation="max"),
        {},
        "not one of TRL's aggregations",
    ),
    Refusal("`top_entropy_quantile=1.5`", dict(top_entropy_quantile=1.5), {}, "not a fraction"),
    Refusal("`entropy_coef=inf`", dict(entropy_coef=math.inf), {}, "an infinite loss"),
    Refusal("`off_policy_mask_threshold=-1`", dict(off_policy_mask_threshold=-1.0), {}, "a negative KL"),
]

#: `RPGConfig` settings under which RPG's loss is GRPO's (tests/test_grpo_parity.py): the differentiable estimator,
#: URKL toward the reference model (TRL's bias-corrected k3 with the same β), a dual-clip bound too far to act.
COINCIDING_RPG = dict(estimator="differentiable", divergence="urkl", clip_c=1e9, kl_anchor="reference")
#: What both configurations get: a KL term (β > 0, so GRPOTrainer loads a reference model and logs `kl` too) and
#: RPG's paper defaults where GRPO's differ, so that the two runs are the same run.
SHARED = dict(beta=0.04, epsilon_high=0.28, scale_rewards="group")

FLAVOURS = [
    pytest.param((GRPOTrainer, GRPOConfig, {}), id="GRPOTrainer"),
    pytest.param((RPGTrainer, RPGConfig, COINCIDING_RPG), id="RPGTrainer"),
]

#: Small evaluation datasets: 2 prompts each, 8 completions with num_generations=4 (one evaluation batch).
EVAL = PROMPTS.select(range(2))
EVAL_OTHER = PROMPTS.select(range(50, 52))


def _trainer(flavour, model, output_dir, train_dataset=PROMPTS, **kwargs):
    """A trainer of `flavour` ((trainer class, config class, RPG's own settings)) on `model` (a path or a model object)
    for a [`tiny_run_args`] run with [`SHARED`] settings; `kwargs` are the config's overrides, except the trainer's
    `eval_dataset`, `processing_class`, `callbacks` and `peft_config`, which go to the trainer."""
    trainer_cls, config_cls, own = flavour
    passed = {
        k: kwargs.pop(k) for k in ("eval_dataset", "processing_class", "callbacks", "peft_config") if k in kwargs
    }
    passed.setdefault("processing_class", build_char_tokenizer())
    args = config_cls(**tiny_run_args(output_dir, **{**SHARED, **own, **kwargs}))
    return trainer_cls(model, count_sevens, args=args, train_dataset=train_dataset, **passed)


def _train_logs(trainer) -> list[dict]:
    """The log entries of the training steps (not the summary at the end of `train()`, nor evaluations)."""
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _changed(before: dict, model) -> set:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


# ================================================================================================ init: what it holds
def _datasets(kind):
    """(train dataset, eval dataset) of each kind a user passes."""
    stream = PROMPTS.to_iterable_dataset()
    return {
        "train-map": (PROMPTS, None),
        "train-iterable": (stream, None),
        "eval-map": (PROMPTS, EVAL),
        "eval-iterable": (PROMPTS, EVAL.to_iterable_dataset()),
        "eval-DatasetDict": (PROMPTS, DatasetDict({"first": EVAL, "second": EVAL_OTHER})),
        "eval-dict": (stream, {"map": EVAL, "stream": EVAL_OTHER.to_iterable_dataset()}),
    }[kind]


@pytest.mark.parametrize(
    "kind", ["train-map", "train-iterable", "eval-map", "eval-iterable", "eval-DatasetDict", "eval-dict"]
)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_trainer_holds_the_datasets_it_was_given_also_after_building_its_dataloaders(
    tiny_model_dir, tmp_path, flavour, kind
):
    """`trainer.train_dataset is train_dataset` and `trainer.eval_dataset is eval_dataset` (a dict too, and each dataset
    in it), for map-style and iterable datasets, when the trainer is built and after its dataloaders are built and
    read: RPG checks the rows of an iterable dataset as they arrive without replacing the user's object (TRL's own
    `test_init_with_eval_dataset[iterable_dataset]` asserts the identity)."""
    train_dataset, eval_dataset = _datasets(kind)
    members = dict(eval_dataset) if isinstance(eval_dataset, dict) else None
    trainer = _trainer(flavour, tiny_model_dir, tmp_path, train_dataset=train_dataset, eval_dataset=eval_dataset)

    def assert_holds_them():
        assert trainer.train_dataset is train_dataset
        assert trainer.eval_dataset is eval_dataset
        if members is not None:
            assert trainer.eval_dataset == members and all(trainer.eval_dataset[k] is v for k, v in members.items())

    assert_holds_them()
    first = next(iter(trainer.get_train_dataloader()))
    assert len(first) == 8 and {row["prompt"] for row in first} <= set(PROMPTS["prompt"])
    for name in members or ([None] if eval_dataset is not None else []):
        rows = list(trainer.get_eval_dataloader(name))
        assert sum(len(batch) for batch in rows) == 2 * 4  # 2 prompts, each repeated num_generations times
    assert_holds_them()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_trainer_holds_the_model_tokenizer_and_callback_objects_it_was_given(tiny_model_dir, tmp_path, flavour):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = build_char_tokenizer()

    class Marker(TrainerCallback):
        pass

    callback = Marker()
    trainer = _trainer(flavour, model, tmp_path, processing_class=tokenizer, callbacks=[callback])
    assert trainer.model is model
    assert trainer.processing_class is tokenizer
    assert any(held is callback for held in trainer.callback_handler.callbacks)
    assert trainer.ref_model is not None and trainer.ref_model is not model  # β > 0: a reference of its own


# ================================================================================================ training
def _trl_loss_types() -> list[str]:
    """The loss types GRPOConfig documents (its `loss_type` help: "Supported values are 'a', 'b', ... and 'z'.")."""
    text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = re.search(r"Supported values are (.*?)\. ", text).group(1)
    return re.findall(r"'(\w+)'", supported)


TRAINED_LOSS_TYPES = sorted(LOSS_TYPE_TO_AGGREGATION)


def test_every_trl_loss_type_is_trained_here_or_refused_in_the_table():
    """Each of TRL's loss types is either one RPG trains with (as a normaliser), tested below, or a refusal of
    [`REFUSED`], never both and never neither."""
    refused = {r.grpo["loss_type"] for r in REFUSED if "loss_type" in r.grpo and not r.rpg}
    trl = _trl_loss_types()
    assert len(trl) == 8 and "dapo" in trl
    assert set(TRAINED_LOSS_TYPES) | refused == set(trl) and not set(TRAINED_LOSS_TYPES) & refused


@pytest.mark.parametrize("loss_type", TRAINED_LOSS_TYPES)
def test_each_loss_type_trains_and_logs_every_metric_grpo_trainer_logs(tiny_model_dir, tmp_path, loss_type):
    """The same one-step run with each trainer: the step runs, a finite loss is logged, parameters change, and every
    metric key GRPOTrainer logs is logged by RPGTrainer (which may log more)."""
    keys = {}
    for flavour in FLAVOURS:
        trainer_cls = flavour.values[0][0]
        trainer = _trainer(flavour.values[0], tiny_model_dir, tmp_path / flavour.id, loss_type=loss_type, max_steps=1)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        logs = _train_logs(trainer)
        assert trainer.state.global_step == 1 and len(logs) == 1, trainer_cls.__name__
        assert math.isfinite(logs[0]["loss"]) and math.isfinite(logs[0]["kl"]), trainer_cls.__name__
        assert _changed(before, trainer.model), trainer_cls.__name__
        keys[trainer_cls] = set(logs[0])
    assert {"loss", "kl", "entropy", "reward", "clip_ratio/region_mean"} <= keys[GRPOTrainer]
    assert keys[GRPOTrainer] - keys[RPGTrainer] == set()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_with_a_lora_peft_config_only_the_adapter_weights_train(tiny_model_dir, tmp_path, flavour):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(flavour, tiny_model_dir, tmp_path, peft_config=lora, max_steps=1)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = _changed(before, trainer.model)
    # LoRA's B starts at 0, so after one step only B has moved (A's gradient is B-weighted): a subset of the adapter.
    assert changed and changed <= trainable and any("lora_B" in n for n in changed)
    assert math.isfinite(logged(trainer, "loss")[0])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_with_gradient_accumulation_global_step_counts_optimizer_steps(tiny_model_dir, tmp_path, flavour):
    """Two micro-batches of 4 completions per optimizer step: `max_steps=2` is 2 optimizer steps, 4 micro-steps, 2
    logged losses."""

    class Count(TrainerCallback):
        steps = substeps = 0

        def on_step_end(self, args, state, control, **kwargs):
            Count.steps += 1

        def on_substep_end(self, args, state, control, **kwargs):
            Count.substeps += 1

    trainer = _trainer(
        flavour,
        tiny_model_dir,
        tmp_path,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        max_steps=2,
        callbacks=[Count()],
    )
    trainer.train()
    assert trainer.state.global_step == 2 and Count.steps == 2 and Count.substeps == 2
    assert [h["step"] for h in _train_logs(trainer)] == [1, 2]


# ================================================================================================ evaluation
def test_evaluation_of_a_dict_of_datasets_logs_the_metrics_grpo_trainer_logs_per_dataset(tiny_model_dir, tmp_path):
    """`eval_strategy="steps"` with a dict of a map-style and an iterable evaluation dataset: RPGTrainer logs every
    `eval_*` metric GRPOTrainer logs (transformers' `eval_<name>_loss`, `_runtime`, ... per dataset; GRPOTrainer's own
    metrics, e.g. `eval_reward`, without the name, in one log entry per dataset), and still holds the dict it was
    given."""
    keys = {}
    for flavour in FLAVOURS:
        eval_dataset = {"map": EVAL, "stream": EVAL_OTHER.to_iterable_dataset()}
        trainer = _trainer(
            flavour.values[0],
            tiny_model_dir,
            tmp_path / flavour.id,
            eval_dataset=eval_dataset,
            eval_strategy="steps",
            eval_steps=1,
            per_device_eval_batch_size=8,
            max_steps=1,
        )
        trainer.train()
        assert trainer.eval_dataset is eval_dataset
        keys[flavour.id] = {k for h in trainer.state.log_history for k in h if k.startswith("eval_")}
        for name in eval_dataset:
            assert math.isfinite(logged(trainer, f"eval_{name}_loss")[0]), (flavour.id, name)
    for name in ("map", "stream"):
        assert {f"eval_{name}_loss", f"eval_{name}_runtime"} <= keys["GRPOTrainer"]
    assert {"eval_reward", "eval_kl", "eval_entropy", "eval_completions/mean_length"} <= keys["GRPOTrainer"]
    assert keys["GRPOTrainer"] - keys["RPGTrainer"] == set()


# ================================================================================================ save and resume
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_new_trainer_resumes_from_the_last_checkpoint_and_continues_the_step_count(
    tiny_model_dir, tmp_path, flavour
):
    """One step saved (`save_steps=1`), then a new trainer with `max_steps=2` and `resume_from_checkpoint=True`: it
    starts from the checkpoint's step 1 (the step's log is the checkpoint's), runs step 2 only and saves it."""
    save = dict(save_strategy="steps", save_steps=1)
    first = _trainer(flavour, tiny_model_dir, tmp_path, max_steps=1, **save)
    first.train()
    assert (tmp_path / "checkpoint-1").is_dir()
    resumed = _trainer(flavour, tiny_model_dir, tmp_path, max_steps=2, **save)

    class Steps(TrainerCallback):
        ran = []

        def on_step_end(self, args, state, control, **kwargs):
            Steps.ran.append(state.global_step)

    resumed.add_callback(Steps())
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and Steps.ran == [2]
    assert [h["step"] for h in _train_logs(resumed)] == [1, 2]
    assert _train_logs(resumed)[0] == _train_logs(first)[0]  # step 1's log comes from the checkpoint
    assert (tmp_path / "checkpoint-2").is_dir()


# ================================================================================================ refused options
@pytest.mark.parametrize("refusal", REFUSED, ids=[r.option.replace("`", "") for r in REFUSED])
def test_grpo_config_accepts_each_refused_option_and_rpg_config_refuses_it_naming_it(refusal):
    common = dict(output_dir="unused", use_cpu=True, report_to="none")
    GRPOConfig(**common, **refusal.grpo)
    with pytest.raises(ValueError) as caught:
        RPGConfig(**common, **refusal.grpo, **refusal.rpg)
    message = str(caught.value)
    named = [name for name in refusal.grpo if name != "beta"]  # (β > 0 only makes the combination possible)
    assert any(f"`{name}" in message for name in named), (named, message)


def _documented_refusals() -> list[str]:
    """The first column of the "Refused" table of docs/trl_options.md."""
    section = DOCS.read_text().split("## Refused", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| option")]
    return [row.split(" | ")[0].removeprefix("| ") for row in rows]


def test_the_refusal_table_is_the_one_of_the_docs():
    documented = _documented_refusals()
    assert len(documented) >= 5 and '`loss_type="cispo"`' in documented
    assert sorted(r.option for r in REFUSED) == sorted(documented)
