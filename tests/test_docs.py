"""The README, docs/ and research/docs/ point at things that exist: test names, files and links (they are renamed often);
the library's docstrings and messages point at what a wheel user can reach."""

import ast
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "research" / "README.md",
    *sorted((ROOT / "research" / "docs").glob("*.md")),
]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_named_test_exists(doc):
    text = doc.read_text()
    for folder, file, name in re.findall(r"((?:research/)?tests)/(test_\w+\.py)::(\w+)", text):
        source = (ROOT / folder / file).read_text()
        assert re.search(rf"def {name}\b", source), f"{doc.name} names {folder}/{file}::{name}, which does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_and_image_exists(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"


def test_the_readme_opens_with_the_two_set_up_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert len(block) == 2
    assert block[0].startswith("pip install torch==2.13.0 && pip install -e . -e ./research && rpg-trl demo")
    assert block[1].startswith(
        'pip install torch==2.13.0 && pip install -e ".[test]" -e ./research && python -m pytest'
    )
    assert '-m "not slow"' in block[1]  # the fast tier; .ci/run runs the slow one after it
    # CI runs the README's two commands exactly as written (before their comments), in a fresh environment.
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"README_DEMO='{block[0].split('#')[0].strip()}'" in ci
    assert f"README_TEST='{block[1].split('#')[0].strip()}'" in ci
    assert '\npython -m venv "$MAIN_ENV"\n' in ci


def test_no_document_cites_files_outside_the_repository():
    code = [*(ROOT / "rpg_trl").rglob("*.py"), *(ROOT / "research").rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    for path in [*DOCS, *code]:
        assert "RPG_SPEC" not in path.read_text(), f"{path.relative_to(ROOT)} cites a file outside the repository"


@pytest.mark.slow
def test_ci_stops_its_background_jobs_and_names_the_first_failure(tmp_path):
    """`.ci/run` in a copy of the repository's `.ci/` with stand-ins: `pip` succeeds, `python` fails under
    `ATEN_CPU_CAPABILITY` (the second test run), and the background jobs (`.ci/vllm install`, `.ci/wheel`,
    `.ci/torch_floor`, `.ci/trl_floor`) sleep and record their process ids, a child of theirs too. The run fails at once, names the
    failing step on its last line, and leaves no background process running (tests/test_ci.py: after a SIGTERM)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    jobs = ("vllm", "wheel", "torch_floor", "trl_floor")
    for name in jobs:
        # Written under another name, then renamed (as in tests/test_ci.py): the file exists only once it is complete.
        record = f"echo $$ $! > {tmp_path}/{name}.tmp\nmv {tmp_path}/{name}.tmp {tmp_path}/{name}.pids"
        (tmp_path / ".ci" / name).write_text(f"sleep 300 &\n{record}\nwait\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "rpg-trl").write_text("#!/bin/sh\nexit 0\n")
    started = " && ".join(f"[ -f {tmp_path}/{name}.pids ]" for name in jobs)  # all running
    (bin_dir / "python").write_text(
        f'#!/bin/sh\n[ -z "$ATEN_CPU_CAPABILITY" ] && exit 0\nuntil {started}; do sleep 0.1; done\nexit 3\n'
    )
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    proc = subprocess.run(["bash", ".ci/run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("== FAILED: numerics-sensitive tests under ATEN_CPU_CAPABILITY=default (exit status 3")
    ), proc.stderr
    assert time.monotonic() - started < 30
    for name in jobs:
        pids = [int(pid) for pid in (tmp_path / f"{name}.pids").read_text().split()]
        assert len(pids) == 2  # the job's shell and its sleep
        for pid in pids:  # gone, or a zombie, within a second (a signalled process takes a moment to end)
            stat = Path(f"/proc/{pid}/stat")
            for _ in range(50):
                try:
                    if stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                        break
                except FileNotFoundError:
                    break
                time.sleep(0.02)
            else:
                pytest.fail(f"the background job {name} left process {pid} running")


def test_the_readme_fits_120_lines():
    # The front page holds install, the card's three paths, which options to choose and links; the detail lives in
    # docs/, the results in research/docs/.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


#: Each GPU step-time ratio of bench-speed quoted on the front pages, and what it must say it was measured under
#: (research/docs/benchmarks.md): the first run (2026-11-26) on the character vocabulary, one repeat; the second (2026-11-27) on
#: Qwen3's vocabulary, 3 repeats.
GPU_CONDITIONS = {
    "0.896": (
        "generation not timed",
        "synthetic completions",
        "no vLLM",
        "randomly initialised",
        "28-token",
        "one repeat",
    ),
    "0.888": ("generation not timed", "synthetic completions", "no vLLM", "random weights", "151,936", "3 repeats"),
}


@pytest.mark.parametrize("page", ["README.md", "research/README.md", "CHANGELOG.md"])
def test_each_gpu_step_time_figure_carries_its_conditions(page):
    paragraphs = re.split(r"\n(?=- |\n)", (ROOT / page).read_text())
    quoted = 0
    for figure, conditions in GPU_CONDITIONS.items():
        for paragraph in (p for p in paragraphs if figure in p):
            quoted += 1
            flat = " ".join(paragraph.split())
            missing = [c for c in conditions if c not in flat]
            assert not missing, f"{page}: the GPU figure {figure} does not say {missing}: {flat[:200]}"
    if page == "CHANGELOG.md":
        assert quoted, f"{page} no longer quotes a GPU step-time ratio: update this test"
    from rpg_trl.testing import build_char_tokenizer

    assert len(build_char_tokenizer()) == 28  # bench-speed's model reads the toy character tokenizer
    gpu_run = (ROOT / "research" / "gpu" / "gpu_run.sh").read_text()
    assert "--vocab-size 151936" in gpu_run  # the second run's vocabulary


#: What a user of the wheel reads from the library (docstrings, messages, option help and `#:` attribute docs) may
#: not send them to the repository, which they do not have: no path of it and no command of the research package.
#: Every file beside the package is left out of the wheel, so there is no exception: `accelerate_configs/` and
#: `recipes/` ship with the sdist only, and no `.md` file is shipped (the README is the package's description, not a
#: file). `rpg_trl/testing/` (the project's own test support, which names the tests it serves) is not scanned.
REPOSITORY_PATH = re.compile(
    r"docs/\w+\.md|\b\w+\.md\b|research/|tests/\w+|\.ci/|examples/\w+\.py|accelerate_configs/|recipes/"
)
RESEARCH_COMMAND = re.compile(r"rpg-trl (?:bench|demo)")
#: How the library cites a page of docs/: ``docs: *<the page's title>*``, optionally followed by ``, "<a section>"``.
DOC_CITATION = re.compile(r'docs: \*([^*]+)\*(?:, "([^"]+)")?')


def _library_texts():
    """(file, text) of every string literal and docstring of the library outside rpg_trl/testing/ (found with `ast`;
    the constant parts of f-strings included), and of every run of `#:` comment lines (attribute docs, which render
    in the API docs as docstrings do and which `ast` does not see). Whitespace is folded, so that a citation wrapped
    across lines reads as one."""
    texts = []
    for path in sorted((ROOT / "rpg_trl").rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[1] == "testing":
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append((f"{relative}:{node.lineno}", " ".join(node.value.split())))
        run, start = [], None
        for number, line in enumerate([*source.splitlines(), ""], start=1):
            if line.strip().startswith("#:"):
                run.append(line.strip()[2:])
                start = start or number
            elif run:
                texts.append((f"{relative}:{start}", " ".join(" ".join(run).split())))
                run, start = [], None
    return texts


def _doc_pages():
    """Title (the first heading) and headings of each page of docs/, outside code blocks."""
    pages = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        headings, fenced = [], False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#+ ", line):
                headings.append(line.lstrip("#").strip())
        pages[page.name] = headings
    return pages


def test_the_library_cites_no_repository_path_or_research_command():
    """Docstrings, messages and option help send a wheel user to what they can reach: the paper by section, and the
    pages of the docs by title (see `DOC_CITATION`), never to a file of the repository (`docs/design.md`, a test
    under tests/, research/docs/, an example script) or a research command (`rpg-trl bench-algos`). A test may be
    named by its function name, which names no path. Comments (`#` lines) are for developers reading the source and
    may keep paths."""
    texts = _library_texts()
    assert len(texts) > 1000  # the scan sees the library (about 3000 texts; a wrong root would pass vacuously)
    found = [
        f"{where}: {match.group(0)!r} in {text[max(0, match.start() - 60) : match.end() + 60]!r}"
        for where, text in texts
        for pattern in (REPOSITORY_PATH, RESEARCH_COMMAND)
        for match in pattern.finditer(text)
    ]
    assert not found, "the library cites the repository:\n" + "\n".join(found)


def test_every_page_and_section_the_library_cites_exists_in_docs():
    """Each ``docs: *Title*`` of the library is the first heading of a page of docs/ (or the part of it before a
    colon, "Running at scale" for "Running at scale: vLLM server, asynchronous rollouts, LoRA"), and each section
    cited after it begins a heading of that page: a renamed page or section fails here, not in a reader's search."""
    pages = _doc_pages()
    titles = {}
    for name, headings in pages.items():
        titles[headings[0]] = name
        titles[headings[0].split(": ")[0]] = name
    cited, missing = set(), []
    for where, text in _library_texts():
        for title, section in DOC_CITATION.findall(text):
            if title not in titles:
                missing.append(f"{where}: no page of docs/ is titled {title!r}")
                continue
            cited.add(titles[title])
            if section and not any(h.startswith(section) for h in pages[titles[title]]):
                missing.append(f"{where}: {titles[title]} ({title!r}) has no section {section!r}")
    assert not missing, "\n".join(missing)
    # The library cites the design notes and the guarantees at least (a citation form the regex misses would pass).
    assert {"design.md", "guarantees.md"} <= cited, cited
