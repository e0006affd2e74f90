"""A checkpoint names its model, and every message about checkpoints and the vLLM server is true (issue 73, items 4
and 5).

- The commit record (`rpg_checkpoint.json`) holds the identity of the model that wrote the checkpoint: its
  configuration without the keys that do not make another model, and the names and shapes of its parameters
  (`model_identity` in `rpg_trl/reliability/checkpoints.py`). A resume with another model, of the same shapes or of
  others, is refused with a `ValueError` that says so and what differs, before `transformers` loads a weight; a record
  without the identity (an earlier version's) resumes as before.
- The message of a run stopped by its vLLM server (or by a full disk) names the checkpoint that a resume would take,
  checked by the resume's own function, digests included.
- The health probe before each generation is bounded by the smaller of 10 s and `vllm_request_timeout`, and its error
  names the bound and the option.

The units build tiny Qwen3 models in memory; the end-to-end tests train the tiny Qwen3 for a step on CPU and resume
(docs/guarantees.md, "What survives a crash" and the vLLM server's entries).
"""

import ast
import errno
import hashlib
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rpg_trl
from rpg_trl.reliability import DiskFullError
from rpg_trl.reliability.checkpoints import (
    COMMIT_RECORD,
    begin_checkpoint,
    check_checkpoint_model,
    commit_checkpoint,
    disk_full_named,
    model_differences,
    model_identity,
    resolve_resume_checkpoint,
    saved_checkpoints_sentence,
)
from rpg_trl.reliability.vllm_server import (
    HEALTH_TIMEOUT,
    VLLMServerError,
    _unreachable_message,
    health_timeout,
    probe_server,
)
from rpg_trl.testing import build_char_tokenizer, save_tiny_model
from rpg_trl.testing.models import build_tiny_qwen3

from helpers.tiny_runs import make_trainer


def _tiny(**kwargs):
    return build_tiny_qwen3(build_char_tokenizer(), **kwargs)


def _shapes(model) -> dict:
    """Every parameter's name and shape, as `named_parameters` gives them (the bare model: no wrapper)."""
    return {name: "x".join(str(d) for d in param.shape) for name, param in model.named_parameters()}


def _committed_record(tmp_path, model) -> dict:
    """The commit record of a checkpoint whose writer's model is `model`."""
    checkpoint = _commit(tmp_path, 1, {"model.safetensors": b"w"}, model=model)
    with open(os.path.join(checkpoint, COMMIT_RECORD)) as f:
        return json.load(f)


def _commit(root, step, files, model=None):
    """A committed checkpoint-{step} of 1 process holding `files` (name -> bytes), its trainer's model `model`."""
    trainer = SimpleNamespace(
        args=SimpleNamespace(should_save=True, world_size=1, process_index=0, save_only_model=False),
        state=SimpleNamespace(global_step=step),
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None, unwrap_model=lambda m: m),
        model=model,
    )
    checkpoint = str(root / f"checkpoint-{step}")
    begin_checkpoint(trainer, checkpoint)
    for name, content in files.items():
        with open(os.path.join(checkpoint, name), "wb") as f:
            f.write(content)
    commit_checkpoint(trainer, checkpoint)
    return checkpoint


# ============================================================================================== the model's identity
def test_the_commit_record_holds_the_models_configuration_and_parameter_names_and_shapes(tmp_path):
    """The record's `"model"`: the configuration's `to_dict()` without the volatile keys, and every parameter's name
    and shape as `named_parameters` gives them, each with the sha256 of its JSON text (recomputed here); a trainer
    without a model records none."""
    model = _tiny()
    saved = _committed_record(tmp_path / "with", model)["model"]
    expected_config = json.loads(json.dumps(model.config.to_dict()))  # as JSON stores it (`id2label`'s keys: text)
    volatile = ["transformers_version", "_name_or_path", "architectures", "dtype", "use_cache", "return_dict"]
    for key in [*volatile, "output_attentions", "output_hidden_states"]:
        del expected_config[key]
    assert saved["config"] == expected_config
    assert saved["config"]["num_attention_heads"] == 4 and saved["config"]["rope_parameters"]["rope_theta"] == 1e4
    assert saved["parameters"] == _shapes(model)
    assert saved["parameters"]["model.embed_tokens.weight"] == f"{len(build_char_tokenizer())}x64"
    for part in ("config", "parameters"):
        text = json.dumps(saved[part], sort_keys=True, separators=(",", ":"))
        assert saved[f"{part}_digest"] == hashlib.sha256(text.encode()).hexdigest()
    assert "model" not in _committed_record(tmp_path / "without", None)


def test_the_same_model_loaded_again_or_in_another_precision_is_the_same_model(tmp_path):
    """What does not make another model is not a difference: the folder it was loaded from, the `transformers`
    version that wrote its config, its dtype, the cache switch, and a configuration key that one side lacks (a newer
    `transformers` adds keys to `to_dict()`)."""
    path = save_tiny_model(tmp_path / "tiny")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path)
    identity = model_identity(loaded)
    again = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    again.config.use_cache = False
    again.config.transformers_version = "9.99.0"
    again.config._name_or_path = "/elsewhere/copy"
    assert model_differences(identity, model_identity(again)) == []
    assert model_differences(identity, model_identity(_tiny())) == []  # built in memory: no `architectures` yet
    newer = json.loads(json.dumps(identity))
    newer["config"]["a_key_of_a_newer_transformers"] = True
    newer["config_digest"] = "another"
    assert model_differences(newer, identity) == []


def test_another_model_of_the_same_shapes_or_of_other_shapes_is_named_with_what_differs(tmp_path):
    """A configuration with other attention heads (the weights' shapes unchanged), another end-of-sequence token, and a
    model with another vocabulary (other shapes) each differ from the checkpoint's model, in words that name the keys,
    the values and the parameters."""
    checkpoint = _commit(tmp_path, 1, {"model.safetensors": b"w"}, model=_tiny())
    same = _tiny()
    check_checkpoint_model(checkpoint, model_identity(same))  # the same model: no error

    heads = _tiny()
    heads.config.num_attention_heads = 8  # same tensors, another function (each head half as wide)
    with pytest.raises(ValueError) as refused:
        check_checkpoint_model(checkpoint, model_identity(heads))
    assert str(refused.value).startswith(
        f"Cannot resume from {checkpoint}: the checkpoint belongs to another model than the one being trained (its "
        "configuration differs in 1 key(s) (num_attention_heads: 4 in the checkpoint, 8 here); from its commit record"
    )

    eos = _tiny()
    eos.config.eos_token_id = 2
    with pytest.raises(ValueError, match=r"another model .*\(eos_token_id: 1 in the checkpoint, 2 here\)"):
        check_checkpoint_model(checkpoint, model_identity(eos))

    wider = _tiny(vocab_size=40)
    differences = model_differences(model_identity(_tiny()), model_identity(wider))
    vocab = len(build_char_tokenizer())
    assert differences == [
        f"its configuration differs in 1 key(s) (vocab_size: {vocab} in the checkpoint, 40 here)",
        f"1 parameter(s) of another shape (model.embed_tokens.weight: {vocab}x64 in the checkpoint, 40x64 here)",
    ]

    deeper = _tiny(num_hidden_layers=3)
    (config, only_here) = model_differences(model_identity(_tiny()), model_identity(deeper))
    assert "num_hidden_layers: 2 in the checkpoint, 3 here" in config
    assert only_here.startswith("11 parameter(s) only in this model (model.layers.2.")  # a Qwen3 layer: 11 tensors


def test_a_peft_models_identity_covers_its_base_model_and_its_adapters():
    """With PEFT (the checkpoint's weights are the adapters alone) the identity holds the base model's configuration
    and every parameter, base and adapters: adapters of another rank, or a base model with another configuration,
    differ; the same set-up built again does not."""
    from peft import LoraConfig, get_peft_model

    def lora(rank=2, **model_kwargs):
        return get_peft_model(_tiny(**model_kwargs), LoraConfig(r=rank, target_modules=["q_proj"]))

    saved = model_identity(lora())
    assert saved["config"]["model_type"] == "qwen3"
    assert saved["parameters"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] == "2x64"
    assert model_differences(saved, model_identity(lora())) == []
    (rank,) = model_differences(saved, model_identity(lora(rank=4)))
    assert rank.startswith(
        "4 parameter(s) of another shape (base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight: "
        "2x64 in the checkpoint, 4x64 here"
    )
    base = lora()
    base.config.rms_norm_eps = 1e-5
    assert model_differences(saved, model_identity(base)) == [
        "its configuration differs in 1 key(s) (rms_norm_eps: 1e-06 in the checkpoint, 1e-05 here)"
    ]


def test_a_record_without_the_models_identity_is_not_held_against_the_model(tmp_path):
    """A commit record of an earlier version (no `"model"`) and a folder without a record (TRL's GRPOTrainer) are not
    checked: they resume as before."""
    checkpoint = _commit(tmp_path, 1, {"model.safetensors": b"w"}, model=_tiny())
    record_path = os.path.join(checkpoint, COMMIT_RECORD)
    with open(record_path) as f:
        record = json.load(f)
    del record["model"]
    with open(record_path, "w") as f:
        json.dump(record, f)
    check_checkpoint_model(checkpoint, model_identity(_tiny(vocab_size=40)))
    bare = tmp_path / "checkpoint-2"
    bare.mkdir()
    check_checkpoint_model(str(bare), model_identity(_tiny(vocab_size=40)))


def test_parameters_are_named_and_shaped_as_in_the_bare_model_under_wrappers():
    """FSDP's and activation checkpointing's module names are dropped from parameter names, a parameter that
    DeepSpeed ZeRO-3 partitions (an empty local tensor) has its full shape (`ds_shape`), and an FSDP1 `FlatParameter`
    stands for the parameters it holds (`_fqns`, `_shapes`): each stand-in names the bare model's parameters alike."""
    bare = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 5))
    expected = {"0.weight": "2x3", "0.bias": "2", "1.weight": "5x2", "1.bias": "5"}
    assert model_identity_parameters(bare) == expected

    class Wrapped(torch.nn.Module):  # FSDP1 with `use_orig_params=True` keeps names, inside its wrapper module
        def __init__(self, inner):
            super().__init__()
            self._fsdp_wrapped_module = inner

    zero3 = Wrapped(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 5)))
    for name, param in zero3.named_parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    assert model_identity_parameters(zero3) == expected

    flat = torch.nn.Module()
    flat._fsdp_wrapped_module = torch.nn.Module()
    flat_param = torch.nn.Parameter(torch.empty(6 + 2 + 10 + 5))
    flat_param._fqns = ("0.weight", "0.bias", "1.weight", "1.bias")
    flat_param._shapes = (torch.Size([2, 3]), torch.Size([2]), torch.Size([5, 2]), torch.Size([5]))
    flat._fsdp_wrapped_module._flat_param = flat_param
    assert model_identity_parameters(flat) == expected


def model_identity_parameters(module):
    """The parameters' part of the identity of a module given a configuration (any: only the parameters are read)."""
    module.config = _tiny().config
    return model_identity(module)["parameters"]


# ======================================================================================================= end to end
def test_a_resume_with_another_model_is_refused_before_transformers_loads_a_weight(tiny_model_dir, tmp_path):
    """A one-step RPGTrainer run commits checkpoint-1 with its model's identity. Resumed with a model of the same
    shapes but another configuration (another end-of-sequence token), the run is refused with an error that says the
    checkpoint belongs to another model (transformers alone would load the weights into it without a word); with a
    model of another vocabulary, the same error instead of `transformers`' size mismatch. Once the record has no
    identity (a record of an earlier version), the same-shape model resumes as before (the model that wrote a
    checkpoint resumes in every crash test of tests/test_guarantees.py)."""
    first = make_trainer(tiny_model_dir, tmp_path / "run", save_strategy="steps", save_steps=1, max_steps=1)
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    record = json.loads((checkpoint / COMMIT_RECORD).read_text())
    assert record["model"]["parameters"] == _shapes(first.model)

    other_eos = tmp_path / "other-eos"
    save_tiny_model(other_eos)
    config = json.loads((other_eos / "config.json").read_text())
    config["eos_token_id"] = 2
    (other_eos / "config.json").write_text(json.dumps(config))
    wider = save_tiny_model(tmp_path / "wider", vocab_size=40)
    for other, what in ((str(other_eos), r"eos_token_id: 1 in the checkpoint, 2 here"), (wider, r"40x64 here")):
        resumed = make_trainer(other, tmp_path / "run", save_strategy="no", max_steps=2)
        with pytest.raises(ValueError, match=rf"checkpoint-1: the checkpoint belongs to another model .*{what}"):
            resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 0

    del record["model"]
    (checkpoint / COMMIT_RECORD).write_text(json.dumps(record))
    legacy = make_trainer(str(other_eos), tmp_path / "run", save_strategy="no", max_steps=2)
    legacy.train(resume_from_checkpoint=True)
    assert [h["step"] for h in legacy.state.log_history if "loss" in h] == [1, 2]  # step 1 from the checkpoint


# ============================================================================================ every message is true
def _two_checkpoints_the_newer_damaged(tmp_path):
    """checkpoint-1 and checkpoint-2 committed; then 4 bytes of checkpoint-2's optimizer.pt changed, its size kept."""
    files = {"model.safetensors": b"weights", "optimizer.pt": b"optimizer state", "rng_state.pth": b"rng"}
    files["trainer_state.json"] = b"{}"
    one = _commit(tmp_path, 1, files)
    two = _commit(tmp_path, 2, files)
    path = os.path.join(two, "optimizer.pt")
    with open(path, "r+b") as f:
        f.write(b"OPTI")
    assert os.path.getsize(path) == len(files["optimizer.pt"])
    return one, two


def test_the_stop_message_names_the_checkpoint_that_a_resume_takes_after_same_size_damage(tmp_path):
    """After same-size damage to the newest checkpoint, the message of a run stopped by its vLLM server names the one
    before, which `resume_from_checkpoint=True` takes, not the damaged one (a size check passes both)."""
    one, two = _two_checkpoints_the_newer_damaged(tmp_path)
    assert resolve_resume_checkpoint(True, str(tmp_path)) == one
    sentence = saved_checkpoints_sentence(str(tmp_path))
    assert f"(the newest complete one: {one})" in sentence and two not in sentence
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), state=SimpleNamespace(global_step=3))
    assert _unreachable_message(trainer, "http://host:8000", ConnectionError("refused")).endswith(sentence)


def test_the_full_disk_message_names_the_checkpoint_that_a_resume_takes_after_same_size_damage(tmp_path):
    """The full-disk error says which checkpoint is intact: after same-size damage to checkpoint-2, checkpoint-1."""
    one, two = _two_checkpoints_the_newer_damaged(tmp_path)
    with pytest.raises(DiskFullError) as full:
        with disk_full_named(str(tmp_path / "checkpoint-3"), str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert f"the newest complete checkpoint, {one}, is intact" in str(full.value) and two not in str(full.value)


def test_the_health_probe_is_bounded_by_the_smaller_of_10_s_and_vllm_request_timeout():
    """The bound: `vllm_request_timeout` below 10 s, 10 s above it, when it is None, or when the config has none."""
    assert HEALTH_TIMEOUT == 10.0
    assert health_timeout(SimpleNamespace(vllm_request_timeout=0.5)) == 0.5
    assert health_timeout(SimpleNamespace(vllm_request_timeout=600)) == 10.0
    assert health_timeout(SimpleNamespace(vllm_request_timeout=None)) == 10.0
    assert health_timeout(SimpleNamespace()) == 10.0


@pytest.mark.slow  # a listening socket: a server, for the tiers
def test_a_health_probe_that_gets_no_answer_names_its_bound_and_vllm_request_timeout(tmp_path):
    """A server that accepts connections and never answers (a listening socket that nobody reads), probed with
    `vllm_request_timeout=0.5`: the probe gives up with `requests`' own read timeout of 0.5 s (the bound it was
    given), and the error names the server, the bound and the option; with the option at its default, 10 s is named
    as the smaller of the two."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        trainer = SimpleNamespace(
            args=SimpleNamespace(output_dir=str(tmp_path), vllm_request_timeout=0.5),
            state=SimpleNamespace(global_step=2),
        )
        with pytest.raises(VLLMServerError) as stopped:
            probe_server(trainer, url)
    message = str(stopped.value)
    assert message.startswith(f"The vLLM server at {url} stopped answering (ReadTimeout: ")
    assert "(read timeout=0.5)" in message  # requests' own words: the bound it was given
    assert (
        f"at training step 2; its health probe (`GET {url}/health`, bounded to 0.5 s: the smaller of 10 s and "
        "`vllm_request_timeout` = 0.5 s) failed. No complete checkpoint was saved"
    ) in message
    default = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path), vllm_request_timeout=600.0))
    default.state = SimpleNamespace(global_step=2)
    text = _unreachable_message(default, url, ConnectionError("refused"), probe_seconds=10.0)
    assert "bounded to 10 s: the smaller of 10 s and `vllm_request_timeout` = 600 s) failed" in text


# ======================================================================================== how checkpoint files load
class _Hostile:
    """An object whose unpickling runs code (`Path.touch` of a marker file), as a hostile checkpoint file would."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_every_torch_load_of_rpg_trl_passes_weights_only_true():
    """Each `torch.load` call in the package (found by parsing every module, not by grepping) passes
    `weights_only=True`, and no module unpickles with `pickle` (docs/guarantees.md, how checkpoint files load)."""
    root = Path(rpg_trl.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if (owner, node.func.attr) in (("pickle", "load"), ("pickle", "loads")):
                pytest.fail(f"{path}:{node.lineno} unpickles with pickle")
            if (owner, node.func.attr) == ("torch", "load"):
                keywords = {k.arg: k.value for k in node.keywords}
                flag = keywords.get("weights_only")
                calls.append((path.relative_to(root).as_posix(), isinstance(flag, ast.Constant) and flag.value))
    assert calls == [("reliability/generation_state.py", True)]


def test_a_hostile_generation_state_or_rng_file_runs_no_code_on_resume(tmp_path):
    """A `rpg_generation_state.pt` and a `rng_state.pth` whose unpickling would create a marker file: RPG's loader
    refuses the first (the resume falls back to a new generation batch, with a warning), `transformers`' RNG loader
    raises on the second, and in both cases no code ran (the marker does not exist)."""
    from transformers import Trainer

    from rpg_trl.reliability.generation_state import GENERATION_STATE_FILE, load_generation_state

    marker = tmp_path / "code-ran"
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    torch.save({"step": _Hostile(marker)}, checkpoint / GENERATION_STATE_FILE)
    torch.save({"python": _Hostile(marker)}, checkpoint / "rng_state.pth")
    trainer = SimpleNamespace(
        args=SimpleNamespace(process_index=0, world_size=1, gradient_accumulation_steps=1, steps_per_generation=2),
        state=SimpleNamespace(global_step=1),
        accelerator=SimpleNamespace(device="cpu"),
        num_iterations=1,
    )
    assert load_generation_state(trainer, str(checkpoint)) is False
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        Trainer._load_rng_state(trainer, str(checkpoint))
    assert not marker.exists()
