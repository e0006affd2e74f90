# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The layout: the library (`rpg_trl`) never imports the research package beside it (`research/rpg_research`: the
command line, the toy tasks), the trainers never import the library's testing package (`rpg_trl.testing`, which the
tests and the research package use), the toy tasks never import the command line, no two modules import each other
(directly or through others), and the README's layout paragraph names every part of both packages. Checked on the
source with `ast`, imports inside functions included, without importing the research package (its own exports are
checked by research/tests/test_research_layout.py)."""

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rpg_trl"
RESEARCH = ROOT / "research" / "rpg_research"
README = ROOT / "README.md"


def _module_name(path: Path) -> str:
    root = RESEARCH.parent if path.is_relative_to(RESEARCH) else ROOT
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, type_checking: bool = False) -> set[str]:
    """Absolute names of the modules imported anywhere in `path` (relative imports resolved), but for those under
    `if TYPE_CHECKING:` unless `type_checking`."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    return _imports_of(path.read_text(), package, type_checking, filename=str(path))


def _imports_of(source: str, package: list[str], type_checking: bool = False, filename: str = "<source>") -> set[str]:
    """The imports of `source`, a module of `package` (its dotted name as a list), as [`_imported_modules`]."""
    tree = ast.parse(source, filename=filename)
    # Imports under `if TYPE_CHECKING:` never run (annotations only): they are not dependencies at run time, but they
    # are a dependency of the module's meaning (`type_checking=True` counts them).
    type_only = set()
    if not type_checking:
        type_only = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body
            for sub in ast.walk(child)
        }
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
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


def _modules(*subpackages: str, package: Path = RESEARCH) -> list[Path]:
    return sorted(package.joinpath(*subpackages).rglob("*.py"))


def _library_modules() -> list[Path]:
    return _modules(package=PACKAGE)


def _offending(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        bad = sorted(n for n in _imported_modules(path) if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_walk_sees_every_kind_of_import():
    """The checker itself: absolute, relative (one and two levels) and function-level imports are all resolved."""
    names = _imported_modules(PACKAGE / "reliability" / "checks.py")
    assert "transformers.utils" in names  # absolute, at the top
    cli_demo = _imported_modules(RESEARCH / "cli" / "demo.py")
    # `..` (within rpg_research), absolute and `.`, all inside functions
    assert {"rpg_research.toy.addition", "rpg_trl.trainer", "rpg_research.cli.plot"} <= cli_demo
    kl = _imported_modules(PACKAGE / "losses" / "kl.py")  # `from .ratios import ...`; nothing of `spec`
    assert "rpg_trl.losses.ratios" in kl and "rpg_trl.losses.spec" not in kl


def test_the_walk_counts_type_checking_imports_only_when_asked():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .kl import x\n"
        "if TYPE_CHECKING:\n"
        "    from .spec import RPGLossSpec\n"
        "    import torch\n"
    )
    run_time = _imports_of(source, ["rpg_trl", "losses"])
    assert "rpg_trl.losses.kl" in run_time and "rpg_trl.losses.spec" not in run_time and "torch" not in run_time
    annotated = _imports_of(source, ["rpg_trl", "losses"], type_checking=True)
    assert {"rpg_trl.losses.kl", "rpg_trl.losses.spec", "torch"} <= annotated


def test_library_modules_exist_and_the_research_is_apart():
    library = {_module_name(p) for p in _library_modules()}
    assert {"rpg_trl", "rpg_trl.losses", "rpg_trl.config", "rpg_trl.trainer", "rpg_trl.ref_sync.trigger"} <= library
    assert all(name == "rpg_trl" or name.startswith("rpg_trl.") for name in library)
    research = {_module_name(p) for p in _modules()}
    assert {"rpg_research.cli", "rpg_research.toy", "rpg_research.toy.models"} <= research
    assert not library & research
    assert not (PACKAGE / "tools").exists()


def test_no_library_module_imports_the_research_package():
    assert _offending(_library_modules(), ("rpg_research",)) == {}


def test_no_library_module_outside_the_testing_package_imports_it():
    """`rpg_trl.testing` (tiny models, CPU rollouts, the pytest plugin) serves tests: the trainers do not depend on it.
    Its own modules import each other (the pytest plugin builds its model with `rpg_trl.testing.models`), which the
    walk must see, or the check below would pass on a walk that finds nothing."""
    testing = PACKAGE / "testing"
    inside = [p for p in _library_modules() if p.is_relative_to(testing)]
    outside = [p for p in _library_modules() if not p.is_relative_to(testing)]
    assert "rpg_trl.testing.models" in _imported_modules(testing / "pytest_plugin.py")
    assert len(inside) >= 5 and len(outside) > 20
    assert _offending(outside, ("rpg_trl.testing",)) == {}


def test_the_toy_task_never_imports_the_command_line():
    assert _offending(_modules("toy"), ("rpg_research.cli",)) == {}


def _import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (a name imported from a module counts as that module; a
    module's own parent packages, which Python imports first anyway, are left out); `type_checking`: the imports under
    `if TYPE_CHECKING:` count too."""
    modules = {_module_name(p): p for p in _library_modules() + _modules()}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imported_modules(path, type_checking):
            while imported and imported not in modules:  # `from .x import f` names `pkg.x.f`
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                deps.add(imported)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert _cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other():
    """The two optimum benchmarks share `rpg_research/cli/optima.py`, and the two tables of bench-algos share
    `rpg_research/cli/runs.py`, instead of importing each other."""
    graph = _import_graph()
    assert "rpg_research.cli.optima" in graph["rpg_research.cli.bench_optimum_sequence"]
    assert "rpg_research.cli.runs" in graph["rpg_research.cli.bench_kl"]
    assert _cycles(graph) == []


def test_the_loss_modules_import_one_another_in_one_direction_even_in_annotations():
    """`rpg_trl.losses`: `spec` imports `kl` and `surrogate` to check its fields, and `loss` the others; `kl` and
    `surrogate` annotate a specification with a protocol (`kl.LossSpecFields`) instead of importing `spec` under
    `if TYPE_CHECKING:`, so the package's graph has no cycle when annotation-only imports are counted."""
    graph = _import_graph(type_checking=True)
    losses = {
        name: {dep for dep in deps if dep.startswith("rpg_trl.losses.")}
        for name, deps in graph.items()
        if name.startswith("rpg_trl.losses.")
    }
    assert {"rpg_trl.losses.kl", "rpg_trl.losses.surrogate"} <= losses["rpg_trl.losses.spec"]
    assert {"rpg_trl.losses.spec", "rpg_trl.losses.surrogate"} <= losses["rpg_trl.losses.loss"]
    assert "rpg_trl.losses.ratios" in losses["rpg_trl.losses.kl"]
    assert _cycles(losses) == []
    assert not losses["rpg_trl.losses.kl"] & {"rpg_trl.losses.spec", "rpg_trl.losses.surrogate"}
    assert "rpg_trl.losses.spec" not in losses["rpg_trl.losses.surrogate"]


def test_the_readme_layout_names_every_part_of_the_package():
    """Each module and subpackage directly under `rpg_trl/` and `research/rpg_research/` is named in the README's layout
    paragraph, as `name.py` or `name/`."""
    text = README.read_text()
    layout = text[text.index("## Layout") :]
    layout = layout[: layout.index("\n## ")]
    missing = []
    for folder in (PACKAGE, RESEARCH):
        for entry in sorted(folder.iterdir()):
            if entry.name.startswith("_"):
                continue
            if entry.is_dir() and (entry / "__init__.py").exists():
                name = f"{entry.name}/"
            elif entry.suffix == ".py":
                name = entry.name
            else:
                continue
            if f"`{name}`" not in layout:
                missing.append(name)
    assert missing == []


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
