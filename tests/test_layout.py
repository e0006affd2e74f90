# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The package layout: the library (`rpg_trl` outside `toy/`, `cli/` and `cpu_rollouts/`) never imports the tooling,
and the toy task (`rpg_trl.tools.toy`) never imports the command line (`rpg_trl.tools.cli`). Checked on the source with `ast`,
imports inside functions included. The modules renamed so that their names say what they hold keep their old paths as
deprecated aliases, which nothing in the repository imports any more (an alias left inside the library may import the
tooling it points to)."""

import ast
import re
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parent.parent / "rpg_trl"
TOOLING = ("toy", "cli", "cpu_rollouts")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules imported anywhere in `path` (relative imports resolved)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import toy`
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _modules(*subpackages: str) -> list[Path]:
    root = PACKAGE.joinpath(*subpackages)
    return sorted(root.rglob("*.py"))


def _library_modules() -> list[Path]:
    aliases = {old for old, _, _ in MOVED}
    return [p for p in _modules() if p.relative_to(PACKAGE).parts[0] not in TOOLING and _module_name(p) not in aliases]


def _offending(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        bad = sorted(n for n in _imported_modules(path) if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(PACKAGE.parent))] = bad
    return found


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """The checker itself: absolute, relative (one and two levels) and function-level imports are all resolved."""
    module = PACKAGE / "reliability" / "checks.py"
    names = _imported_modules(module)
    assert "transformers.utils" in names  # absolute, at the top
    cli_demo = _imported_modules(PACKAGE / "cli" / "demo.py")
    assert {
        "rpg_trl.tools.toy.addition",
        "rpg_trl.trainer",
        "rpg_trl.tools.cli.plot",
    } <= cli_demo  # `..`, `..`, `.` in functions


def test_library_modules_exist_and_the_tooling_is_apart():
    library = {_module_name(p) for p in _library_modules()}
    assert {"rpg_trl", "rpg_trl.losses", "rpg_trl.config", "rpg_trl.trainer", "rpg_trl.ref_sync.trigger"} <= library
    assert not library & {"rpg_trl.tiny", "rpg_trl.demo", "rpg_trl.plotting", "rpg_trl.bench_speed"}
    assert not library & {
        "rpg_trl.tools.cpu_rollouts",
        "rpg_trl.tools.cpu_rollouts.worker",
        "rpg_trl.tools.cpu_rollouts.attention",
    }


@pytest.mark.parametrize("forbidden", [(f"rpg_trl.{tooling}",) for tooling in TOOLING])
def test_no_library_module_imports_the_tooling(forbidden):
    assert _offending(_library_modules(), forbidden) == {}


def test_the_toy_task_never_imports_the_command_line():
    assert _offending(_modules("toy"), ("rpg_trl.tools.cli",)) == {}


def test_toy_exports_resolve():
    import rpg_trl.tools.toy as toy

    for name in toy.__all__:
        assert getattr(toy, name) is not None, name


#: Modules renamed so that their names say what they hold (old path, new path, what the warning tells to import).
MOVED = [
    ("rpg_trl.callbacks", "rpg_trl.ref_sync.callback", "from rpg_trl.ref_sync import RefModelSyncCallback"),
    ("rpg_trl.baselines", "rpg_trl.reinforce_plus_plus", "rpg_trl.reinforce_plus_plus"),
    ("rpg_trl.data", "rpg_trl.math_task.data", "rpg_trl.math_task.data"),
    ("rpg_trl.rewards", "rpg_trl.math_task.rewards", "rpg_trl.math_task.rewards"),
    ("rpg_trl.async_rpg.local", "rpg_trl.tools.cpu_rollouts", "rpg_trl.tools.cpu_rollouts"),
]


@pytest.mark.parametrize("old, new, advice", MOVED, ids=[m[0] for m in MOVED])
def test_old_import_paths_still_work_and_warn(old, new, advice, monkeypatch):
    """Each old module is an alias: it warns (FutureWarning, naming the new path) and gives the same objects."""
    import importlib
    import sys

    parent, name = old.rsplit(".", 1)
    monkeypatch.delitem(sys.modules, old, raising=False)  # a fresh import, so that the module-level warning fires
    monkeypatch.delattr(importlib.import_module(parent), name, raising=False)
    with pytest.warns(FutureWarning, match=re.escape(advice)):
        alias = importlib.import_module(old)
    module = importlib.import_module(new)
    public = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    assert set(public) <= set(alias.__all__)
    for name in alias.__all__:
        assert getattr(alias, name) is getattr(module, name), name


def test_moved_names_resolve_from_their_packages():
    import rpg_trl
    import rpg_trl.math_task as math_task
    import rpg_trl.math_task.data as data
    import rpg_trl.math_task.rewards as rewards
    from rpg_trl.ref_sync import RefModelSyncCallback
    from rpg_trl.ref_sync.callback import RefModelSyncCallback as defined

    assert rpg_trl.RefModelSyncCallback is RefModelSyncCallback is defined
    assert set(math_task.__all__) == set(data.__all__) | set(rewards.__all__)
    for name in math_task.__all__:
        assert getattr(math_task, name) is getattr(data if name in data.__all__ else rewards, name), name


def test_nothing_in_the_repository_imports_the_old_paths():
    aliases = {old for old, _, _ in MOVED}
    sources = [p for p in _modules() if _module_name(p) not in aliases]
    sources += sorted((PACKAGE.parent / "examples").glob("*.py")) + sorted((PACKAGE.parent / "tests").rglob("*.py"))
    found = {}
    for path in sources:
        if path.resolve() == Path(__file__).resolve():
            continue  # this file imports them on purpose
        bad = sorted(n for n in _imported_modules(path) if n in aliases)
        if bad:
            found[str(path.relative_to(PACKAGE.parent))] = bad
    assert found == {}


def test_the_importance_weight_monitor_moved_with_an_alias():
    """The importance-weight monitor has its own module (with its trainer mixin); the old name in `checks` warns and
    gives the same objects."""
    import rpg_trl.reliability as reliability
    import rpg_trl.reliability.checks as checks
    from rpg_trl.reliability import importance_weights

    for name in ("ImportanceWeightMonitor", "IMPORTANCE_WEIGHT_WARNING_INTERVAL"):
        with pytest.warns(FutureWarning, match=re.escape(f"rpg_trl.reliability.importance_weights import {name}")):
            assert getattr(checks, name) is getattr(importance_weights, name)
    assert reliability.ImportanceWeightMonitor is importance_weights.ImportanceWeightMonitor
    with pytest.raises(AttributeError):
        checks.no_such_name  # noqa: B018


def test_the_mixins_keep_to_their_own_attributes():
    """No mixin reads or writes a private attribute that another part of the package defines: each private attribute
    (`self._x` / `trainer._x` assigned in rpg_trl) is used only in the module that assigns it, or is TRL's."""
    assigned: dict[str, set[str]] = {}
    used: dict[str, set[str]] = {}
    for path in _library_modules():
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "trainer"):
                    target = assigned if isinstance(node.ctx, ast.Store) else used
                    target.setdefault(node.attr, set()).add(module)
    crossing = {
        name: sorted(users - assigned[name])
        for name, users in used.items()
        if name in assigned and users - assigned[name]
    }
    assert crossing == {}
