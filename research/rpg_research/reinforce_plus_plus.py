# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""REINFORCE++ and REINFORCE++-Baseline (Hu, 2025), the paper's other baselines (Tables 5 and 6).

Both replace GRPO's advantage and keep its PPO-clipped loss (as verl and OpenRLHF, where the paper's runs come from,
do). With outcome reward ``R`` per completion, completion tokens ``t = 1..T`` and the per-token k1 estimate
``k1_t = log π_old(o_t) − log π_ref(o_t)`` of the KL to the reference, computed when the batch is sampled (k2 or k3
with `kl_estimator`):

1. score ``s = R`` (REINFORCE++) or ``s = R − mean of R over the group`` (REINFORCE++-Baseline);
2. token rewards ``r_t = −β·k1_t + s·[t = T]`` (with ``kl_penalty="reward"``; ``r_t = s·[t = T]`` otherwise);
3. return ``G_t = Σ_{u ≥ t} γ^{u−t} r_u`` (``γ = 1``: the score minus β times the KL still to come);
4. advantage = ``G_t`` whitened over every completion token of the generation batch (all processes):
   ``(G_t − mean) / sqrt(var + 1e-8)`` with the unbiased variance (verl's ``masked_whiten``).

This is verl's ``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` with its ``use_kl_in_reward`` penalty, and OpenRLHF's
``reinforce`` / ``reinforce_baseline`` estimators.

TRL's ``scale_rewards="batch"`` is *not* REINFORCE++-Baseline: it divides ``R − group mean`` by the standard deviation
of the raw rewards over the batch (which includes the spread between groups), per completion, without re-centring;
REINFORCE++-Baseline divides by the standard deviation of the group-centred scores, over tokens, after re-centring. They
coincide only when every group has the same mean reward and every completion the same length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig, GRPOTrainer

from rpg_trl.dynamic_sampling import DynamicSamplingArguments, DynamicSamplingMixin, weighted_reward_sum
from rpg_trl.reliability import ReliabilityMixin


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BASELINE_NAMES",
    "KL_ESTIMATORS",
    "KL_PENALTIES",
    "ReinforcePlusPlusConfig",
    "ReinforcePlusPlusTrainer",
    "masked_whiten",
    "outcome_scores",
    "reinforce_plus_plus_advantages",
]

ADVANTAGE_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_PENALTIES = ("reward", "loss")
#: Per-token estimators of KL(π_old‖π_ref) from ``d = log π_old − log π_ref`` (Schulman, 2020), as OpenRLHF's
#: ``compute_approx_kl``: k1 = d, k2 = d²/2, k3 = e^{−d} − 1 + d.
KL_ESTIMATORS = {
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d**2,
    "k3": lambda d: torch.expm1(-d) + d,
}
#: Paper names of the estimators, for tables and model cards.
BASELINE_NAMES = {"reinforce_plus_plus": "REINFORCE++", "reinforce_plus_plus_baseline": "REINFORCE++-Baseline"}


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity
) -> torch.Tensor:
    """
    ``(values − mean) / sqrt(var + 1e-8)`` over the positions where `mask` is 1, with the unbiased variance (verl's
    ``masked_whiten``); `reduce` sums a tensor over processes so that the statistics are those of the global batch.
    Masked positions of the result are 0. With fewer than two tokens the variance is taken as 0.
    """
    mask = mask.to(values.dtype)
    totals = reduce(torch.stack([(values * mask).sum(), mask.sum()]))
    count = totals[1]
    mean = totals[0] / count.clamp(min=1.0)
    squares = reduce(((values - mean) ** 2 * mask).sum())
    variance = torch.where(count > 1, squares / (count - 1).clamp(min=1.0), torch.zeros_like(squares))
    return (values - mean) * torch.rsqrt(variance + 1e-8) * mask


def reinforce_plus_plus_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    reduce: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> torch.Tensor:
    """
    Token-level REINFORCE++ advantages (module docstring, steps 2-4).

    Args:
        scores (`torch.Tensor` of shape `(B,)`):
            The outcome score of each completion: ``R`` (REINFORCE++) or ``R − group mean`` (REINFORCE++-Baseline).
        mask (`torch.Tensor` of shape `(B, T)`):
            1 on the completion tokens, 0 on padding. The score is credited at each completion's last token.
        kl (`torch.Tensor` of shape `(B, T)`, *optional*):
            Per-token KL estimate (e.g. k1 = ``log π_old − log π_ref``), subtracted from the token rewards with weight
            `kl_coef`.
        kl_coef (`float`, defaults to `0.0`):
            β of the KL penalty in the reward.
        gamma (`float`, defaults to `1.0`):
            Discount of the return.
        reduce (`Callable`, *optional*):
            Sums a tensor over processes (``accelerator.reduce``) so that the whitening uses the global batch.

    Returns:
        `torch.Tensor` of shape `(B, T)`: the whitened returns, 0 on padding.
    """
    if scores.dim() != 1 or mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"`scores` must have shape (B,) and `mask` (B, T); got {tuple(scores.shape)} and {tuple(mask.shape)}."
        )
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"`kl` must have the shape of `mask` {tuple(mask.shape)}; got {tuple(kl.shape)}.")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"`gamma` must be in [0, 1]; got {gamma!r}.")
    dtype = torch.promote_types(scores.dtype, torch.float32)
    mask = mask.to(dtype)
    num_tokens = mask.shape[1]
    # Index of each completion's last token (0 for an empty one, whose mask zeroes everything anyway).
    positions = torch.arange(num_tokens, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(dim=1)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores.to(dtype)
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * kl.to(dtype)
    rewards = rewards * mask
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(num_tokens)):
            running = rewards[:, t] + gamma * running
            returns[:, t] = running
    return masked_whiten(returns, mask, reduce)


def outcome_scores(rewards: torch.Tensor, num_generations: int, estimator: str) -> torch.Tensor:
    """
    Step 1 of the module docstring for a batch whose groups of `num_generations` completions are consecutive: `rewards`
    itself (REINFORCE++) or minus the group mean (REINFORCE++-Baseline). NaN rewards (unscorable completions) are left
    out of the group means and get a score of 0, as in TRL.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {list(ADVANTAGE_ESTIMATORS)}; got {estimator!r}.")
    if estimator == "reinforce_plus_plus_baseline":
        if rewards.numel() % num_generations:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}.")
        means = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        rewards = rewards - means
    return torch.nan_to_num(rewards, nan=0.0)


@dataclass
class ReinforcePlusPlusConfig(DynamicSamplingArguments, GRPOConfig):
    r"""
    Configuration class for the [`ReinforcePlusPlusTrainer`].

    [`ReinforcePlusPlusConfig`] inherits every parameter of [`trl.GRPOConfig`] (the PPO-clipped loss, `loss_type`,
    `epsilon`, ...) and chooses the advantage of REINFORCE++ ([REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models](https://huggingface.co/papers/2501.03262), Hu 2025), one of the baselines of the RPG paper
    (Tables 5 and 6). `scale_rewards` is not used: the advantages are whitened over the batch instead. DAPO dynamic
    sampling is available through [`~rpg_trl.dynamic_sampling.DynamicSamplingArguments`]'s fields, as in
    [`~rpg_trl.RPGConfig`].

    Parameters:
        advantage_estimator (`str`, *optional*, defaults to `"reinforce_plus_plus"`):
            `"reinforce_plus_plus"`: the return of the reward, no group baseline. `"reinforce_plus_plus_baseline"`: the
            reward minus its group mean. Both are whitened over the tokens of the generation batch.
        kl_penalty (`str`, *optional*, defaults to `"reward"`):
            `"reward"`: `beta` times the per-token k1 KL to the reference is subtracted from the token rewards
            (REINFORCE++). `"loss"`: TRL's `beta`·k3 term in the loss, as GRPO.
        kl_estimator (`str`, *optional*, defaults to `"k1"`):
            Per-token estimate of the KL in the reward: `"k1"` (verl's `kl_penalty="kl"`, OpenRLHF's default), `"k2"`
            or `"k3"`.
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount of the return.
    """

    advantage_estimator: str = field(
        default="reinforce_plus_plus",
        metadata={
            "help": "'reinforce_plus_plus' (default): advantage = return of the reward (KL penalty included), "
            "whitened over the batch's tokens, no group baseline. 'reinforce_plus_plus_baseline': reward minus its "
            "group mean, then the same return and whitening (verl's and OpenRLHF's estimators of the same names).",
            "choices": list(ADVANTAGE_ESTIMATORS),
        },
    )
    kl_penalty: str = field(
        default="reward",
        metadata={
            "help": "Where β acts. 'reward' (default, REINFORCE++): β·(log π_old − log π_ref) (k1) is subtracted from "
            "each token's reward before the return (verl's use_kl_in_reward, OpenRLHF's default); the loss has no KL "
            "term. 'loss': TRL's β·k3 term in the loss, as GRPO.",
            "choices": list(KL_PENALTIES),
        },
    )
    kl_estimator: str = field(
        default="k1",
        metadata={
            "help": "Per-token estimate of KL(π_old‖π_ref) subtracted from the reward with kl_penalty='reward', from "
            "d = log π_old − log π_ref: 'k1' = d (default; verl's kl_penalty='kl', OpenRLHF's default), 'k2' = d²/2, "
            "'k3' = exp(−d) − 1 + d.",
            "choices": list(KL_ESTIMATORS),
        },
    )
    gamma: float = field(
        default=1.0, metadata={"help": "Discount γ of the return (1.0, the default of verl and OpenRLHF)."}
    )
    beta: float = field(
        default=1e-4,
        metadata={
            "help": "KL coefficient β (to a frozen reference, the initial model). Default 1e-4, the paper's "
            "(Appendix H). 0 disables the KL and loads no reference model."
        },
    )

    def __post_init__(self):
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"`advantage_estimator` must be one of {list(ADVANTAGE_ESTIMATORS)}; got {self.advantage_estimator!r}."
            )
        if self.kl_penalty not in KL_PENALTIES:
            raise ValueError(f"`kl_penalty` must be one of {list(KL_PENALTIES)}; got {self.kl_penalty!r}.")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"`kl_estimator` must be one of {list(KL_ESTIMATORS)}; got {self.kl_estimator!r}.")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"`gamma` must be a number in [0, 1]; got {self.gamma!r}.")
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "REINFORCE++ scores the weighted sum of the rewards; `multi_objective_aggregation` must be "
                f"'sum_then_normalize', got {self.multi_objective_aggregation!r}."
            )
        super().__post_init__()
        self.check_dynamic_sampling_arguments()


class ReinforcePlusPlusTrainer(ReliabilityMixin, DynamicSamplingMixin, GRPOTrainer):
    """
    Trainer for REINFORCE++ and REINFORCE++-Baseline (Hu, 2025), the RPG paper's REINFORCE++ baselines.

    The only change w.r.t. [`~trl.GRPOTrainer`] is the advantage: token-level (B, T) whitened returns
    ([`reinforce_plus_plus_advantages`]) instead of group-normalised rewards, with the KL to the reference in the
    reward (`kl_penalty="reward"`) rather than in the loss. The loss is TRL's (`loss_type`, PPO clip).

    The class line shows the parts it shares with [`~rpg_trl.RPGTrainer`]: the reward guard, exact resume and checks
    ([`~rpg_trl.reliability.ReliabilityMixin`]) and DAPO dynamic sampling
    ([`~rpg_trl.dynamic_sampling.DynamicSamplingMixin`]); with dynamic sampling the advantages are whitened over the
    final batch, after the groups are chosen.
    """

    _tag_names = ["trl", "reinforce++"]
    _name = "REINFORCE++"
    _paper = {
        "title": "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
        "id": "2501.03262",
        # docstyle-ignore
        "citation": """\
@article{hu2025reinforce++,
    title        = {{REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models}},
    author       = {Jian Hu},
    journal      = {arXiv preprint arXiv:2501.03262},
    year         = 2025,
}""",
    }

    def __init__(self, model, reward_funcs=None, args: ReinforcePlusPlusConfig | None = None, **kwargs):
        if not isinstance(args, ReinforcePlusPlusConfig):
            raise TypeError(
                f"`args` must be a `ReinforcePlusPlusConfig`; got {type(args).__name__}. It adds `advantage_estimator`, "
                "`kl_penalty` and `gamma` to `GRPOConfig`."
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        # With kl_penalty="reward" the parent still loads the reference (it does when beta != 0) and scores every
        # batch with it, but its β·k3 loss term is switched off in `_compute_loss`.
        self.kl_in_reward = args.kl_penalty == "reward" and args.beta != 0.0

    def _generate_and_score_completions(self, inputs):
        # Through DynamicSamplingMixin (which keeps or drops whole groups, with the columns added by
        # `score_generation_round`) to GRPOTrainer; the advantages are whitened over the final batch.
        batch = super()._generate_and_score_completions(inputs)
        scores, kl = batch.pop("rfpp_scores"), batch.pop("rfpp_kl")
        mask = batch["completion_mask"]
        if batch.get("tool_mask") is not None:
            mask = mask * batch["tool_mask"]
        batch["advantages"] = reinforce_plus_plus_advantages(
            scores,
            mask,
            kl=kl,
            kl_coef=self.beta if self.kl_in_reward else 0.0,
            gamma=self.args.gamma,
            reduce=lambda t: self.accelerator.reduce(t, reduction="sum"),
        )
        if self.kl_in_reward:
            mode = "train" if self.model.training else "eval"
            fmask = mask.to(kl.dtype)
            totals = self.accelerator.reduce(torch.stack([(kl * fmask).sum(), fmask.sum()]), reduction="sum")
            self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return batch

    def score_generation_round(self, batch, rewards_per_func):
        """Each completion's score (step 1) and per-token KL estimate, as the columns `rfpp_scores` and `rfpp_kl` of
        the round's batch (DynamicSamplingMixin's hook: they follow their group when dynamic sampling chooses)."""
        batch = super().score_generation_round(batch, rewards_per_func)
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights)  # NaN: unscorable, score 0, as in TRL
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        scores = outcome_scores(rewards, num_generations, self.args.advantage_estimator)
        num_local = len(batch["completion_ids"])
        start = self.accelerator.process_index * num_local
        batch["rfpp_scores"] = scores[start : start + num_local].to(batch["completion_mask"].device)
        if self.kl_in_reward:
            batch["rfpp_kl"] = self._token_kl(batch, mode)
        else:
            batch["rfpp_kl"] = torch.zeros_like(batch["completion_mask"], dtype=torch.float32)
        return batch

    def _token_kl(self, batch, mode: str) -> torch.Tensor:
        """Per-token KL estimate (`kl_estimator`) from ``log π_old − log π_ref`` of the sampled tokens (π_old: TRL's
        `old_per_token_logps` when it kept them, else recomputed now, before any update)."""
        old = batch.get("old_per_token_logps")
        if old is None:
            input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    batch["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size
                    if mode == "train"
                    else self.args.per_device_eval_batch_size,
                )
        return KL_ESTIMATORS[self.args.kl_estimator]((old - batch["ref_per_token_logps"]).float())

    def _compute_loss(self, model, inputs):
        if not self.kl_in_reward:
            return super()._compute_loss(model, inputs)
        beta, self.beta = self.beta, 0.0  # the KL is in the advantage: no β·k3 term in the loss
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.beta = beta
