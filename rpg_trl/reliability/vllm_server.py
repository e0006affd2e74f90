# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The vLLM server of a run in TRL's server mode (`use_vllm=True, vllm_mode="server"`): refused before training when it
serves another model, and named with its URL when it stops answering, within a bounded time.

TRL alone would push the weights of one architecture into another (a failed or silently wrong load) and, when the
server dies, retry for about a minute and then raise a bare `requests` error (or, for a failed request, `Request
failed: 500`); with several training processes the others would wait in a collective (TRL's main process talks to the
server alone and broadcasts its answer) until the launcher ends them, without a word of why. Here the main process
posts the failure in the process group's store before it raises, and every other process, whose watcher thread reads
it there, logs it as its own (server URL and cause) and, once the main process has reported and ended, exits with
status 1 ([`watch_for_server_failure`], [`rpg_trl.reliability.process_failure`]). TRL's requests carry no timeout: a
server that accepts one and never answers would stall every process until the launcher's collective timeout; here each
request (generation, weight sync, cache reset) is bounded by `vllm_request_timeout` ([`bound_server_requests`]).
"""

from __future__ import annotations

import contextlib
import functools
import threading

from transformers.utils import logging

from .checkpoints import saved_checkpoints_sentence
from .process_failure import FailureWatcher, check_seconds, deadline, failure_key, tell_other_processes


logger = logging.get_logger(__name__)


#: The configuration fields that fix the shapes and names of the weights a trainer pushes to the server.
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
#: Seconds, at most, that the health probe before each generation waits for the server's answer: the bound is the
#: smaller of this and `vllm_request_timeout` ([`health_timeout`]).
HEALTH_TIMEOUT = 10.0
#: Seconds, by default, that one request of a server-mode run to the vLLM server (a generation batch, a weight sync, a
#: cache reset) may take before the run stops naming it (the config field `vllm_request_timeout`).
REQUEST_TIMEOUT = 600.0
#: The client's methods that are bounded, by the request they make: the name in the error, and whether the trainer's
#: main thread can leave the call (a generation or a cache reset is HTTP alone, run in a thread of its own that the
#: main thread stops waiting for; a weight sync also broadcasts the weights in the main thread over a communicator,
#: which no Python code can interrupt: past the bound the process ends, as a `weight_sync_timeout` does).
BOUNDED_REQUESTS = {
    "generate": ("generation", True),
    "chat": ("generation", True),
    "image_features": ("generation", True),
    "update_named_params": ("weight sync", False),
    "reset_prefix_cache": ("cache reset", True),
}


class VLLMServerError(RuntimeError):
    """The vLLM server of a server-mode run is unreachable, failed a request, did not answer one in time
    (`vllm_request_timeout`), or serves another model."""


def check_request_timeout(timeout, name: str = "vllm_request_timeout") -> None:
    """Raise a `ValueError` naming `name` unless `timeout` is None or a finite number of seconds > 0."""
    check_seconds(name, timeout, REQUEST_TIMEOUT, allow_none=True)


def uses_vllm_server(trainer) -> bool:
    args = trainer.args
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "server"


def _server_url(trainer) -> str:
    client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)
    if client is not None:
        return client.base_url
    args = trainer.args
    return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def _shape_fields(config) -> dict:
    config = getattr(config, "text_config", None) or config  # multimodal configs keep the decoder's fields apart
    fields = {name: getattr(config, name, None) for name in SHAPE_FIELDS}
    if fields["head_dim"] is None and fields["hidden_size"] and fields["num_attention_heads"]:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return fields


def model_mismatch(trainer_config, server_config) -> dict:
    """`{field: (trainer's, server's)}` for the [`SHAPE_FIELDS`] (and `architectures`) that differ."""
    ours, theirs = _shape_fields(trainer_config), _shape_fields(server_config)
    diff = {name: (ours[name], theirs[name]) for name in SHAPE_FIELDS if ours[name] != theirs[name]}
    ours_arch, theirs_arch = (
        getattr(trainer_config, "architectures", None),
        getattr(server_config, "architectures", None),
    )
    if ours_arch and theirs_arch and list(ours_arch) != list(theirs_arch):
        diff["architectures"] = (list(ours_arch), list(theirs_arch))
    return diff


def served_model_config(client) -> dict | None:
    """
    The `model_config` of the vLLM server that `client` (TRL's `VLLMClient`) talks to, as a JSON tree: from
    `client.get_server_info()` (TRL 1.16), else from the endpoint that method reads, vLLM's own `GET /server_info` in
    its JSON form (the clients of TRL 1.14 and 1.15 lack the method; the server is vLLM's in every release of the
    window, `trl vllm-serve` starting it with its development endpoints, `VLLM_SERVER_DEV_MODE=1`). `None` when the
    server does not answer that endpoint with a configuration (started without the development endpoints, or a vLLM
    whose `/server_info` is not JSON): nothing tells then which model it serves.
    """
    get_server_info = getattr(client, "get_server_info", None)
    if get_server_info is not None:
        return get_server_info()["model_config"]
    response = client.session.get(f"{client.base_url}/server_info", params={"config_format": "json"})
    if response.status_code != 200:
        return None
    try:
        model_config = response.json()["vllm_config"]["model_config"]
    except (ValueError, KeyError, TypeError):  # not JSON, or an older vLLM's configuration as one string
        return None
    return model_config if isinstance(model_config, dict) else None


def check_server_model(trainer) -> None:
    """
    Refuse, before training, a vLLM server whose model has other weight shapes than the trainer's (vocabulary,
    architecture, sizes): its served model's configuration (read from the model id or folder it reports) is compared
    with the trainer's on [`SHAPE_FIELDS`]. Runs on the main process (the one that talks to the server); the decision is
    shared so that every process raises together. A server whose model configuration cannot be read here (e.g. a
    folder on another machine), or that does not report it ([`served_model_config`]), is not checked, with a warning.
    """
    if not uses_vllm_server(trainer):
        return
    import warnings

    from accelerate.utils import broadcast_object_list

    message = None
    if trainer.accelerator.is_main_process:
        url = _server_url(trainer)
        model_config = served_model_config(trainer.vllm_generation.vllm_client)
        if model_config is None:
            warnings.warn(
                f"The vLLM server at {url} does not report its model configuration (vLLM's `GET /server_info` in JSON "
                "form, a development endpoint: start it with `trl vllm-serve`, or with `VLLM_SERVER_DEV_MODE=1`); its "
                "vocabulary and architecture are not checked against the trainer's.",
                stacklevel=3,
            )
        else:
            message = _model_mismatch_message(trainer, url, model_config)
    message = _shared(trainer, message, broadcast_object_list)
    if message is not None:
        raise VLLMServerError(message)


def _model_mismatch_message(trainer, url, model_config) -> str | None:
    """Why the server's model (its `model_config`) cannot take the trainer's weights; `None` when it can, or, with a
    warning, when its configuration cannot be read here."""
    import warnings

    from transformers import AutoConfig

    served = model_config["model"]
    try:
        server_config = AutoConfig.from_pretrained(
            served, revision=model_config.get("revision"), trust_remote_code=model_config.get("trust_remote_code")
        )
    except Exception as exc:  # noqa: BLE001 - any failure to read it only means "cannot check"
        warnings.warn(
            f"The model of the vLLM server at {url} ({served!r}) could not be read here ({exc}); its vocabulary "
            "and architecture are not checked against the trainer's.",
            stacklevel=4,
        )
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    diff = model_mismatch(model.config, server_config)
    if not diff:
        return None
    listed = ", ".join(f"{name}: trainer {a!r}, server {b!r}" for name, (a, b) in diff.items())
    return (
        f"The vLLM server at {url} serves {served!r}, whose weights do not match the model being trained "
        f"({listed}): the weight sync would fail or corrupt the server's model. Start the server with the "
        "trained model (`trl vllm-serve --model <the trainer's model>`) or point `vllm_server_base_url` "
        "at the right server."
    )


def _shared(trainer, value, broadcast_object_list):
    if trainer.accelerator.num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def health_timeout(args) -> float:
    """Seconds the health probe waits for the server's answer: the smaller of [`HEALTH_TIMEOUT`] and
    `args.vllm_request_timeout` (when set). A healthy vLLM server answers `/health` from its HTTP front in
    milliseconds, so 10 s is already a wide margin; following `vllm_request_timeout` (600 s by default) exactly would
    let a server that accepts connections and never answers hold each generation ten minutes before the probe names
    it, while a bound above a small `vllm_request_timeout` (e.g. 5 s) would let the probe outlast the bound the user
    set on every request."""
    seconds = getattr(args, "vllm_request_timeout", None)
    return HEALTH_TIMEOUT if seconds is None else min(HEALTH_TIMEOUT, float(seconds))


def _health_bound_words(args) -> str:
    """How the health probe's bound was chosen ([`health_timeout`]), naming the option, for its error message."""
    if not hasattr(args, "vllm_request_timeout"):
        return f"the probe's own {HEALTH_TIMEOUT:g} s; this trainer's config has no `vllm_request_timeout`"
    option = args.vllm_request_timeout
    if option is None:
        return f"the probe's own {HEALTH_TIMEOUT:g} s, as `vllm_request_timeout` is None (unbounded requests)"
    return f"the smaller of {HEALTH_TIMEOUT:g} s and `vllm_request_timeout` = {float(option):g} s"


def _unreachable_message(trainer, url, exc, probe_seconds: float | None = None) -> str:
    """Why the run stops: the server at `url` failed a request with `exc` (with `probe_seconds`: its health probe,
    whose bound, and the option it follows, the message names), and the checkpoints saved."""
    probe = ""
    if probe_seconds is not None:
        probe = (
            f"; its health probe (`GET {url}/health`, bounded to {probe_seconds:g} s: "
            f"{_health_bound_words(trainer.args)}) failed"
        )
    return (
        f"The vLLM server at {url} stopped answering ({type(exc).__name__}: {exc}) at training step "
        f"{trainer.state.global_step}{probe}. {saved_checkpoints_sentence(trainer.args.output_dir)}"
    )


def probe_server(trainer, url: str) -> None:
    """Raise [`VLLMServerError`] naming `url` when the vLLM server there does not answer its health probe within
    [`health_timeout`] seconds (the smaller of [`HEALTH_TIMEOUT`] and `vllm_request_timeout`; in this process only);
    the message names the bound and the option."""
    import requests

    seconds = health_timeout(trainer.args)
    try:
        requests.get(f"{url}/health", timeout=seconds).raise_for_status()
    except requests.RequestException as exc:
        raise VLLMServerError(_unreachable_message(trainer, url, exc, probe_seconds=seconds)) from exc


class ProbeWhileWaiting:
    """A rollout worker's health check (`check_health(stale_after_s)`, which TRL's asynchronous trainer runs every few
    seconds while it waits on an empty rollout queue), followed by a probe of the vLLM server at `url`: a dead server is
    named at once ([`VLLMServerError`]) instead of after the worker has exhausted its retries. The main process alone
    waits on the queue (the others wait for its batch in a collective): a failure of either check is posted for them
    ([`tell_other_processes`]) before it is raised, so every process stops naming it."""

    def __init__(self, check_health, trainer, url: str):
        self.check_health, self.trainer, self.url = check_health, trainer, url

    def __call__(self, stale_after_s: float) -> None:
        try:
            self.check_health(stale_after_s)
            probe_server(self.trainer, self.url)
        except Exception as exc:
            message = str(exc) if isinstance(exc, VLLMServerError) else f"{type(exc).__name__}: {exc}"
            tell_other_processes(self.trainer, message)
            raise


def weight_sync_deadline(trainer, url: str, seconds: float):
    """Around a weight sync of the main process to the vLLM server at `url` (TRL's transfer can hang rather than raise
    when the server dies in the middle of it, and its requests carry no timeout): past `seconds`, the sync is named as
    a [`VLLMServerError`] on every process and the run ends ([`~rpg_trl.reliability.process_failure.deadline`])."""
    step = trainer.state.global_step

    def message() -> str:  # when the deadline passes: the checkpoints saved by then
        return (
            f"The weight sync to the vLLM server at {url} did not finish within {seconds:g} s (`weight_sync_timeout`) "
            f"at training step {step}: the server may have died in the middle of the transfer. "
            + saved_checkpoints_sentence(trainer.args.output_dir)
        )

    return deadline(trainer, seconds, message, VLLMServerError.__name__)


def _hung_request_message(trainer, url: str, request: str, seconds: float, step: int) -> str:
    return (
        f"The vLLM server at {url} did not answer the {request} request within {seconds:g} s "
        f"(`vllm_request_timeout`) at training step {step}: the server hangs or is overloaded. Restart it, or raise "
        f"`vllm_request_timeout` if its {request}s take longer. " + saved_checkpoints_sentence(trainer.args.output_dir)
    )


def _bounded(trainer, url: str, request: str, seconds: float, interruptible: bool, call):
    """`call` (a method of the main process's vLLM client) bounded to `seconds` (see [`bound_server_requests`])."""

    @functools.wraps(call)
    def bounded(*args, **kwargs):
        step = trainer.state.global_step
        if not interruptible:
            with deadline(
                trainer,
                seconds,
                lambda: _hung_request_message(trainer, url, request, seconds, step),
                VLLMServerError.__name__,
            ):
                return call(*args, **kwargs)
        outcome, done = {}, threading.Event()

        def run():
            try:
                outcome["value"] = call(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread as it is
                outcome["error"] = exc
            finally:
                done.set()

        # A daemon thread: one still waiting for a hung server does not hold the process at exit.
        threading.Thread(target=run, name=f"rpg-trl-vllm-{request.replace(' ', '-')}", daemon=True).start()
        if not done.wait(seconds):
            error = VLLMServerError(_hung_request_message(trainer, url, request, seconds, step))
            tell_other_processes(trainer, str(error))
            raise error
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    bounded.__rpg_bounded__ = True
    return bounded


def bound_server_requests(trainer) -> bool:
    """
    As the trainer is built, on the main process of a server-mode run (the one that holds TRL's `VLLMClient`): every
    request of the client to the server is bounded to `vllm_request_timeout` seconds (None: unbounded; TRL's requests
    carry no timeout, so a server that accepts a request and never answers would stall every process until the
    launcher's collective timeout, 30 min by default). Past the bound the run stops with a [`VLLMServerError`] naming the
    server's URL, the request ([`BOUNDED_REQUESTS`]: generation, weight sync or cache reset), the bound and the option,
    on every process ([`tell_other_processes`]; the other processes' watchers end them). A generation or a cache reset
    is raised in the main process (its `finally` blocks and `atexit` handlers run); a weight sync, whose broadcast no
    Python code can interrupt, ends the main process with status 1 after writing the error on stderr
    ([`~rpg_trl.reliability.process_failure.deadline`]). Returns whether the client's requests are bounded.
    """
    seconds = getattr(trainer.args, "vllm_request_timeout", REQUEST_TIMEOUT)
    client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)
    if seconds is None or client is None or not uses_vllm_server(trainer):
        return False
    url = _server_url(trainer)
    for method, (request, interruptible) in BOUNDED_REQUESTS.items():
        call = getattr(client, method, None)
        if call is not None and not getattr(call, "__rpg_bounded__", False):
            setattr(client, method, _bounded(trainer, url, request, float(seconds), interruptible, call))
    return True


@contextlib.contextmanager
def server_errors_named(trainer, url: str | None = None):
    """
    Around one generation (weight sync included) of a server-mode run: a health probe of the server first (at most
    [`health_timeout`] seconds: the smaller of [`HEALTH_TIMEOUT`] and `vllm_request_timeout`; the result shared by
    every process, which all raise together), and any error of the server's requests during the generation re-raised
    as [`VLLMServerError`] naming the server's URL. TRL's client
    retries a refused connection about a minute before it gives up, which bounds the time to the error when the server
    dies in the middle of a request. `url`: the server of a trainer that is not in TRL's server mode (the asynchronous
    trainer's weight sync); by default the server-mode run's, and nothing is done outside server mode.
    """
    if url is None and not uses_vllm_server(trainer):
        yield
        return
    import requests
    from accelerate.utils import broadcast_object_list

    url = url or _server_url(trainer)
    message = None
    if trainer.accelerator.is_main_process:
        try:
            probe_server(trainer, url)
        except VLLMServerError as exc:
            message = str(exc)
    message = _shared(trainer, message, broadcast_object_list)
    if message is not None:
        raise VLLMServerError(message)
    try:
        yield
    except requests.RequestException as exc:
        error = VLLMServerError(_unreachable_message(trainer, url, exc))
        tell_other_processes(trainer, str(error))
        raise error from exc
    except Exception as exc:
        # TRL's client reports a non-200 answer as `Exception("Request failed: <status>, <body>")`.
        if type(exc) is Exception and str(exc).startswith("Request failed"):
            error = VLLMServerError(f"The vLLM server at {url} failed a request: {exc}")
            tell_other_processes(trainer, str(error))
            raise error from exc
        raise


# ------------------------------------------------------------------------------- every process learns of a failure
def watch_for_server_failure(trainer, url: str | None = None) -> bool:
    """As the trainer is built, on every process: number the trainer's failure record
    ([`~rpg_trl.reliability.process_failure.failure_key`]) and, on every process but the main one of a multi-process
    server-mode run, start a [`~rpg_trl.reliability.process_failure.FailureWatcher`]: when the main process posts that
    the vLLM server failed ([`tell_other_processes`]), this process logs that message (the server's URL and the cause)
    as its own error, waits for the main process to report and end, and then ends with status 1. Meanwhile it waits for
    the server's answer in a collective that nothing else ends (TRL broadcasts the completions from the main process).
    The trainers run the watcher during `train()`, `evaluate()` and `predict()` and stop and join it when the outermost
    of them ends. `url`: the server of a trainer that is not in TRL's
    server mode (the asynchronous trainer's weight sync). Returns whether a watcher was started."""
    accelerator = trainer.accelerator
    if url is None and not uses_vllm_server(trainer):
        return False
    failure_key(trainer)
    if accelerator.num_processes == 1 or accelerator.is_main_process:
        return False
    watcher = FailureWatcher(trainer, f"the vLLM server at {url or _server_url(trainer)}", VLLMServerError.__name__)
    trainer._rpg_failure_watcher = watcher
    return watcher.start()
