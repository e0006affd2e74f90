# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""TRL's private surface (`rpg_trl.trl_surface`): every private TRL/transformers name the library relies on is where the
table says in the installed TRL, the check reports each kind of move, and the table is complete (every private name of
TRL's trainers that the library touches, and every batch key it reads, is listed). After a TRL upgrade, the first test
lists what moved (docs/design.md, "Bumping TRL")."""

import ast
import inspect
import re
import warnings
from pathlib import Path

import pytest

from rpg_trl.trl_surface import ASYNC_GRPO, GRPO, PRIVATE_SURFACE, PrivateName, check_private_surface


PACKAGE = Path(__file__).resolve().parent.parent / "rpg_trl"
#: Batch keys the library itself puts into the batch (REINFORCE++'s scores and KL); every other key it reads is TRL's.
OWN_BATCH_KEYS = {"rfpp_kl", "rfpp_scores"}
#: Names of the dicts that hold a batch in the library's code.
BATCH_NAMES = {"inputs", "batch", "generation_batch"}


def _library_files() -> list[Path]:
    # The library, without the table itself (which names everything it lists).
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "trl_surface.py")


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

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl.experimental warns on import
        from trl.experimental.async_grpo import AsyncGRPOTrainer

    names = set()
    for cls in (trl.GRPOTrainer, AsyncGRPOTrainer):
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
    assert {"_compute_loss", "_metrics", "_buffered_inputs", "_step_forward_s", "_save_checkpoint"} <= trl_names
    listed = {e.name for e in PRIVATE_SURFACE if e.kind != "batch key"}
    touched = _library_private_names()
    missing = {name: sorted(modules) for name, modules in touched.items() if name in trl_names and name not in listed}
    assert missing == {}, "private TRL/transformers names used but not in rpg_trl.trl_surface.PRIVATE_SURFACE"
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
    missing = {k: sorted(m) for k, m in keys.items() if k not in listed and k not in OWN_BATCH_KEYS}
    assert missing == {}, "batch keys read but not in rpg_trl.trl_surface.PRIVATE_SURFACE"


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


def test_the_table_is_for_the_pinned_trl():
    """`TRL_VERSION` is the release pinned in setup.cfg: a bump of the pin comes with a revision of the table."""
    from rpg_trl.trl_surface import TRL_VERSION

    setup = (PACKAGE.parent / "setup.cfg").read_text()
    assert re.search(r"^\s*trl==(\S+)\s*$", setup, re.M).group(1) == TRL_VERSION
