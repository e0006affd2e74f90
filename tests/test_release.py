# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The release files agree with the package: one version in `rpg_trl.__version__`, CITATION.cff and CHANGELOG.md; the
license that setup.cfg declares is the LICENSE file it ships; CITATION.cff cites the paper as the README does; the
README names the window of TRL releases that setup.cfg admits, whose oldest release CI tests. What the built sdist and
wheel contain is checked by `.ci/wheel`."""

import re
from pathlib import Path

import yaml

import rpg_trl


ROOT = Path(__file__).resolve().parent.parent
SETUP = (ROOT / "setup.cfg").read_text()


def _setup_value(key: str) -> str:
    return re.search(rf"^{key}\s*=\s*(.+)$", SETUP, re.M).group(1).strip()


def test_one_version_in_the_package_the_citation_and_the_changelog():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert _setup_value("version") == "attr: rpg_trl.__version__"
    assert citation["version"] == rpg_trl.__version__
    assert releases[0] == rpg_trl.__version__, "CHANGELOG.md opens with another version than the package's"
    assert releases == sorted(set(releases), key=lambda v: tuple(map(int, v.split("."))), reverse=True)


def test_the_declared_license_is_the_shipped_apache_text():
    license_text = (ROOT / "LICENSE").read_text()
    assert _setup_value("license") == "Apache-2.0"
    assert _setup_value("license_files") == "LICENSE"
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert yaml.safe_load((ROOT / "CITATION.cff").read_text())["license"] == "Apache-2.0"
    header = "# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.\n"
    for path in (ROOT / "rpg_trl").rglob("*.py"):
        assert path.read_text().startswith(header), f"{path.relative_to(ROOT)} lacks the license header"


def test_the_citation_names_the_paper_as_the_readme_does():
    paper = yaml.safe_load((ROOT / "CITATION.cff").read_text())["preferred-citation"]
    bibtex = (ROOT / "README.md").read_text().split("## Citation", 1)[1]
    fields = dict(re.findall(r"^\s*(\w+)\s*=\s*\{(.+)\},?$", bibtex, re.M))
    assert paper["title"] == fields["title"]
    assert [f"{a['given-names']} {a['family-names']}" for a in paper["authors"]] == fields["author"].split(" and ")
    assert (paper["collection-title"], paper["year"]) == (fields["booktitle"], int(fields["year"]))


def _trl_window() -> str:
    """setup.cfg's TRL requirement (``trl>=1.14.2,<1.17``)."""
    return re.search(r"^\s*(trl[<>=!~]\S+)\s*$", SETUP, re.M).group(1)


def test_the_readme_names_setup_cfgs_trl_window():
    """The README's "Install" section names the TRL releases setup.cfg admits, exactly, and the table of TRL's private
    names that the window is checked with."""
    window = _trl_window()
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert re.fullmatch(r"trl>=\d+\.\d+\.\d+,<\d+\.\d+", window), window  # a floor and a ceiling, no pin
    assert f"`{window}`" in install and "tests/helpers/trl_surface.py" in install


def test_the_trl_floor_is_the_release_ci_tests_and_ci_runs_it():
    """setup.cfg's oldest TRL is the release `.ci/trl_floor` installs (its `TRL_FLOOR`), and `.ci/run` runs that
    script: the fast tier on the window's oldest release (the main environment runs the newest)."""
    floor = re.match(r"trl>=(\d+\.\d+\.\d+),", _trl_window()).group(1)
    script = (ROOT / ".ci" / "trl_floor").read_text()
    assert re.search(rf"^TRL_FLOOR={re.escape(floor)}$", script, re.M), f"setup.cfg's TRL floor {floor} is not CI's"
    assert '"trl==$TRL_FLOOR"' in script and '-m "not slow"' in script
    assert "bash .ci/trl_floor" in (ROOT / ".ci" / "run").read_text(), ".ci/run does not run .ci/trl_floor"


def test_the_torch_floor_is_the_oldest_tested_release_and_has_what_the_failure_watcher_needs():
    """setup.cfg's torch floor is a release CI tests: `.ci/torch_floor` installs exactly that release (X.Y.0) and
    `.ci/run` runs it, while the main environment runs the torch the README installs (not older than the floor). The
    floor has `Store.clone`, which the failure watcher of multi-process runs needs (torch 2.8 and later:
    rpg_trl/reliability/process_failure.py)."""
    import torch
    import torch.distributed as dist

    floor = re.search(r"^\s*torch>=(\d+)\.(\d+)\s*$", SETUP, re.M)
    assert floor, "setup.cfg declares no torch floor"
    major, minor = int(floor.group(1)), int(floor.group(2))
    script = (ROOT / ".ci" / "torch_floor").read_text()
    assert re.search(rf"^TORCH_FLOOR={major}\.{minor}\.0$", script, re.M), f"{floor.group(0)} is not what CI tests"
    assert '"torch==$TORCH_FLOOR"' in script and "bash .ci/torch_floor" in (ROOT / ".ci" / "run").read_text()
    readme_torch = re.search(r"^pip install torch==(\d+)\.(\d+)\.\d+ ", (ROOT / "README.md").read_text(), re.M)
    assert (int(readme_torch.group(1)), int(readme_torch.group(2))) >= (major, minor)
    installed = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= (major, minor), (floor.group(0), torch.__version__)
    assert (major, minor) >= (2, 8) and hasattr(dist.Store, "clone")


def _requirement_names(lines) -> set[str]:
    """The normalised distribution names of requirement lines (`name>=x`, `name[extra]`, comments and blanks left out)."""
    names = set()
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _setup_section(name: str) -> list[str]:
    """The indented lines under `name =` in setup.cfg."""
    block = re.search(rf"^{re.escape(name)}\s*=\s*\n((?:[ \t]+.*\n|[ \t]*#.*\n|\s*\n)+)", SETUP, re.M)
    assert block, f"setup.cfg has no {name}"
    return block.group(1).splitlines()


def test_every_import_of_the_tests_is_a_declared_dependency():
    """The README's test command installs `rpg_trl[test]` and the research package, in CI into an environment that
    sees none of the machine's packages (.ci/run): a module that a test imports must come from a distribution declared
    there, directly (not only as a dependency of a dependency, which a release of that dependency may drop). Modules
    of the repository (tests/helpers, the examples) and the standard library excepted; a module that is not installed
    here (vLLM, which .ci/vllm installs) must be declared by an extra of setup.cfg."""
    import ast
    import importlib.metadata
    import sys
    import tomllib

    declared = _requirement_names([*_setup_section("install_requires"), *_setup_section("test")])
    research = tomllib.loads((ROOT / "research" / "pyproject.toml").read_text())["project"]
    declared |= _requirement_names(research["dependencies"]) | {"rpg-trl", "rpg-trl-research"}
    extras = _requirement_names(line for extra in ("vllm", "vllm-cpu", "deepspeed") for line in _setup_section(extra))
    local = {
        path.stem
        for folder in ("tests", "tests/helpers", "research/tests", "examples")
        for path in (ROOT / folder).iterdir()
        if path.suffix == ".py" or (path / "__init__.py").exists()
    } | {"tests", "helpers"}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "research" / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in (name.split(".")[0] for name in modules):
                if module in sys.stdlib_module_names or module in local:
                    continue
                names = {name.lower().replace("_", "-") for name in distributions.get(module, ())}
                if names & declared or (not names and any(extra.startswith(module) for extra in extras)):
                    continue
                undeclared.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported by tests but not declared in setup.cfg's test extra: {undeclared}"
