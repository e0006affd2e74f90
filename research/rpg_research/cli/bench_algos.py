# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl bench-algos`` command: the paper's comparison in miniature, on a protocol fixed before the runs.

Two tables, on the demo's task (two-digit additions from a supervised warm start, [`rpg_research.toy`]):

1. **Algorithms** ([`ALGORITHMS`]): GRPO, DAPO, REINFORCE++(-Baseline) and four RPG variants, in the paper's
   off-policy regime (``steps_per_generation=16``: every generation batch serves 16 optimizer steps, as the paper's
   512 prompts in mini-batches of 32, Sec. 5) and at 4 steps per generation. For each method and regime the learning
   rate is the best of a grid by the mean held-out accuracy on *selection* seeds, which are not reported; the final
   runs use fresh seeds, consecutive from a stated start, paired across methods (one warm start per seed, shared).
2. **KL** ([`rpg_research.cli.bench_kl`]): the same warm starts trained on a proxy reward with an exploitable flaw
   ([`rpg_research.toy.proxy`]) with the KL to the warm start at a β large enough to act, held-out score the true reward:
   RPG's corrected KL per token and over whole completions (reverse and forward families), GRPO's uncorrected k3
   and no KL.

Reported per method (over the final seeds): Last, Best and Gain over the warm start (held-out accuracy), stability
(largest fall of the training reward, runs that collapse, entropy at the end), each as a mean with its 95 % Student-t
interval, and the paired difference to GRPO with its interval ([`rpg_research.cli.protocol`]). A run **collapses** when it
ends more than [`runs.COLLAPSE_ACCURACY_DROP`] below its warm start or its training reward falls by more than
[`runs.COLLAPSE_REWARD_DROP`] below its running maximum (moving average over 5 generation batches).

Runs are independent jobs spread over ``--num_workers`` processes of one torch thread each (the numbers do not depend
on the number of workers), and each run stores its result in its folder: a command interrupted and started again
runs only what is missing. Outputs in ``--output_dir``: ``table.md``, ``results.json``, ``bench_algos.png``,
``bench_kl.png``, the warm starts (``warm_starts/seed<k>``) and each run's trainer state.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import apply_preset, check_arguments, dataclass_arguments, machine, print_report
from .runs import describe_run, off_default_settings, run_spec, run_summary, train_quietly, warm_started
from .warm_start_bench import WARM_START_PRESETS, add_bench_parser, chosen, output_dir_field


#: Algorithm name -> (trainer, configuration overrides). "grpo" runs TRL's GRPOTrainer, "rpg" runs RPGTrainer, "rfpp"
#: runs `rpg_research.reinforce_plus_plus.ReinforcePlusPlusTrainer`.
ALGORITHMS = {
    "GRPO": (
        "grpo",
        {
            "loss_type": "grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "scale_rewards": "group",
            "beta": 1e-4,
            "use_bias_correction_kl": False,
        },
    ),
    "DAPO": (
        "grpo",
        {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group", "beta": 0.0},
    ),
    "RPG-UFKL": ("rpg", {"divergence": "ufkl", "estimator": "differentiable"}),
    "RPG-URKL": ("rpg", {"divergence": "urkl", "estimator": "differentiable"}),
    "RPG-REINFORCE-UFKL": ("rpg", {"divergence": "ufkl", "estimator": "reinforce"}),
    "RPG-REINFORCE-URKL": ("rpg", {"divergence": "urkl", "estimator": "reinforce"}),
    # The fourth protocol (research/docs/bench_algos.md): RPGConfig's defaults, per token and over whole completions.
    "RPG default": ("rpg", {}),
    "RPG sequence": ("rpg", {"kl_level": "sequence"}),
    "REINFORCE++": (
        "rfpp",
        {"advantage_estimator": "reinforce_plus_plus", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 1e-4},
    ),
    "REINFORCE++-Baseline": (
        "rfpp",
        {"advantage_estimator": "reinforce_plus_plus_baseline", "epsilon": 0.2, "epsilon_high": 0.2, "beta": 1e-4},
    ),
}
#: The method every other is compared with, seed by seed.
BASELINE = "GRPO"
#: The tables the command can run.
TABLES = ("algorithms", "kl", "kl_sweep")
#: The protocol (full) and the smoke test (``--quick``): the values of the options left unset.
PRESETS = {
    "full": {
        **{k: v for k, v in WARM_START_PRESETS["full"].items() if k != "seeds"},
        "regimes": [16, 4],
        "learning_rates": [1.5e-4, 3e-4, 6e-4, 1.2e-3],
        "selection_seeds": [100, 101],
        "final_seed_start": 1000,
        "num_final_seeds": 5,
        "steps": 128,
        "eval_every": 32,
        # The first protocol's eight methods (the two arms added for the long task are RPG-REINFORCE-URKL itself
        # and its sequence level).
        "algorithms": [name for name in ALGORITHMS if name not in ("RPG default", "RPG sequence")],
        "kl_arms": None,  # all of rpg_research.cli.bench_kl.KL_ARMS
        "kl_betas": [0.2],
        "kl_beta_selection": "shared",
        "sweep_seeds": [2000, 2001],
        "sweep_betas": [0.05, 0.1, 0.2],
        "sweep_learning_rates": [1e-3, 2e-3],
    },
    "quick": {
        **{k: v for k, v in WARM_START_PRESETS["quick"].items() if k != "seeds"},
        "sft_steps": 40,
        "eval_problems": 16,
        "regimes": [16],
        "learning_rates": [6e-4, 1.2e-3],
        "selection_seeds": [100],
        "final_seed_start": 1000,
        "num_final_seeds": 2,
        "steps": 4,
        "eval_every": 2,
        "algorithms": [BASELINE, "RPG-REINFORCE-URKL"],
        "kl_arms": ["no KL", "RPG-URKL, token, exact"],
        "kl_betas": [0.1],
        "kl_beta_selection": "shared",
        "sweep_seeds": [2000],
        "sweep_betas": [0.1],
        "sweep_learning_rates": [2e-3],
    },
}
#: The fourth protocol (long completions, research/docs/bench_algos.md, fixed on 2026-11-26 at 20:11 UTC): the presets of
#: ``--task long_addition``. The KL table's learning rate is the protocol's pilot choice (``--kl_learning_rate``).
LONG_PRESETS = {
    "full": {
        "sft_steps": 400,
        "sft_extra_rounds": 0,
        "eval_problems": 200,
        "regimes": [16],
        "learning_rates": [1e-4, 3e-4, 1e-3],
        "selection_seeds": [100, 101],
        "final_seed_start": 4000,
        "num_final_seeds": 5,
        "steps": 32,
        "eval_every": 32,
        "algorithms": ["GRPO", "DAPO", "RPG default", "RPG sequence", "REINFORCE++-Baseline"],
        "kl_arms": [
            "no KL",
            "RPG-URKL, token, default",
            "RPG-URKL, token, exact",
            "RPG-URKL, sequence, default",
            "TRL k3 (corrected)",
        ],
        "kl_betas": [0.2],
        "kl_beta_selection": "shared",
        "sweep_seeds": [2000, 2001],
        "sweep_betas": [0.2],
        "sweep_learning_rates": [2e-3],
    },
    "quick": {
        "sft_steps": 40,
        "sft_extra_rounds": 0,
        "eval_problems": 16,
        "regimes": [4],
        "learning_rates": [3e-4],
        "selection_seeds": [100],
        "final_seed_start": 4000,
        "num_final_seeds": 2,
        "steps": 4,
        "eval_every": 4,
        "algorithms": [BASELINE, "RPG sequence"],
        "kl_arms": ["no KL", "RPG-URKL, sequence, default"],
        "kl_betas": [0.2],
        "kl_beta_selection": "shared",
        "sweep_seeds": [2000],
        "sweep_betas": [0.2],
        "sweep_learning_rates": [2e-3],
    },
}
#: The presets of ``--task ring_walk`` (issue 63: walks of 64 letters, every token uncertain): the fourth protocol's,
#: with the ring walk's warm start and its 100 held-out problems (of 234), on seeds of its own.
RING_PRESETS = {
    # The fifth protocol (research/docs/bench_algos.md): its KL table, each arm at its own β.
    "full": {
        **LONG_PRESETS["full"],
        "sft_steps": 400,
        "eval_problems": 100,
        "selection_seeds": [200, 201],
        "final_seed_start": 5000,
        "kl_arms": [
            "no KL",
            "GRPO (TRL, k3 uncorrected)",
            "TRL k3 (corrected)",
            "RPG-URKL, token, default",
            "RPG-URKL, sequence, default",
            "RPG-URKL, sequence, default, k3",
        ],
        "kl_betas": [0.01, 0.1, 1.0],
        "kl_beta_selection": "per_arm",
    },
    "quick": {**LONG_PRESETS["quick"], "sft_steps": 40, "final_seed_start": 5000},
}
#: The presets of each task (``--task``).
TASK_PRESETS = {"addition": PRESETS, "long_addition": LONG_PRESETS, "ring_walk": RING_PRESETS}


@dataclass
class BenchAlgosArguments:
    """Arguments of ``rpg-trl bench-algos``. Unset options take the protocol's value, or with ``--quick`` the smoke
    test's ([`PRESETS`])."""

    presets = PRESETS

    output_dir: str = output_dir_field("runs/bench_algos")
    task: str = field(
        default="addition",
        metadata={
            "help": "The task: 'addition' (two-digit sums, 3-4 tokens), 'long_addition' (four-digit sums worked out "
            "in rows, 109-110 tokens; the fourth protocol, whose presets then apply: research/docs/bench_algos.md) or "
            "'ring_walk' (walks of 64 letters, every token uncertain; the fourth protocol's presets on its own warm "
            "start: research/docs/demo.md)."
        },
    )
    model_size: str = field(
        default="small",
        metadata={
            "help": "Size of the task's model (`rpg-trl demo --model_size`): 'small' (the CPU one; the only size of "
            "'addition'), or 'large' for 'long_addition' or 'ring_walk' on a GPU (13.8M parameters; the fourth "
            "protocol's GPU-sized variant)."
        },
    )
    device: str = field(
        default="cpu",
        metadata={"help": "Where every run trains: 'cpu' (float32) or 'cuda' (the first GPU, bf16 autocast)."},
    )
    diagnostics: bool = field(
        default=False,
        metadata={
            "help": "Record the diagnostics by position along the completion (importance weights, clipped tokens, "
            "the sequence level's truncation factor) in every run of the algorithms, KL and sweep tables, and for "
            "RPG with β > 0 those of the KL term's gradient per step (half-batch cosine, KL/reward gradient-norm "
            "ratio; four extra backward passes a step); always on with `task='long_addition'` and `task='ring_walk'`."
        },
    )
    tables: list[str] = field(default_factory=lambda: list(TABLES), metadata={"help": f"Tables to run: {TABLES}."})
    regimes: list[int] | None = field(
        default=None, metadata={"help": "Optimizer steps per generation batch (`steps_per_generation`), one row each."}
    )
    learning_rates: list[float] | None = field(
        default=None,
        metadata={"help": "Learning-rate grid searched for each method and regime on the selection seeds."},
    )
    selection_seeds: list[int] | None = field(
        default=None, metadata={"help": "Seeds that choose the learning rates (not reported)."}
    )
    final_seed_start: int | None = field(
        default=None, metadata={"help": "First final seed; the final seeds are consecutive from it."}
    )
    num_final_seeds: int | None = field(default=None, metadata={"help": "Number of final (reported) seeds."})
    algorithms: list[str] | None = field(
        default=None, metadata={"help": f"Methods of the algorithms table, among {list(ALGORITHMS)}."}
    )
    kl_arms: list[str] | None = field(
        default=None,
        metadata={
            "help": "Arms of the KL table (rpg_research.cli.bench_kl.KL_ARMS, or the follow-up arms KL_FOLLOW_UP_ARMS). "
            "Default: KL_ARMS."
        },
    )
    kl_learning_rate: float = field(default=2e-3, metadata={"help": "Learning rate of every run of the KL table."})
    kl_betas: list[float] | None = field(
        default=None,
        metadata={"help": "Grid of the KL table's β, chosen on the selection seeds (see kl_beta_selection)."},
    )
    kl_beta_selection: str | None = field(
        default=None,
        metadata={
            "help": "How the KL table's β is chosen from kl_betas: 'shared' (one β for every regularised arm, the best "
            "over all of them) or 'per_arm' (each arm's own best). Default: the task's preset ('shared' before the "
            "fifth protocol).",
            "choices": ["shared", "per_arm"],
        },
    )
    sweep_seeds: list[int] | None = field(
        default=None,
        metadata={"help": "Seeds of the KL robustness sweep (fresh: neither selection nor final seeds)."},
    )
    sweep_betas: list[float] | None = field(default=None, metadata={"help": "β values of the KL robustness sweep."})
    sweep_arms: list[str] | None = field(
        default=None,
        metadata={
            "help": "Arms of the KL robustness sweep (any arm of rpg_research.cli.bench_kl.ALL_KL_ARMS). Default: "
            "KL_SWEEP_ARMS."
        },
    )
    sweep_learning_rates: list[float] | None = field(
        default=None, metadata={"help": "Learning rates of the KL robustness sweep."}
    )
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps per run."})
    sft_steps: int | None = field(default=None, metadata={"help": "Warm-start steps per seed."})
    sft_extra_rounds: int | None = field(
        default=None,
        metadata={"help": "Extra warm-start rounds while the model cannot add yet (see `rpg-trl demo`)."},
    )
    eval_every: int | None = field(default=None, metadata={"help": "Held-out evaluation every this many steps."})
    eval_problems: int | None = field(default=None, metadata={"help": "Number of held-out problems."})
    eval_samples: int = field(default=4, metadata={"help": "Completions per held-out problem (mean@k)."})
    num_workers: int = field(default=2, metadata={"help": "Runs trained at once, each in its own process."})
    num_threads: int = field(default=1, metadata={"help": "Torch CPU threads per run."})
    quick: bool = field(
        default=False,
        metadata={"help": "A smoke test of the whole protocol: few seeds, methods and steps (~1-2 minutes)."},
    )

    def __post_init__(self):
        from .bench_kl import ALL_KL_ARMS, KL_ARMS, KL_SWEEP_ARMS

        if self.task not in TASK_PRESETS:
            raise ValueError(f"`task` must be one of {list(TASK_PRESETS)}; got {self.task!r}.")
        apply_preset(self, TASK_PRESETS[self.task], self.quick)
        self.diagnostics = self.diagnostics or self.task in ("long_addition", "ring_walk")
        from ..toy.tasks import check_model_size_and_device

        check_model_size_and_device(self.task, self.model_size, self.device)
        check_arguments(
            self,
            at_least_one=(
                "steps",
                "eval_every",
                "eval_problems",
                "eval_samples",
                "num_workers",
                "num_threads",
                "num_final_seeds",
            ),
            at_least_zero=("sft_steps", "sft_extra_rounds", "final_seed_start"),
            positive=("kl_learning_rate",),
        )
        self.tables = chosen(self.tables, dict.fromkeys(TABLES), list(TABLES), "table")
        self.algorithms = chosen(self.algorithms, ALGORITHMS, list(ALGORITHMS), "algorithm")
        self.kl_arms = chosen(self.kl_arms, ALL_KL_ARMS, list(KL_ARMS), "KL arm")
        self.sweep_arms = chosen(self.sweep_arms, ALL_KL_ARMS, list(KL_SWEEP_ARMS), "sweep arm")
        if not self.regimes or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.regimes):
            raise ValueError(f"`regimes` must list integers >= 1 (steps per generation); got {self.regimes!r}.")
        if not self.learning_rates or any(not lr > 0 for lr in self.learning_rates):
            raise ValueError(f"`learning_rates` must list positive numbers; got {self.learning_rates!r}.")
        if not self.selection_seeds:
            raise ValueError("`selection_seeds` must list at least one seed.")
        if self.kl_beta_selection not in ("shared", "per_arm"):
            raise ValueError(f"`kl_beta_selection` must be 'shared' or 'per_arm'; got {self.kl_beta_selection!r}.")
        if not self.kl_betas or any(not beta > 0 for beta in self.kl_betas):
            raise ValueError(f"`kl_betas` must list positive numbers; got {self.kl_betas!r}.")
        for name in ("sweep_betas", "sweep_learning_rates"):
            if not getattr(self, name) or any(not value > 0 for value in getattr(self, name)):
                raise ValueError(f"`{name}` must list positive numbers; got {getattr(self, name)!r}.")
        if not self.sweep_seeds:
            raise ValueError("`sweep_seeds` must list at least one seed.")
        reused = sorted(set(self.sweep_seeds) & {*self.selection_seeds, *self.final_seeds})
        if reused:
            raise ValueError(
                f"The sweep seeds {self.sweep_seeds} must be fresh: {reused} are selection or final seeds. Choose "
                "others with `sweep_seeds`."
            )
        overlap = sorted(set(self.selection_seeds) & set(self.final_seeds))
        if overlap:
            raise ValueError(
                f"The final seeds {self.final_seeds} must be fresh: {overlap} also choose the learning rates "
                "(`selection_seeds`). Move `final_seed_start`."
            )

    @property
    def final_seeds(self) -> list[int]:
        """The reported seeds: `num_final_seeds` consecutive seeds from `final_seed_start` (never chosen by hand)."""
        return list(range(self.final_seed_start, self.final_seed_start + self.num_final_seeds))


# ----------------------------------------------------------------------------------------------------------------------
# one run (in a worker process)
# ----------------------------------------------------------------------------------------------------------------------


def warm_start_job(spec: dict, run_dir: str) -> dict:
    """The warm start of `spec["seed"]` for `spec["task"]` in `run_dir` (cached there,
    [`rpg_research.cli.bench_tasks.cached_task_warm_start`])."""
    from .bench_tasks import cached_task_warm_start, task_splits

    splits = task_splits(spec["task"], spec["seed"], spec["eval_problems"], spec["sft_steps"])
    return cached_task_warm_start(
        spec["task"],
        splits,
        run_dir,
        steps=spec["sft_steps"],
        seed=spec["seed"],
        extra_rounds=spec["sft_extra_rounds"],
        model_size=spec.get("model_size", "small"),
        device=spec.get("device", "cpu"),
    )


def algorithm_config(algorithm: str) -> dict:
    """The trainer and the configuration overrides of `algorithm` ([`ALGORITHMS`]), with, for RPG, the default of the
    KL weighting outside the trust region that its runs rely on (part of a run's specification)."""
    from rpg_trl.losses import DEFAULT_KL_CLIP_MODE

    kind, overrides = ALGORITHMS[algorithm]
    if kind == "rpg":
        overrides = {"kl_clip_mode": DEFAULT_KL_CLIP_MODE, **overrides}
    return {"trainer": kind, **overrides}


def algorithm_job(spec: dict, run_dir: str) -> dict:
    """Train `spec["algorithm"]` from the warm start `spec["sft_dir"]` on `spec["task"]` and return its
    [`run_summary`], with the diagnostics by position ([`rpg_research.cli.position_diagnostics`]) where
    `spec["diagnostics"]` asks for them."""
    from trl import GRPOConfig, GRPOTrainer

    from rpg_research.reinforce_plus_plus import ReinforcePlusPlusConfig, ReinforcePlusPlusTrainer
    from rpg_trl.config import RPGConfig
    from rpg_trl.trainer import RPGTrainer

    from ..toy.training import rl_training_kwargs
    from .bench_tasks import bench_task
    from .position_diagnostics import PositionDiagnostics

    task = bench_task(spec["task"])
    overrides = dict(spec["config"])
    kind = overrides.pop("trainer")
    splits, model, tokenizer, accuracy = warm_started(spec)
    kwargs = rl_training_kwargs(
        steps=spec["steps"],
        seed=spec["seed"],
        learning_rate=spec["learning_rate"],
        max_completion_length=task.demo_task.max_completion_length,
        device=spec.get("device", "cpu"),
    )
    kwargs.update(
        steps_per_generation=spec["regime"],
        per_device_train_batch_size=task.completions_per_step,
        disable_tqdm=True,
    )
    config_class = {"rpg": RPGConfig, "grpo": GRPOConfig, "rfpp": ReinforcePlusPlusConfig}[kind]
    trainer_class = {"rpg": RPGTrainer, "grpo": GRPOTrainer, "rfpp": ReinforcePlusPlusTrainer}[kind]
    trainer = trainer_class(
        model=model,
        reward_funcs=task.demo_task.reward,
        args=config_class(output_dir=run_dir, **kwargs, **overrides),
        train_dataset=task.demo_task.build_rl_dataset(splits.rl),
        processing_class=tokenizer,
        callbacks=[accuracy],
    )
    diagnostics = PositionDiagnostics(task.position_groups).attach(trainer) if spec.get("diagnostics") else None
    seconds = train_quietly(trainer)
    summary = run_summary(trainer.state.log_history, accuracy.curve, seconds, spec["regime"])
    if diagnostics is not None:
        summary["positions"] = diagnostics.summary()
        if diagnostics.gradient_steps:
            summary["kl_gradient"] = diagnostics.gradient_summary()
            summary["kl_gradient_steps"] = diagnostics.gradient_steps  # per step, in order
    return summary


# ----------------------------------------------------------------------------------------------------------------------
# the protocol
# ----------------------------------------------------------------------------------------------------------------------


def _lr_name(learning_rate: float) -> str:
    return f"lr{learning_rate:.2e}"


def warm_starts(args: BenchAlgosArguments, seeds: list[int], pool) -> dict[int, str]:
    """Train (or reuse) the warm start of each seed, in parallel; return seed -> its folder."""
    from .protocol import run_jobs

    root = Path(args.output_dir) / "warm_starts"
    jobs = [
        (
            {
                "task": args.task,
                "seed": seed,
                "sft_steps": args.sft_steps,
                "sft_extra_rounds": args.sft_extra_rounds,
                "eval_problems": args.eval_problems,
                **off_default_settings(args),
            },
            str(root / f"seed{seed}"),
        )
        for seed in seeds
    ]
    run_jobs(jobs, warm_start_job, pool=pool, num_threads=args.num_threads, desc="warm starts")
    return {spec["seed"]: run_dir for spec, run_dir in jobs}


def run_algorithms_table(args: BenchAlgosArguments, sft_dirs: dict[int, str], pool) -> dict:
    """
    The algorithms table: every (regime, method, learning rate) on the selection seeds, the rule
    ([`rpg_research.cli.protocol.select_best`]: highest mean Last) per (regime, method), then every (regime, method) at
    its chosen rate on the final seeds. Returns the selection grid, the choices and the final runs.
    """
    from .protocol import run_jobs, select_best

    root = Path(args.output_dir) / "algorithms"

    def jobs_for(seeds, rates_of):
        jobs = []
        for regime in args.regimes:
            for algorithm in args.algorithms:
                for learning_rate in rates_of(regime, algorithm):
                    for seed in seeds:
                        spec = run_spec(
                            args,
                            sft_dirs,
                            seed,
                            config=algorithm_config(algorithm),
                            algorithm=algorithm,
                            regime=regime,
                            learning_rate=learning_rate,
                            diagnostics=args.diagnostics,
                        )
                        run_dir = root / f"spg{regime}" / algorithm / _lr_name(learning_rate) / f"seed{seed}"
                        jobs.append((spec, str(run_dir)))
        return jobs

    common = {"pool": pool, "num_threads": args.num_threads, "describe": describe_run}
    # A grid of one learning rate selects nothing: no selection runs then.
    grid_rates = args.learning_rates if len(args.learning_rates) > 1 else []
    selection_jobs = jobs_for(args.selection_seeds, lambda regime, algorithm: grid_rates)
    selection = run_jobs(selection_jobs, algorithm_job, desc="algorithms: selection runs", **common)
    grid: dict[tuple, dict[float, list[float]]] = {}
    for (spec, _), result in zip(selection_jobs, selection):
        key = (spec["regime"], spec["algorithm"])
        grid.setdefault(key, {}).setdefault(spec["learning_rate"], []).append(result["last"])
    chosen_rates = {key: select_best(scores) for key, scores in grid.items()} or {
        (regime, algorithm): args.learning_rates[0] for regime in args.regimes for algorithm in args.algorithms
    }
    final_jobs = jobs_for(args.final_seeds, lambda regime, algorithm: [chosen_rates[(regime, algorithm)]])
    final = run_jobs(final_jobs, algorithm_job, desc="algorithms: final runs", **common)
    runs = [{**spec, **result, "run_dir": run_dir} for (spec, run_dir), result in zip(final_jobs, final)]
    return {
        "selection": [
            {"regime": regime, "algorithm": algorithm, "learning_rate": lr, "selection_last": scores}
            for (regime, algorithm), by_rate in grid.items()
            for lr, scores in sorted(by_rate.items())
        ],
        "chosen_learning_rates": [
            {"regime": regime, "algorithm": algorithm, "learning_rate": lr}
            for (regime, algorithm), lr in chosen_rates.items()
        ],
        "runs": runs,
    }


# ----------------------------------------------------------------------------------------------------------------------
# tables and figure
# ----------------------------------------------------------------------------------------------------------------------


def summarize(runs: list[dict], group_key: str, baseline: str | None) -> list[dict]:
    """
    One row per value of `group_key` among `runs` (in order of appearance): mean and 95 % interval of Last, Best, Gain,
    largest reward drop and end entropy, the number of collapsed runs, the means of the diagnostics, and, when
    `baseline` ran, the paired difference of Last and of Best to it.
    """
    from .protocol import mean_interval, paired_difference

    names = list(dict.fromkeys(run[group_key] for run in runs))
    by_name = {name: [run for run in runs if run[group_key] == name] for name in names}
    rows = []
    for name, group in by_name.items():
        row = {group_key: name, "seeds": [run["seed"] for run in group], "learning_rate": group[0]["learning_rate"]}
        for key in ("last", "best", "gain", "max_reward_drop", "entropy_end", "seconds"):
            row[key], row[key + "_ci"] = mean_interval([run[key] for run in group])
        row["collapsed"] = sum(run["collapsed"] for run in group)
        for key in ("kl", "clip_region", "importance_weight_max", "importance_weight_min"):
            values = [run[key] for run in group if run.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
        if baseline is not None and baseline in by_name and name != baseline:
            for key in ("last", "best"):
                mine = {run["seed"]: run[key] for run in group}
                theirs = {run["seed"]: run[key] for run in by_name[baseline]}
                row[f"{key}_vs_baseline"], row[f"{key}_vs_baseline_ci"], _ = paired_difference(mine, theirs)
        rows.append(row)
    return rows


def _optional(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def format_algorithms_table(rows: list[dict], regime: int, args: BenchAlgosArguments) -> str:
    """Markdown table of one regime's rows of [`summarize`]."""
    from .protocol import format_interval
    from .warm_start_bench import markdown_table

    n = len(args.final_seeds)
    caption = (
        f"**{regime} optimizer steps per generation batch.** Held-out accuracy (sampled mean@{args.eval_samples}, "
        f"{args.eval_problems} unseen problems) after {args.steps} steps; mean ± 95 % interval over {n} final seeds "
        f"({args.final_seeds[0]}-{args.final_seeds[-1]}); Δ: paired difference to {BASELINE} (points). "
        "Diagnostics are means over training."
    )
    header = [
        "Method",
        "lr",
        "Last",
        f"Δ Last vs {BASELINE}",
        "Best",
        f"Δ Best vs {BASELINE}",
        "Gain (points)",
        "Max reward drop (points)",
        "Collapsed",
        "Entropy (end)",
        "Clipped tokens (%)",
        "IW max / min",
    ]
    cells = []
    for row in rows:
        iw = (
            "–"
            if row["importance_weight_max"] is None
            else f"{row['importance_weight_max']:.2f} / {row['importance_weight_min']:.2f}"
        )
        cells.append(
            [
                row["algorithm"],
                f"{row['learning_rate']:.2g}",
                format_interval(row["last"], row["last_ci"], digits=3),
                "–"
                if "last_vs_baseline" not in row
                else format_interval(row["last_vs_baseline"], row["last_vs_baseline_ci"], scale=100, sign=True),
                format_interval(row["best"], row["best_ci"], digits=3),
                "–"
                if "best_vs_baseline" not in row
                else format_interval(row["best_vs_baseline"], row["best_vs_baseline_ci"], scale=100, sign=True),
                format_interval(row["gain"], row["gain_ci"], scale=100),
                format_interval(row["max_reward_drop"], row["max_reward_drop_ci"], scale=100),
                f"{row['collapsed']}/{n}",
                format_interval(row["entropy_end"], row["entropy_end_ci"], digits=3),
                _optional(None if row["clip_region"] is None else 100 * row["clip_region"], ".1f"),
                iw,
            ]
        )
    return markdown_table(caption, header, cells)


def format_selection_table(selection: list[dict], chosen_rates: list[dict], args: BenchAlgosArguments) -> str:
    """The selection grid: mean Last on the selection seeds per (regime, method, learning rate), the chosen in bold."""
    from .warm_start_bench import markdown_table

    chosen_set = {(c["regime"], c["algorithm"], c["learning_rate"]) for c in chosen_rates}
    header = ["Regime", "Method", *(f"lr {lr:.2g}" for lr in args.learning_rates)]
    cells = []
    for regime in args.regimes:
        for algorithm in args.algorithms:
            row = [f"{regime} steps/gen", algorithm]
            for lr in args.learning_rates:
                entry = next(
                    (
                        s
                        for s in selection
                        if (s["regime"], s["algorithm"], s["learning_rate"]) == (regime, algorithm, lr)
                    ),
                    None,
                )
                if entry is None:
                    row.append("–")
                    continue
                text = f"{statistics.fmean(entry['selection_last']):.3f}"
                row.append(f"**{text}**" if (regime, algorithm, lr) in chosen_set else text)
            cells.append(row)
    caption = (
        f"Selection (not part of the result): mean Last over the selection seeds {args.selection_seeds}; in bold the "
        "rate each method then ran with on the final seeds (highest mean, ties to the smaller rate)."
    )
    return markdown_table(caption, header, cells)


def plot_algorithms(runs: list[dict], output: str, args: BenchAlgosArguments) -> str:
    """Per regime: held-out accuracy gain over the warm start (mean over the final seeds) and training reward."""
    from ..toy.curves import REWARD_WINDOW, moving_average
    from .warm_start_bench import mean_gain_curve, mean_metric_curve, pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(len(args.regimes), 2, figsize=(12, 3.6 * len(args.regimes)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, regime in enumerate(args.regimes):
        ax_acc, ax_reward = axes[r]
        for index, algorithm in enumerate(args.algorithms):
            group = [run for run in runs if run["regime"] == regime and run["algorithm"] == algorithm]
            if not group:
                continue
            color = colors[index % len(colors)]
            style = "-" if ALGORITHMS[algorithm][0] == "rpg" else "--"
            steps, mean, _ = mean_gain_curve(group)
            ax_acc.plot(steps, mean, style, marker="o", markersize=3, color=color, label=algorithm)
            steps, values = mean_metric_curve([run["run_dir"] for run in group], "reward")
            if values:
                ax_reward.plot(steps, moving_average(values, REWARD_WINDOW), style, color=color)
        ax_acc.set_title(f"{regime} steps/generation: held-out accuracy gain (points)", fontsize=10)
        ax_reward.set_title(
            f"{regime} steps/generation: training reward (moving avg. over {REWARD_WINDOW} batches)",
            fontsize=10,
        )
        for ax in (ax_acc, ax_reward):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    return save_figure(fig, axes[0][0], output, bottom=0.1, dpi=110, max_columns=4)


def _can_plot() -> bool:
    """Whether matplotlib is installed (a GPU image may lack it): without it the figures are left out, with a note,
    and the tables and results.json are still written."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print("matplotlib is not installed: no figure (the tables and results.json are written).")
    return False


def diagnostics_tables(runs: list[dict], group_key: str, what: str) -> tuple[list[str], dict]:
    """The diagnostics tables of `runs` (those of one table, grouped by `group_key`; `what` names the table): by
    position ([`rpg_research.cli.position_diagnostics.format_positions_table`]) and, where RPG arms with β > 0
    recorded them, of the KL term's gradient per step (`format_gradients_table`). Returns the markdown tables and
    their rows, ``{"positions": ..., "kl_gradient": ...}``."""
    from .position_diagnostics import (
        GRADIENTS_CAPTION,
        format_gradients_table,
        format_positions_table,
        summarize_gradients,
        summarize_positions,
    )

    tables = []
    rows = {"positions": summarize_positions(runs, group_key), "kl_gradient": summarize_gradients(runs, group_key)}
    if rows["positions"]:
        tables.append(
            format_positions_table(
                rows["positions"],
                group_key,
                f"**Diagnostics by position, {what}** (final seeds; each number per training step over the group's "
                "active tokens, then averaged over the steps and the seeds). log w = log π_θ − log π_old; clipped: "
                "tokens in RPG-Style Clip's regions (RPG) or PPO's (the others); s_t = min(1, c/M_t): the sequence "
                "level's truncation factor.",
            )
        )
    if rows["kl_gradient"]:
        tables.append(format_gradients_table(rows["kl_gradient"], group_key, f"{GRADIENTS_CAPTION[:-1]}; {what}."))
    return tables, rows


def run_bench(args: BenchAlgosArguments) -> dict:
    """Run the chosen tables of the protocol, then write ``table.md``, ``results.json`` and the figures."""
    import json

    from ..toy.training import cpu_session
    from .protocol import job_pool

    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with cpu_session(args.num_threads), job_pool(args.num_workers) as pool:
        # Selection seeds only where a grid has more than one value to choose from.
        selects = ("algorithms" in args.tables and len(args.learning_rates) > 1) or (
            "kl" in args.tables and len(args.kl_betas) > 1
        )
        seeds = [*(args.selection_seeds if selects else []), *args.final_seeds]
        seeds += args.sweep_seeds if "kl_sweep" in args.tables else []
        sft_dirs = warm_starts(args, seeds, pool)
        report: dict = {"arguments": {**asdict(args), "final_seeds": args.final_seeds}}
        markdown = []
        if "algorithms" in args.tables:
            algorithms = run_algorithms_table(args, sft_dirs, pool)
            report["algorithms"] = {
                **algorithms,
                "table": {
                    regime: summarize([r for r in algorithms["runs"] if r["regime"] == regime], "algorithm", BASELINE)
                    for regime in args.regimes
                },
                "configurations": {name: {"trainer": kind, **o} for name, (kind, o) in ALGORITHMS.items()},
            }
            for regime in args.regimes:
                markdown.append(format_algorithms_table(report["algorithms"]["table"][regime], regime, args))
            if args.diagnostics:
                for regime in args.regimes:
                    regime_runs = [r for r in algorithms["runs"] if r["regime"] == regime]
                    tables, rows = diagnostics_tables(regime_runs, "algorithm", f"{regime} steps per generation")
                    markdown += tables
                    for name, value in rows.items():
                        report["algorithms"].setdefault(name, {})[regime] = value
            if algorithms["selection"]:
                markdown.append(
                    format_selection_table(algorithms["selection"], algorithms["chosen_learning_rates"], args)
                )
            if _can_plot():
                plot_algorithms(algorithms["runs"], str(output_dir / "bench_algos.png"), args)
        if "kl" in args.tables:
            from .bench_kl import format_kl_dynamics, format_kl_readings, format_kl_table, plot_kl, run_kl_table

            kl = run_kl_table(args, sft_dirs, pool)
            report["kl"] = kl
            markdown.append(format_kl_table(kl["table"], kl["chosen_beta"], args))
            markdown.append(format_kl_readings(args.kl_arms))
            markdown.append(format_kl_dynamics(kl["dynamics"], args))
            if args.diagnostics:
                tables, rows = diagnostics_tables(kl["runs"], "arm", "KL table")
                markdown += tables
                kl.update(rows)
            if _can_plot():
                plot_kl(kl["runs"], str(output_dir / "bench_kl.png"), args)
        if "kl_sweep" in args.tables:
            from .bench_kl import format_kl_sweep, run_kl_sweep

            sweep = run_kl_sweep(args, sft_dirs, pool)
            report["kl_sweep"] = sweep
            markdown.append(format_kl_sweep(sweep["table"], args))
            if args.diagnostics:
                cells = [
                    {**run, "cell": f"{run['arm']}, β {run['beta']:g}, lr {run['learning_rate']:g}"}
                    for run in sweep["runs"]
                ]
                tables, rows = diagnostics_tables(cells, "cell", "KL robustness sweep")
                markdown += tables
                sweep.update(rows)
        warm = [json.loads((Path(d) / "warm_start.json").read_text()) for d in sft_dirs.values()]
        report["warm_starts"] = {seed: w["report"] for seed, w in zip(sft_dirs, warm)}
        report["seconds"] = time.perf_counter() - start
        report["machine"] = machine()
    (output_dir / "table.md").write_text("\n".join(markdown))
    (output_dir / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def add_parser(subparsers):
    """Register ``rpg-trl bench-algos`` (see [`rpg_research.cli`])."""
    return add_bench_parser(
        subparsers,
        "bench-algos",
        BenchAlgosArguments,
        help="The paper's comparison in miniature on a protocol fixed in advance: GRPO, DAPO, REINFORCE++(-Baseline) "
        "and four RPG variants, each at its own best learning rate, and the KL estimators on a flawed proxy reward.",
        description="Choose each method's learning rate per regime (steps per generation) on selection seeds, run "
        "every method at it on fresh final seeds from shared warm starts, and report Last/Best/Gain and stability "
        "with 95%% intervals and paired differences to GRPO; then train the KL arms on a proxy reward with an "
        "exploitable flaw and report the true reward. Writes table.md, results.json, bench_algos.png, bench_kl.png.",
    )


def run(args) -> int:
    """Execute ``rpg-trl bench-algos`` with the parsed command-line `args`."""
    bench_args = dataclass_arguments(args, BenchAlgosArguments)
    report = run_bench(bench_args)
    written = f"{bench_args.output_dir}/table.md, results.json and the figures"
    print_report(bench_args.output_dir, report["seconds"], written)
    return 0
