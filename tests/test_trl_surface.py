# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""TRL's private surface (the table of tests/helpers/trl_surface.py): every private TRL/transformers name the library relies on is where the
table says in the installed TRL (its entries for that release: the library supports a window of TRL releases), the
check reports each kind of move, and the table is complete (every private name of TRL's trainers that the library
touches, and every batch key it reads, is listed). After a TRL upgrade, the first test lists what moved
(docs/design.md, "Bumping TRL"). Also: the asynchronous trainer's refusal of a TRL older than it needs."""

import ast
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

import pytest

from rpg_trl import trl_release
from rpg_trl.trl_release import ASYNC_TRL, TRL_WINDOW, in_trl_window, installed_trl_release

from helpers.trl_release import async_trl_missing, needs_async_trl
from helpers.trl_surface import ASYNC_GRPO, GRPO, PRIVATE_SURFACE, PrivateName, check_private_surface


PACKAGE = Path(__file__).resolve().parent.parent / "rpg_trl"
#: Names of the dicts that hold a batch in the library's code.
BATCH_NAMES = {"inputs", "batch", "generation_batch"}


def _library_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_installed_trl_has_every_private_name_the_library_relies_on():
    problems = check_private_surface()
    assert problems == [], "TRL's private surface moved (docs/design.md, 'Bumping TRL'):\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "entry, expected",
    [
        (PrivateName(GRPO, "_no_such_method", "call", ("m",), ("x",)), "no such method"),
        (PrivateName(GRPO, "_compute_loss", "override", ("m",), ("model",)), "parameters ('model', 'inputs')"),
        (PrivateName(GRPO, "_no_such_state", "state", ("m",)), "no longer sets self._no_such_state"),
        (PrivateName(GRPO, "_no_such_attribute", "class attribute", ("m",)), "no such class attribute"),
        (PrivateName(f"{GRPO}._compute_loss", "no_such_key", "batch key", ("m",)), "no longer in the source"),
        (PrivateName(GRPO, "__init__", "behaviour", ("m",), ("if self.gamma == 0.0:",)), "no longer contains"),
        (PrivateName("trl.NoSuchTrainer", "_x", "call", ("m",)), "is gone"),
        (PrivateName(GRPO, "_metrics", "attribute", ("m",)), "unknown kind"),
    ],
    ids=[
        "missing method",
        "changed parameters",
        "state",
        "class attribute",
        "batch key",
        "behaviour",
        "owner",
        "kind",
    ],
)
def test_the_check_reports_each_kind_of_move(entry, expected):
    problems = check_private_surface([entry])
    assert len(problems) == 1 and expected in problems[0], problems


def _trl_private_names() -> set[str]:
    """The private names of TRL's two trainers and their bases: methods and class attributes, and every instance
    attribute their sources assign (``self._x = ...``)."""
    import trl

    if not async_trl_missing():  # TRL 1.14 and 1.15: the library's asynchronous trainer is not there (ASYNC_TRL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # trl.experimental warns on import
            from trl.experimental.async_grpo import AsyncGRPOTrainer

    names = set()
    trainers = (trl.GRPOTrainer,) if async_trl_missing() else (trl.GRPOTrainer, AsyncGRPOTrainer)
    for cls in trainers:
        for base in cls.__mro__:
            if base.__module__.split(".")[0] not in ("trl", "transformers"):
                continue
            names.update(n for n in vars(base) if n.startswith("_") and not n.startswith("__"))
            names.update(re.findall(r"self\.(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(base)))
    return names


def _library_private_names() -> dict[str, set[str]]:
    """Private name -> library modules that define it as a method, assign it, or read it on `self`, `trainer`,
    `self.trainer`, `super()` or `type(self)`."""
    found: dict[str, set[str]] = {}
    owners = {"self", "trainer", "self.trainer", "super()", "type(self)"}
    for path in _library_files():
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign)):
                        targets = (
                            [item.name] if not isinstance(item, ast.Assign) else [ast.unparse(t) for t in item.targets]
                        )
                        for name in targets:
                            found.setdefault(name, set()).add(module)
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in owners:
                found.setdefault(node.attr, set()).add(module)
    return {n: m for n, m in found.items() if n.startswith("_") and not n.startswith("__")}


def test_the_table_lists_every_private_trl_name_the_library_touches():
    trl_names = _trl_private_names()
    assert {"_compute_loss", "_metrics", "_buffered_inputs", "_save_checkpoint"} <= trl_names
    assert async_trl_missing() or "_step_forward_s" in trl_names
    listed = {e.name for e in PRIVATE_SURFACE if e.kind != "batch key"}
    touched = _library_private_names()
    missing = {name: sorted(modules) for name, modules in touched.items() if name in trl_names and name not in listed}
    assert missing == {}, "private TRL/transformers names used but not in helpers.trl_surface.PRIVATE_SURFACE"
    stale = sorted(name for name in listed - set(touched) if name.startswith("_") and name != "__init__")
    assert stale == [], "names in PRIVATE_SURFACE that the library no longer uses"


def test_each_entry_names_the_modules_that_use_it():
    for entry in PRIVATE_SURFACE:
        # A behaviour of TRL's __init__ is relied on by a trainer that builds its parent in its own __init__.
        name = "def __init__" if entry.kind == "behaviour" else entry.name
        for module in entry.used_in:
            path = PACKAGE / module
            files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
            assert files and any(name in f.read_text() for f in files), (entry.owner, entry.name, module)


def _reads_batch(node, variable: str) -> bool:
    """Whether `node` is ``inputs[variable]`` (or another batch name)."""
    return (
        isinstance(node, ast.Subscript)
        and ast.unparse(node.value) in BATCH_NAMES
        and isinstance(node.slice, ast.Name)
        and node.slice.id == variable
    )


def _batch_keys_read() -> dict[str, set[str]]:
    """Key -> library modules that read it from a batch (``inputs["k"]``, ``inputs.get("k")``, ``batch["k"]``, and
    ``inputs[key] for key in ("k", ...)``)."""
    found: dict[str, set[str]] = {}
    for path in _library_files():
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            keys = []
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                if ast.unparse(node.value) in BATCH_NAMES and isinstance(node.slice, ast.Constant):
                    keys.append(node.slice.value)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
                if ast.unparse(node.func.value) in BATCH_NAMES and isinstance(node.args[0], ast.Constant):
                    keys.append(node.args[0].value)
            elif isinstance(node, (ast.For, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                loops = [node] if isinstance(node, ast.For) else node.generators
                for loop in loops:  # `for key in ("a", "b")` feeding `inputs[key]`
                    if not (isinstance(loop.iter, ast.Tuple) and isinstance(loop.target, ast.Name)):
                        continue
                    if not all(isinstance(e, ast.Constant) for e in loop.iter.elts):
                        continue
                    if any(_reads_batch(sub, loop.target.id) for sub in ast.walk(node)):
                        keys.extend(e.value for e in loop.iter.elts)
            for key in keys:
                if isinstance(key, str):
                    found.setdefault(key, set()).add(module)
    return found


def test_the_table_lists_every_batch_key_the_library_reads():
    keys = _batch_keys_read()
    assert {"old_per_token_logps", "importance_sampling_ratio", "token_index", "shift_labels"} <= set(keys)
    listed = {e.name for e in PRIVATE_SURFACE if e.kind == "batch key"}
    missing = {k: sorted(m) for k, m in keys.items() if k not in listed}  # every key the library reads is TRL's
    assert missing == {}, "batch keys read but not in helpers.trl_surface.PRIVATE_SURFACE"


@needs_async_trl
def test_the_async_keys_are_the_ones_of_trls_packed_stream():
    """The packed-stream keys are those AsyncGRPOTrainer declares as its signature columns (independent of the table's
    source check, which reads compute_loss)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.async_grpo import AsyncGRPOTrainer

    source = inspect.getsource(AsyncGRPOTrainer._set_signature_columns_if_needed)
    declared = set(re.findall(r'"(\w+)"', source))
    table = {e.name for e in PRIVATE_SURFACE if e.kind == "batch key" and e.owner.startswith(ASYNC_GRPO)}
    assert "tree_kv_index" in table and table <= declared


def test_the_tables_window_is_setup_cfgs_and_holds_the_installed_trl():
    """`TRL_WINDOW` is the TRL requirement of setup.cfg: widening the window comes with a revision of the table. The
    installed TRL is one of its releases (the CI environments run its newest, .ci/run, and its oldest, .ci/trl_floor)."""
    setup = (PACKAGE.parent / "setup.cfg").read_text()
    assert re.search(r"^\s*trl(\S+)\s*$", setup, re.M).group(1) == TRL_WINDOW
    assert in_trl_window(installed_trl_release())


#: Releases of the window, its oldest and newest among them (`pip index versions trl`; checked against the window below).
WINDOW_RELEASES = ("1.14.2", "1.15.0", "1.16.0")


def test_each_release_of_the_window_has_one_description_of_each_method():
    """Per release, the entries that hold describe each method the library overrides or calls once (with the
    parameters of that release); the asynchronous trainer's entries hold from ASYNC_TRL on, and only they and the
    `_get_per_token_logps_and_entropies` of TRL 1.14 (which passes its arguments on with `*args, **kwargs`), and the
    fused LM head's behaviour that kl_estimate="vocabulary" relies on (TRL 1.16 on), are limited to some releases."""
    assert [in_trl_window(r) for r in WINDOW_RELEASES] == [True] * 3
    assert not in_trl_window("1.14.1") and not in_trl_window("1.17.0") and in_trl_window("1.16.1")
    for release in WINDOW_RELEASES:
        methods = [
            (e.owner, e.name) for e in PRIVATE_SURFACE if e.kind in ("override", "call") and e.holds_for(release)
        ]
        assert len(methods) == len(set(methods)), release
        logps = [
            e
            for e in PRIVATE_SURFACE
            if e.name == "_get_per_token_logps_and_entropies"
            and e.kind in ("override", "call")
            and e.holds_for(release)
        ]
        assert [e.signature[1] for e in logps] == ["args" if release == "1.14.2" else "input_ids"], release
    for entry in PRIVATE_SURFACE:
        if entry.owner.startswith("trl.experimental.async_grpo"):
            assert entry.releases == f">={ASYNC_TRL}", (entry.owner, entry.name)
            assert [entry.holds_for(r) for r in WINDOW_RELEASES] == [False, False, True]
        elif entry.releases == ">=1.16":  # kl_estimate="vocabulary", which needs TRL 1.16's fused LM head
            assert entry.used_in == ("vocabulary_kl.py",) and entry.kind == "behaviour", (entry.owner, entry.name)
        elif entry.releases:
            assert entry.name == "_get_per_token_logps_and_entropies", (entry.owner, entry.name, entry.releases)


def test_the_check_compares_only_the_entries_of_the_installed_release():
    """An entry of other releases is left out of the check (a method TRL 1.14 or 1.15 lacks is no move on 1.16); one of
    the installed release is checked; a release outside the window is named first."""
    missing = PrivateName(GRPO, "_no_such_method", "call", ("m",), ("x",))
    release = installed_trl_release()
    assert check_private_surface([PrivateName(**{**vars(missing), "releases": "<1.0"})]) == []
    assert len(check_private_surface([PrivateName(**{**vars(missing), "releases": f"=={release}"})])) == 1
    assert check_private_surface([], release="1.17.0") == [
        f"TRL 1.17.0 is outside the window the table is written for ({TRL_WINDOW})"
    ]


@pytest.mark.parametrize("release", ["1.14.2", "1.15.0"])
def test_the_async_trainer_refuses_a_trl_older_than_it_needs_naming_both_releases(release, monkeypatch):
    """Importing `rpg_trl.async_rpg` (AsyncRPGTrainer, AsyncRPGConfig) with a TRL older than 1.16 raises an ImportError
    that names the release it needs, the installed one and the install command (setup.cfg's window from 1.16), before
    it imports `trl.experimental` (which TRL 1.14 cannot import without aiohttp); `import rpg_trl` is unaffected."""
    monkeypatch.setattr(trl_release, "installed_trl_release", lambda: release)
    monkeypatch.delitem(sys.modules, "rpg_trl.async_rpg", raising=False)
    with pytest.raises(ImportError) as error:
        importlib.import_module("rpg_trl.async_rpg")
    assert str(error.value) == (
        "rpg_trl.async_rpg (AsyncRPGTrainer and AsyncRPGConfig, on trl.experimental.async_grpo) needs TRL 1.16.0 or "
        f'later, and the installed TRL is {release}: `pip install "trl>=1.16.0,<1.17"`. RPGTrainer and RPGConfig run '
        "on the installed TRL."
    )
    monkeypatch.setattr(trl_release, "installed_trl_release", lambda: "1.16.0")
    trl_release.require_async_trl()  # 1.16 serves


@pytest.mark.parametrize("release, has_async", [("1.14.2", False), ("1.15.0", False), ("1.16.0", True)])
def test_star_import_leaves_the_async_names_out_on_a_trl_without_the_async_trainer(monkeypatch, release, has_async):
    """`from rpg_trl import *` imports every name of `rpg_trl.__all__`: on a TRL older than the asynchronous trainer
    needs, its two names are left out (their attribute raises the ImportError naming the release), the rest kept."""
    import importlib.metadata

    import rpg_trl

    monkeypatch.setattr(importlib.metadata, "version", lambda name: release if name == "trl" else "0")
    names = ["AsyncRPGConfig", "AsyncRPGTrainer", "RPGConfig", "RPGTrainer", "rpg_loss"]
    kept = rpg_trl._without_async_names(names)
    assert kept == (names if has_async else ["RPGConfig", "RPGTrainer", "rpg_loss"])
