# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The package layout: the library (`rpg_trl` outside `toy/` and `cli/`) never imports the tooling, and the toy task
(`rpg_trl.toy`) never imports the command line (`rpg_trl.cli`). Checked on the source with `ast`, imports inside
functions included."""

import ast
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parent.parent / "rpg_trl"
TOOLING = ("toy", "cli")


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
    return [p for p in _modules() if p.relative_to(PACKAGE).parts[0] not in TOOLING]


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
    assert {"rpg_trl.toy.addition", "rpg_trl.trainer", "rpg_trl.cli.plot"} <= cli_demo  # `..`, `..`, `.` in functions


def test_library_modules_exist_and_the_tooling_is_apart():
    library = {_module_name(p) for p in _library_modules()}
    assert {"rpg_trl", "rpg_trl.losses", "rpg_trl.config", "rpg_trl.trainer", "rpg_trl.ref_sync.trigger"} <= library
    assert not library & {"rpg_trl.tiny", "rpg_trl.demo", "rpg_trl.plotting", "rpg_trl.bench_speed"}


@pytest.mark.parametrize("forbidden", [("rpg_trl.toy",), ("rpg_trl.cli",)])
def test_no_library_module_imports_the_tooling(forbidden):
    assert _offending(_library_modules(), forbidden) == {}


def test_the_toy_task_never_imports_the_command_line():
    assert _offending(_modules("toy"), ("rpg_trl.cli",)) == {}


def test_toy_exports_resolve():
    import rpg_trl.toy as toy

    for name in toy.__all__:
        assert getattr(toy, name) is not None, name
