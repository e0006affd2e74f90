"""RPG on the inputs GRPOTrainer takes beyond a text dataset: a vision-language model with images, `tools`, an
`environment_factory`, a `rollout_func` with an `env_mask`, a dict of evaluation datasets; and what tool-output tokens
(`tool_mask`, which a `rollout_func` gives as `env_mask`) must not touch in the loss.

The trainings run 2 steps on tiny models built locally (nothing is downloaded), with a trainer that records the inputs
its `_compute_loss` receives, to show that what GRPOTrainer prepares from each input reaches RPG's loss.

Tool and environment outputs enter a completion as tokens the policy did not sample: GRPOTrainer marks them 0 in
`tool_mask` and its loss ignores them. RPG's KL term is more exposed than GRPO's: at `kl_level="sequence"` every
token's weight reads the prefix ratios W≤t and the KL-to-go of the tokens after it, so a tool token that leaked into
either would move the weights of the model's own tokens. The first test drives `RPGTrainer._compute_loss` on fixed
log-probs (the model's forward pass replaced, so that the tool tokens' log-ratios can be made arbitrary and large) and
compares the loss, its gradient with respect to the log-probs and the logged metrics with those of the same batch
whose tool tokens are physically removed, and with float64 closed forms of the logged KL."""

import math
import string
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset

from rpg_trl import RPGConfig, RPGTrainer

from helpers.tiny_runs import PROMPTS, count_sevens, logged, make_trainer, tiny_run_args


class RecordingRPGTrainer(RPGTrainer):
    """An `RPGTrainer` that keeps (a shallow copy of) every batch its `_compute_loss` receives, in `seen_inputs`."""

    def __init__(self, *args, **kwargs):
        self.seen_inputs = []
        super().__init__(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        self.seen_inputs.append(dict(inputs))
        return super()._compute_loss(model, inputs)


def _train(model, tmp_path, processing_class, train_dataset, reward=count_sevens, args=None, **trainer_kwargs):
    """A [`RecordingRPGTrainer`] of a 2-step `tiny_run_args` run (`args` add to or replace them) with the other
    keyword arguments of GRPOTrainer, trained; returns it with the parameters it started from."""
    trainer = RecordingRPGTrainer(
        model,
        reward,
        args=RPGConfig(**tiny_run_args(tmp_path, **(args or {}))),
        train_dataset=train_dataset,
        processing_class=processing_class,
        **trainer_kwargs,
    )
    before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    return trainer, before


def _changed(trainer, before):
    """The names of the parameters that training changed."""
    return {name for name, param in trainer.model.named_parameters() if not torch.equal(param, before[name])}


def _assert_trained(trainer, before):
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    assert _changed(trainer, before), "no parameter changed"


#: Per completion, the role of each of its 8 positions: "m" a token the model sampled, "t" a tool-output token
#: (`tool_mask` 0), "." padding (`completion_mask` 0). Every completion has 5 model tokens, so that without its tool
#: tokens and its padding the batch is a 4 x 5 block with no mask at all: the reference needs no masking.
LAYOUT = ("mmttmmm.", "mtttmmmm", "mmmmm...", "mtmmmm..")


def _tool_batch(seed=0, tool_value=0.0):
    """An off-policy batch in the format `_compute_loss` receives, with tool-output tokens and padding per [`LAYOUT`],
    and the fixed per-token log-probs of the policy. π_old and π_ref are π_θ shifted by independent noise in ±0.3 on
    the model's tokens (importance ratios and reference ratios not 1), and all three are `tool_value`-dependent, large
    and different on the tool tokens and the padding (log-ratios of tens of nats), which must change nothing."""
    g = torch.Generator().manual_seed(seed)
    batch, length = len(LAYOUT), len(LAYOUT[0])
    completion_mask = torch.tensor([[c != "." for c in row] for row in LAYOUT], dtype=torch.long)
    tool_mask = torch.tensor([[c != "t" for c in row] for row in LAYOUT], dtype=torch.long)
    model_token = (completion_mask * tool_mask).bool()
    logps = -2.0 * torch.rand(batch, length, generator=g, dtype=torch.float64) - 0.05

    def noise():
        return (2 * torch.rand(batch, length, generator=g, dtype=torch.float64) - 1) * 0.3

    old, ref = logps + noise(), logps + noise()
    # Whatever the tool and padding positions hold: different, large log-ratios in either direction.
    junk = tool_value * torch.arange(1, batch * length + 1, dtype=torch.float64).reshape(batch, length).sin()
    logps = torch.where(model_token, logps, -30.0 + junk)
    old = torch.where(model_token, old, -0.5 - 3 * junk)
    ref = torch.where(model_token, ref, -40.0 + 2 * junk)
    return {
        "prompt_ids": torch.randint(2, 20, (batch, 3), generator=g),
        "prompt_mask": torch.ones(batch, 3, dtype=torch.long),
        "completion_ids": torch.randint(2, 20, (batch, length), generator=g),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        # Row 2 (negative advantage, π_old far from π_θ) is one that TRL's off-policy mask drops at threshold 0.01.
        "advantages": torch.tensor([1.0, -0.5, -0.75, 1.25]),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        # As GRPOTrainer counts it: the tokens of the loss, tool outputs left out.
        "num_items_in_batch": model_token.sum(),
    }, logps


def _without_tool_tokens(inputs, logps):
    """The same batch with its tool-output tokens and its padding physically removed: each completion's model tokens,
    in order, in a mask-free (4, 5) block."""
    keep = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    batch, length = keep.size(0), int(keep[0].sum())

    def compact(x):
        return x[keep].reshape(batch, length)

    return {
        "prompt_ids": inputs["prompt_ids"],
        "prompt_mask": inputs["prompt_mask"],
        "completion_ids": compact(inputs["completion_ids"]),
        "completion_mask": torch.ones(batch, length, dtype=torch.long),
        "advantages": inputs["advantages"],
        "old_per_token_logps": compact(inputs["old_per_token_logps"]),
        "ref_per_token_logps": compact(inputs["ref_per_token_logps"]),
        "num_items_in_batch": torch.tensor(batch * length),
    }, compact(logps)


def _loss_grad_metrics(trainer, inputs, logps):
    """`trainer._compute_loss` on `inputs` with the policy's per-token log-probs fixed to `logps` (the model's forward
    pass replaced; the entropies `-logps`: distinct on the model's tokens, and ~30 nats, the largest, on the tool
    tokens, where they would move a top-entropy quantile): the loss, its gradient with respect to `logps`, and every
    metric the call logged."""
    leaf = logps.clone().requires_grad_(True)
    entropies = -logps.float()

    def fixed_logps(*args, **kwargs):
        return leaf, entropies, None

    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics["train"].clear()
    trainer._get_per_token_logps_and_entropies = fixed_logps
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies
    loss.backward()
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return loss.detach(), leaf.grad, metrics


def _closed_form_kl(inputs, logps, divergence):
    """The logged `kl` (token mean of the per-token estimate S) and `kl/sequence` (completion mean of S at the
    whole-completion ratios W = Π w, R = Π r) in float64, over the model's tokens only (module docstring of
    `rpg_trl.losses`: S = r·(log r − log w) − r + w for ufkl, w·(log w − log r) − w + r for urkl, ...)."""
    keep = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    log_w = torch.where(keep, logps.double() - inputs["old_per_token_logps"].double(), 0.0)
    log_r = torch.where(keep, inputs["ref_per_token_logps"].double() - inputs["old_per_token_logps"].double(), 0.0)

    def estimate(log_w, log_r):
        w, r = log_w.exp(), log_r.exp()
        return {
            "fkl": r * (log_r - log_w),
            "ufkl": r * (log_r - log_w) - r + w,
            "rkl": w * (log_w - log_r),
            "urkl": w * (log_w - log_r) - w + r,
        }[divergence]

    token_mean = (estimate(log_w, log_r) * keep).sum() / keep.sum()
    sequence_mean = estimate(log_w.sum(-1), log_r.sum(-1)).mean()
    return token_mean.item(), sequence_mean.item()


# Both KL levels: per token with the normaliser of each loss_type; over whole completions with every divergence (whose
# weights have different parts: −R≤t, W≤t, the KL-to-go), both KL-to-go estimates and the clip's readings outside
# the trust region that keep the KL's sign (the truncated one reads the largest prefix ratio, the stopped one the clip
# regions).
TOOL_MASK_CASES = (
    [
        pytest.param(dict(kl_level="token", loss_type=loss_type), id=f"token-{loss_type}")
        for loss_type in ("grpo", "dapo", "dr_grpo", "luspo")
    ]
    + [
        # TRL's credit-assignment masks (on the reward term), whose quantile and sequence means read the loss's mask.
        pytest.param(dict(kl_level="token", loss_type="grpo", top_entropy_quantile=0.5), id="token-entropy-mask"),
        pytest.param(
            dict(kl_level="sequence", loss_type="luspo", off_policy_mask_threshold=0.01), id="sequence-off-policy-mask"
        ),
    ]
    + [
        pytest.param(
            dict(kl_level="sequence", loss_type="luspo", divergence=divergence, kl_clip_mode=mode, kl_to_go=to_go),
            id=f"sequence-{divergence}-{mode}-{to_go}",
        )
        for divergence, mode, to_go in [
            ("urkl", "truncated", "log_ratio"),
            ("urkl", "truncated", "k3"),
            ("urkl", "exact", "log_ratio"),
            ("urkl", "stopped", "log_ratio"),
            ("rkl", "truncated", "log_ratio"),
            ("ufkl", "truncated", "log_ratio"),
            ("fkl", "exact", "log_ratio"),
        ]
    ]
)


@pytest.mark.parametrize("estimator", ["reinforce", "differentiable"])
@pytest.mark.parametrize("settings", TOOL_MASK_CASES)
def test_tool_output_tokens_contribute_nothing_to_the_kl_its_weights_or_the_importance_ratios(
    tiny_model_dir, tmp_path, settings, estimator
):
    """With tool-output tokens (`tool_mask` 0) holding log-ratios of tens of nats, the loss, its gradient with respect
    to the log-probs of the model's tokens and every logged metric are those of the same batch with the tool tokens
    removed; the tool tokens get no gradient; the logged `kl` and `kl/sequence` are their float64 closed forms over the
    model's tokens; and other values at the tool positions change nothing. A tool token that entered a prefix ratio
    W≤t, a KL-to-go, an importance ratio, a clip region or a normaliser would break each of these by orders of
    magnitude more than rounding (its log-ratios are ~30 nats)."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, beta=0.1, kl_anchor="reference", estimator=estimator, clip_c=3.0, **settings
    )
    inputs, logps = _tool_batch()
    loss, grad, metrics = _loss_grad_metrics(trainer, inputs, logps)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    # The batch is off-policy on the model's tokens: importance and reference ratios are not 1.
    keep = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    assert (logps - inputs["old_per_token_logps"])[keep].abs().min() > 0
    assert metrics["importance_weight/max"] > 1.01 and metrics["importance_weight/min"] < 0.99

    compact_inputs, compact_logps = _without_tool_tokens(inputs, logps)
    expected_loss, expected_compact_grad, expected_metrics = _loss_grad_metrics(trainer, compact_inputs, compact_logps)
    expected_grad = torch.zeros_like(grad)
    expected_grad[keep] = expected_compact_grad.flatten()
    if "off_policy_mask_threshold" in settings:  # TRL's off-policy mask drops a completion of this batch, not all
        kept = trainer.get_off_policy_mask(
            compact_inputs["advantages"].unsqueeze(1),
            compact_logps,
            compact_inputs["old_per_token_logps"],
            compact_inputs["completion_mask"],
            settings["off_policy_mask_threshold"],
        )
        assert 0 < kept.sum() < kept.numel()
    # Not vacuous: most model tokens have a gradient (the clip can take a token's off, with kl_clip_mode="stopped").
    assert (expected_compact_grad != 0).sum() >= 0.75 * expected_compact_grad.numel()
    # float64 throughout, every term O(1): equal up to rounding (a leaked tool token, ~30 nats, moves them by ≥ 1).
    assert (loss - expected_loss).abs() < 1e-12, (loss, expected_loss)
    assert (grad - expected_grad).abs().max() < 1e-12, (grad, expected_grad)
    assert torch.all(grad[~keep] == 0), "a tool-output or padding token got a gradient"
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key

    token_kl, sequence_kl = _closed_form_kl(inputs, logps, trainer.loss_spec.divergence)
    assert metrics["kl"] == pytest.approx(token_kl, rel=1e-5)
    assert metrics["kl/sequence"] == pytest.approx(sequence_kl, rel=1e-5)

    # Other values at the tool (and padding) positions, for the policy, π_old and π_ref: nothing moves.
    other_inputs, other_logps = _tool_batch(tool_value=7.0)
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert not torch.equal(other_inputs[key], inputs[key])
        assert torch.equal(other_inputs[key][keep], inputs[key][keep])
    other_loss, other_grad, other_metrics = _loss_grad_metrics(trainer, other_inputs, other_logps)
    assert torch.equal(other_loss, loss)
    assert torch.equal(other_grad, grad)
    assert other_metrics == pytest.approx(metrics, nan_ok=True)


# ---------------------------------------------------------------------------------------------------------------------
# rollout_func and env_mask


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="defaults"),
        # The KL toward a reference model over whole completions, with 2 optimizer steps per generation (off-policy).
        pytest.param(
            dict(kl_level="sequence", loss_type="luspo", beta=0.1, kl_anchor="reference", num_iterations=2),
            id="sequence-kl",
        ),
    ],
)
def test_rollout_func_with_an_env_mask_trains_and_its_mask_reaches_the_loss_as_tool_mask(
    tiny_model_dir, tmp_path, monkeypatch, settings
):
    """A `rollout_func` returns, per prompt, the model's tokens around 3 environment-output tokens (`env_mask` 0).
    GRPOTrainer hands `env_mask` to the loss as `tool_mask` (padded with 1): RPG trains 2 steps on it, the mask that
    reaches `_compute_loss` is the rollout's, and the token count of the loss (`num_items_in_batch`) leaves the
    environment's tokens out."""
    from rpg_trl.testing import build_char_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # GRPOTrainer's warning that `rollout_func` is experimental
    tokenizer = build_char_tokenizer()
    rollouts = []

    def rollout_func(prompts, trainer):
        # Completions that differ within each group (rewards with a variance), all with the environment's "777" in
        # the middle, one shorter (padded) than the others.
        prompt_ids, completion_ids, logprobs, env_mask = [], [], [], []
        for i, prompt in enumerate(prompts):
            before, after = ("12", "4") if i % 2 else ("7", "345" if i % 4 == 0 else "3")
            ids = tokenizer(before + "777" + after + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append(ids)
            logprobs.append([-1.0] * len(ids))
            env_mask.append([1] * len(before) + [0, 0, 0] + [1] * (len(ids) - len(before) - 3))
        rollouts.append(list(zip(completion_ids, env_mask)))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "env_mask": env_mask}

    trainer, before = _train(tiny_model_dir, tmp_path, tokenizer, PROMPTS, args=settings, rollout_func=rollout_func)
    trainer.train()
    _assert_trained(trainer, before)
    # One generation per step, or one for both steps (num_iterations=2), each batch reused.
    generations = 2 // settings.get("num_iterations", 1)
    assert len(rollouts) == generations and len(trainer.seen_inputs) == 2
    for rollout, inputs in zip(rollouts * (2 // generations), trainer.seen_inputs):
        # GRPOTrainer shuffles the completions of a generation batch: each row is matched by its tokens.
        masks = {tuple(ids): mask for ids, mask in rollout}
        assert len(masks) == 3  # three distinct completions, with their environment output at different places
        length = inputs["completion_ids"].size(1)
        for ids, completion_mask, tool_mask in zip(
            inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist(), inputs["tool_mask"].tolist()
        ):
            n = sum(completion_mask)
            mask = masks[tuple(ids[:n])]
            assert tool_mask == mask + [1] * (length - n)  # the rollout's env_mask, padded with 1
        assert inputs["num_items_in_batch"].item() == sum(sum(mask) for _, mask in rollout)
    if generations == 1:  # the second step reuses the first step's completions: off-policy, ratios not 1
        assert "old_per_token_logps" in trainer.seen_inputs[1]
        assert logged(trainer, "importance_weight/max")[1] > 1.0
    # Completion lengths count the model's tokens only (GRPOTrainer's metrics with a tool mask).
    assert logged(trainer, "completions/max_length")[0] == max(sum(mask) for _, mask in rollouts[0])


# ---------------------------------------------------------------------------------------------------------------------
# A dict of evaluation datasets


def test_a_dict_of_eval_datasets_logs_the_metrics_of_each_under_its_name(tiny_model_dir, tmp_path):
    """`eval_dataset={"a": ..., "b": ...}` with `eval_strategy="steps"`: every evaluation logs each dataset's loss as
    `eval_a_loss` and `eval_b_loss` (the Trainer's prefix), each in a record of its own that holds RPG's metrics of
    that dataset's batches (GRPOTrainer logs its metrics as `eval_kl`, `eval_reward`, ... without the dataset's name),
    and the batches that reached the loss in evaluation are those datasets' prompts."""
    from rpg_trl.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    # 2 prompts x 4 completions: one evaluation batch per dataset; "0+0=", "1+1=" and "5+1=", "6+1=".
    eval_a = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(2)]})
    eval_b = Dataset.from_dict({"prompt": [f"{a}+1=" for a in range(5, 7)]})
    trainer, before = _train(
        tiny_model_dir,
        tmp_path,
        tokenizer,
        PROMPTS,
        args=dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8),
        eval_dataset={"a": eval_a, "b": eval_b},
    )
    trainer.train()
    _assert_trained(trainer, before)
    rpg_metrics = ("eval_kl", "eval_kl/sequence", "eval_entropy", "eval_reward", "eval_clip_ratio/region_mean")
    for name in ("a", "b"):
        records = [h for h in trainer.state.log_history if f"eval_{name}_loss" in h]
        assert len(records) == 2, (name, trainer.state.log_history)  # one per training step
        for record in records:
            for key in (f"eval_{name}_loss", *rpg_metrics):
                assert math.isfinite(record[key]), (name, key, record)
    # Training then evaluation of a then b, at each step: the evaluation batches are the datasets' prompts, in order.
    assert len(trainer.seen_inputs) == 6
    for inputs, dataset in zip(trainer.seen_inputs[1:3] + trainer.seen_inputs[4:6], [eval_a, eval_b] * 2):
        prompts = {tokenizer.decode(ids, skip_special_tokens=True) for ids in inputs["prompt_ids"]}
        assert prompts == set(dataset["prompt"])


# ---------------------------------------------------------------------------------------------------------------------
# tools and environment_factory


#: What the model "generates" (GRPOTrainer's `model.generate` patched, as TRL's own tool tests do): per group of two
#: completions, one tool call and one plain answer; after the tool's result, "Done!".
TOOL_CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'
PLAIN_ANSWER = "I do not know.<|im_end|>"
AFTER_TOOL = "Done!<|im_end|>"


@pytest.fixture(scope="module")
def tool_calling_model(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer can call tools as GRPOTrainer requires: a character tokenizer over the printable
    characters (the tools' JSON schemas go into the prompt), Qwen's special tokens (`<|im_end|>` the end of a turn,
    `<tool_call>`, ...) and TRL's Qwen3 chat template, for which TRL sets the response template that parses tool calls
    (`trl.chat_template_utils.add_response_schema`)."""
    from trl.chat_template_utils import qwen3_chat_template

    from rpg_trl.testing import build_char_tokenizer, save_tiny_model

    tokenizer = build_char_tokenizer(string.printable)
    specials = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = qwen3_chat_template
    # The prompt holds the tools' schemas: ~750 characters.
    path = save_tiny_model(tmp_path_factory.mktemp("tool-qwen3"), tokenizer=tokenizer, max_position_embeddings=1024)
    return path, tokenizer


def _fake_generate(tokenizer, name, arguments):
    """A `generate` that answers the first turn of a batch of 4 (2 prompts x 2) with a call of the tool `name` in the
    first completion of each group and a plain answer in the second, and every turn after a tool result with
    "Done!"."""

    def encode(texts):
        rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        width = max(len(row) for row in rows)
        return torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])

    call = TOOL_CALL.format(name=name, arguments=arguments)

    def generate(input_ids, **kwargs):
        texts = [call, PLAIN_ANSWER] * 2 if input_ids.size(0) == 4 else [AFTER_TOOL] * input_ids.size(0)
        return torch.cat([input_ids, encode(texts).to(input_ids.device)], dim=-1)

    return generate


def used_a_tool(completions, **kwargs):
    """Reward 1 for a conversation in which the model called a tool, 0 otherwise."""
    return [float(any(message.get("tool_calls") for message in completion)) for completion in completions]


def _assert_tool_outputs_masked(trainer, tokenizer, result):
    """In every batch that reached the loss, the completions with a tool call hold the tool's response (`result`)
    exactly at their `tool_mask` 0 tokens, followed by the model's "Done!"; the others have no `tool_mask` 0 token."""
    assert len(trainer.seen_inputs) == 2
    for inputs in trainer.seen_inputs:
        calls = 0
        for ids, completion_mask, tool_mask in zip(
            inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist(), inputs["tool_mask"].tolist()
        ):
            model_part = tokenizer.decode([i for i, m, t in zip(ids, completion_mask, tool_mask) if m and t])
            tool_part = tokenizer.decode([i for i, m, t in zip(ids, completion_mask, tool_mask) if m and not t])
            if model_part.startswith("<tool_call>"):
                calls += 1
                assert f"<tool_response>\n{result}\n</tool_response>" in tool_part, tool_part
                assert model_part.endswith(AFTER_TOOL) and result not in model_part, model_part
            else:
                assert model_part == PLAIN_ANSWER and tool_part == ""
        assert calls == 2
        assert inputs["num_items_in_batch"].item() == (inputs["completion_mask"] * inputs["tool_mask"]).sum().item()


@pytest.mark.slow  # ~5-20 s on 2 CPU cores: prompts of ~750 tokens (the tools' schemas)
def test_tools_train_with_the_tool_output_masked_from_the_loss(tool_calling_model, tmp_path):
    """`tools=[multiply]`: the model calls the tool in half of its completions, GRPOTrainer runs it, appends its result
    to the completion and marks it in `tool_mask`; RPG (β > 0, KL to a reference model) trains 2 steps on it, and the
    result's tokens are exactly the masked ones."""
    path, tokenizer = tool_calling_model
    calls = []

    def multiply(a: int, b: int) -> int:
        """
        Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        calls.append((a, b))
        return a * b

    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a}*4?"}] for a in range(8)]})
    trainer, before = _train(
        path,
        tmp_path,
        tokenizer,
        prompts,
        reward=used_a_tool,
        args=dict(
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=128,
            beta=0.1,
            kl_anchor="reference",
        ),
        tools=[multiply],
    )
    generate = _fake_generate(tokenizer, "multiply", '{"a": 3, "b": 4}')
    with patch.object(trainer.model, "generate", side_effect=generate):
        trainer.train()
    _assert_trained(trainer, before)
    assert calls == [(3, 4)] * 4  # 2 calls per step
    assert logged(trainer, "tools/call_frequency") == [0.5, 0.5]
    assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    _assert_tool_outputs_masked(trainer, tokenizer, "12")


@pytest.mark.slow  # ~5-20 s on 2 CPU cores: prompts of ~750 tokens (the tools' schemas)
def test_environment_factory_trains_with_the_environment_output_masked_from_the_loss(
    tool_calling_model, tmp_path, monkeypatch
):
    """`environment_factory`: one environment per completion, reset before each generation, whose public method is a
    tool; the model calls it in half of its completions, and RPG trains 2 steps with its output masked from the
    loss."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # GRPOTrainer's warning that environments are experimental
    path, tokenizer = tool_calling_model

    class Counter:
        def __init__(self):
            self.count = 0
            self.resets = 0

        def reset(self, **kwargs):
            self.count = 0
            self.resets += 1

        def increment(self, step: int) -> int:
            """
            Increment the counter.

            Args:
                step: The value to add to the counter.

            Returns:
                The counter's value.
            """
            self.count += step
            return 100 + self.count

    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {a}."}] for a in range(8)]})
    trainer, before = _train(
        path,
        tmp_path,
        tokenizer,
        prompts,
        reward=used_a_tool,
        args=dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=128),
        environment_factory=Counter,
    )
    generate = _fake_generate(tokenizer, "increment", '{"step": 5}')
    with patch.object(trainer.model, "generate", side_effect=generate):
        trainer.train()
    _assert_trained(trainer, before)
    assert logged(trainer, "tools/call_frequency") == [0.5, 0.5]
    assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    # After the last step: the environments of the tool calls counted once (reset before each generation).
    assert sorted(env.count for env in trainer.environments) == [0, 0, 5, 5]
    assert all(env.resets == 2 for env in trainer.environments)
    _assert_tool_outputs_masked(trainer, tokenizer, "105")


# ---------------------------------------------------------------------------------------------------------------------
# A vision-language model with images


def _image_only_qwen2_vl_processor(image_processor, tokenizer, chat_template):
    """A `Qwen2VLProcessor` without its video processor: transformers' video processors need torchvision, which is not
    among the test dependencies (and the images need none of it: the slow, PIL-based image processor serves them)."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # Qwen2VLProcessor.__init__ without the video processor it hands to ProcessorMixin.
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=chat_template)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A tiny Qwen2-VL (the architecture of TRL's `tiny-Qwen2VLForConditionalGeneration`, 2 layers of width 16 in the
    language model and in the vision tower, ~80k parameters) saved under a local path, and its processor: the PIL image
    processor (images of 28 x 28 pixels: 4 patches of 14 merged into 1 image token) and a character tokenizer with
    Qwen's special tokens (`<|vision_start|>`, `<|image_pad|>`, ...) and Qwen2-VL's chat template, which puts an image
    placeholder where a message has an image."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from trl.chat_template_utils import qwen2_5_vl_chat_template

    from rpg_trl.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer(string.printable)
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = "<|im_end|>"
    token_id = tokenizer.convert_tokens_to_ids
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28})
    processor = _image_only_qwen2_vl_processor(image_processor, tokenizer, qwen2_5_vl_chat_template)
    # As TRL's tiny Qwen2-VL: multimodal RoPE with one frequency per section.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1]}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters=rope,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=16, num_heads=4, mlp_ratio=2, patch_size=14),
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    return str(path), processor


def digit_fraction(completions, **kwargs):
    """The fraction of digits in a conversational completion's text (a reward that varies between random samples)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in (c[0]["content"] for c in completions)]


@pytest.mark.slow  # ~5-20 s on 2 CPU cores: a vision tower and a reference model
def test_vision_language_model_trains_on_images_and_pixel_values_reach_the_loss(tiny_vlm, tmp_path):
    """A dataset with an `image` column (PIL images) and conversational prompts, as TRL documents for VLM GRPO: RPG
    (β > 0, KL to a reference model) trains a tiny Qwen2-VL 2 steps; the images' pixels and grids reach `_compute_loss`
    with each batch, and both the vision tower and the language model learn (the gradient reaches the vision tower only
    through the image tokens of the prompts)."""
    import numpy as np
    from PIL import Image

    path, processor = tiny_vlm
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)) for _ in range(8)]
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "What digit is drawn here?"}]] * 8,
            "image": images,
        }
    )
    trainer, before = _train(
        path,
        tmp_path,
        processor,
        dataset,
        reward=digit_fraction,
        args=dict(per_device_train_batch_size=4, num_generations=2, beta=0.1, kl_anchor="reference"),
    )
    trainer.train()
    _assert_trained(trainer, before)
    changed = _changed(trainer, before)
    assert any(".visual." in name or name.startswith("visual.") for name in changed), sorted(changed)
    assert any("language_model" in name for name in changed), sorted(changed)
    assert len(trainer.seen_inputs) == 2
    for inputs in trainer.seen_inputs:
        # One image per completion (the 2 prompts' images, each repeated for its 2 completions): 4 patches each.
        assert torch.equal(inputs["image_grid_thw"].cpu(), torch.tensor([[1, 2, 2]] * 4))
        assert inputs["pixel_values"].shape == (4 * 4, 3 * 2 * 14 * 14)
        image_tokens = (inputs["prompt_ids"] == processor.image_token_id).sum(-1)
        assert image_tokens.tolist() == [1] * 4
        assert torch.isfinite(inputs["ref_per_token_logps"]).all()  # the reference model scored the image batch
