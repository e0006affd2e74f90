# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The vLLM server of a run in TRL's server mode (`use_vllm=True, vllm_mode="server"`): refused before training when it
serves another model, and named with its URL when it stops answering, within a bounded time.

TRL alone would push the weights of one architecture into another (a failed or silently wrong load) and, when the
server dies, retry for about a minute and then raise a bare `requests` error (or, for a failed request, `Request
failed: 500`); with several training processes the others would wait in a collective (TRL's main process talks to the
server alone and broadcasts its answer) until the launcher ends them, without a word of why. Here the main process
posts the failure in the process group's store before it raises, and every other process, whose watcher thread reads
it there, logs it as its own (server URL and cause) and exits with status 1 ([`watch_for_server_failure`]).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from transformers.utils import logging


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
#: Seconds the health probe before each generation waits for the server's answer.
HEALTH_TIMEOUT = 10.0
#: Key, in the store of the default process group, under which the main process posts a failure of the vLLM server
#: in the middle of a request (the message of its `VLLMServerError`).
FAILURE_KEY = "rpg_trl/vllm_server_failure"
#: Seconds between two looks of a watching process at that key.
WATCH_INTERVAL = 0.5
#: Seconds the main process waits, at most, for every other process to take note of the failure before it raises.
NOTICE_TIMEOUT = 10.0


class VLLMServerError(RuntimeError):
    """The vLLM server of a server-mode run is unreachable, failed a request, or serves another model."""


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


def check_server_model(trainer) -> None:
    """
    Refuse, before training, a vLLM server whose model has other weight shapes than the trainer's (vocabulary,
    architecture, sizes): its served model's configuration (read from the model id or folder it reports) is compared
    with the trainer's on [`SHAPE_FIELDS`]. Runs on the main process (the one that talks to the server); the decision is
    shared so that every process raises together. A server whose model configuration cannot be read here (e.g. a
    folder on another machine) is not checked, with a warning.
    """
    if not uses_vllm_server(trainer):
        return
    import warnings

    from accelerate.utils import broadcast_object_list

    message = None
    if trainer.accelerator.is_main_process:
        from transformers import AutoConfig

        url = _server_url(trainer)
        model_config = trainer.vllm_generation.vllm_client.get_server_info()["model_config"]
        served = model_config["model"]
        try:
            server_config = AutoConfig.from_pretrained(
                served, revision=model_config.get("revision"), trust_remote_code=model_config.get("trust_remote_code")
            )
        except Exception as exc:  # noqa: BLE001 - any failure to read it only means "cannot check"
            warnings.warn(
                f"The model of the vLLM server at {url} ({served!r}) could not be read here ({exc}); its vocabulary "
                "and architecture are not checked against the trainer's.",
                stacklevel=3,
            )
        else:
            model = trainer.accelerator.unwrap_model(trainer.model)
            diff = model_mismatch(model.config, server_config)
            if diff:
                listed = ", ".join(f"{name}: trainer {a!r}, server {b!r}" for name, (a, b) in diff.items())
                message = (
                    f"The vLLM server at {url} serves {served!r}, whose weights do not match the model being trained "
                    f"({listed}): the weight sync would fail or corrupt the server's model. Start the server with the "
                    "trained model (`trl vllm-serve --model <the trainer's model>`) or point `vllm_server_base_url` "
                    "at the right server."
                )
    message = _shared(trainer, message, broadcast_object_list)
    if message is not None:
        raise VLLMServerError(message)


def _shared(trainer, value, broadcast_object_list):
    if trainer.accelerator.num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def _unreachable_message(trainer, url, exc) -> str:
    return (
        f"The vLLM server at {url} stopped answering ({type(exc).__name__}: {exc}) at training step "
        f"{trainer.state.global_step}. Checkpoints already saved in {trainer.args.output_dir} are complete; restart the "
        "server and continue with `resume_from_checkpoint`."
    )


def probe_server(trainer, url: str) -> None:
    """Raise [`VLLMServerError`] naming `url` when the vLLM server there does not answer its health probe within
    [`HEALTH_TIMEOUT`] seconds (in this process only)."""
    import requests

    try:
        requests.get(f"{url}/health", timeout=HEALTH_TIMEOUT).raise_for_status()
    except requests.RequestException as exc:
        raise VLLMServerError(_unreachable_message(trainer, url, exc)) from exc


@contextlib.contextmanager
def server_errors_named(trainer, url: str | None = None):
    """
    Around one generation (weight sync included) of a server-mode run: a health probe of the server first (at most
    [`HEALTH_TIMEOUT`] seconds; the result shared by every process, which all raise together), and any error of the
    server's requests during the generation re-raised as [`VLLMServerError`] naming the server's URL. TRL's client
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
def _store():
    """A client of the default process group's store of its own (usable from a thread), or None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store().clone()
    except (AttributeError, RuntimeError, ValueError):  # a group without a store, or a store that cannot be cloned
        return None


def watch_for_server_failure(trainer, url: str | None = None) -> bool:
    """On every process but the main one of a multi-process server-mode run: start a daemon thread that waits for
    the main process to post, at [`FAILURE_KEY`] of the process group's store, that the vLLM server failed in the
    middle of a request ([`tell_other_processes`]), then logs that message (the server's URL and the cause) as this
    process's error and ends the process with exit status 1. Meanwhile this process waits for the server's answer in
    a collective that nothing else ends (TRL broadcasts the completions from the main process). `url`: the server of
    a trainer that is not in TRL's server mode (the asynchronous trainer's weight sync). Returns whether a watcher was
    started."""
    accelerator = trainer.accelerator
    if url is None and not uses_vllm_server(trainer):
        return False
    if accelerator.num_processes == 1 or accelerator.is_main_process:
        return False
    store = _store()
    if store is None:
        return False
    rank = accelerator.process_index
    try:
        store.add(f"{FAILURE_KEY}/watchers", 1)  # the main process waits for as many notes
    except Exception:  # noqa: BLE001 - a store that does not count: no watcher
        return False

    def watch():
        try:
            while not store.check([FAILURE_KEY]):
                time.sleep(WATCH_INTERVAL)
            message = store.get(FAILURE_KEY).decode()
        except Exception:  # noqa: BLE001 - the store is gone: the run has ended
            return
        logger.error(f"Process {rank} stops: {message}")
        sys.stderr.write(f"VLLMServerError on process {rank}: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        with contextlib.suppress(Exception):
            store.add(f"{FAILURE_KEY}/noted", 1)
        os._exit(1)

    threading.Thread(target=watch, name="rpg-trl-vllm-server-watch", daemon=True).start()
    return True


def tell_other_processes(trainer, message: str) -> None:
    """On the main process of a multi-process run: log `message` (a failure of the vLLM server in the middle of a
    request), post it for the other processes' watchers ([`watch_for_server_failure`]) and wait until each watcher has
    taken note of it, at most [`NOTICE_TIMEOUT`] seconds, so that every process names the failure before the launcher
    ends the job."""
    accelerator = trainer.accelerator
    if accelerator.num_processes == 1 or not accelerator.is_main_process:
        return
    store = _store()
    if store is None:
        return
    logger.error(message)
    try:
        store.set(FAILURE_KEY, message)
        watchers = store.add(f"{FAILURE_KEY}/watchers", 0)
        deadline = time.monotonic() + NOTICE_TIMEOUT
        while store.add(f"{FAILURE_KEY}/noted", 0) < watchers and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the others are told by the launcher then; the error is raised all the same
        return
