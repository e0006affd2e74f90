# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The configuration fields of the reliability checks ([`ReliabilityArguments`]), beside the modules they configure.

Shared by [`~rpg_trl.RPGConfig`] and the asynchronous trainer's configuration ([`~rpg_trl.async_rpg.AsyncRPGConfig`]),
whose trainers both honour them: the importance-weight warning ([`importance_weights`]), the KL-drift warning
([`kl_drift`]), the wait of the other processes for a failed main process ([`process_failure`]) and the bound on each
request to the vLLM server ([`vllm_server`]). Each field is checked by the module that uses it, with a `ValueError`
naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import importance_weights, kl_drift, process_failure, vllm_server
from .kl_drift import KL_FLOOR
from .process_failure import MAIN_EXIT_TIMEOUT
from .vllm_server import REQUEST_TIMEOUT


@dataclass
class ReliabilityArguments:
    """The settings of RPG's reliability checks that both RPG trainers honour (docs: *Guarantees*), as a mixin of the
    configuration; [`check_reliability_arguments`] validates them.

    `reward_timeout` is not here: the reward guard that honours it ([`reward_guard`]) runs in [`~rpg_trl.RPGTrainer`]
    only (the asynchronous trainer scores rewards in TRL's rollout worker), so it is a field of [`~rpg_trl.RPGConfig`]
    alone.
    """

    # Exploding importance weights (`rpg_trl.reliability.importance_weights`).
    importance_weight_warning_threshold: float | None = field(
        default=100.0,
        metadata={
            "help": "Warn (at most once every 100 optimizer steps) when the largest importance weight π_θ/π_old of a "
            "logging interval exceeds this value: the policy has diverged from the policy that sampled the batch. "
            "Default 100 (log-ratio ≈ 4.6, far beyond the clip bounds 1 + epsilon_high and clip_c = 10). None: never "
            "warn."
        },
    )
    # A reference model that stops holding the policy (`rpg_trl.reliability.kl_drift`).
    kl_drift_warning: bool = field(
        default=True,
        metadata={
            "help": "With a reference model (kl_anchor='reference', beta > 0), warn once (KLDriftWarning) when the KL to "
            "it stops holding the policy: the KL at least doubling twice in a row, or weights beyond 10 × clip_c twice "
            "while it doubles (rpg_trl.reliability.kl_drift). A reference sync starts the watch again. False: never "
            "warn."
        },
    )
    kl_drift_min_kl: float = field(
        default=KL_FLOOR,
        metadata={
            "help": "The KL-drift warning's floor: no warning while the KL to the reference (mean per token over a "
            f"period) is below this value, whatever its growth. Default {KL_FLOOR}."
        },
    )
    # A failure of the main process in a multi-process run (`rpg_trl.reliability.process_failure`).
    main_process_exit_timeout: float = field(
        default=MAIN_EXIT_TIMEOUT,
        metadata={
            "help": "Multi-process runs: seconds that the other processes, once the main process has reported a failure "
            "(e.g. of the vLLM server), wait for it to end before they end themselves; the launcher then ends the "
            "main process, cutting short its cleanup (`finally` blocks, trackers, `atexit` handlers) and possibly "
            f"its traceback. Default {MAIN_EXIT_TIMEOUT:g} (rpg_trl.reliability.process_failure); raise it when the "
            "main process needs longer to clean up (e.g. a tracker that uploads on exit)."
        },
    )
    # vLLM server mode (`rpg_trl.reliability.vllm_server`).
    vllm_request_timeout: float | None = field(
        default=REQUEST_TIMEOUT,
        metadata={
            "help": "vLLM server mode: seconds that one request to the server (a generation batch, a weight sync, a "
            "prefix-cache reset) may take before the run stops on every process with a VLLMServerError naming the "
            "server's URL, the request and this option (TRL's requests have no timeout: a server that accepts a "
            "request and never answers would stall every process until the collective timeout, `ddp_timeout`, 30 min "
            f"by default). Default {REQUEST_TIMEOUT:g}: a generation batch of a few hundred prompts × thousands of "
            "tokens takes minutes on a loaded server, and 10 min leaves it a wide margin while a hang is still named "
            "well before `ddp_timeout`; raise it for longer batches. None: no bound. Not TRL's `vllm_server_timeout`, "
            "which bounds the wait for the server at start-up."
        },
    )

    def check_reliability_arguments(self) -> None:
        """Validate the reliability fields, each by the module that uses it (`ValueError` naming the field)."""
        importance_weights.check_warning_threshold(self.importance_weight_warning_threshold)
        kl_drift.check_settings(self.kl_drift_warning, self.kl_drift_min_kl)
        process_failure.check_exit_timeout(self.main_process_exit_timeout)
        vllm_server.check_request_timeout(self.vllm_request_timeout)


__all__ = ["ReliabilityArguments"]
