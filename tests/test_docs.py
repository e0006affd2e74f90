"""The README and docs/ point at things that exist: test names, files and links (they are renamed often)."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_named_test_exists(doc):
    text = doc.read_text()
    for file, name in re.findall(r"tests/(test_\w+\.py)::(\w+)", text):
        source = (ROOT / "tests" / file).read_text()
        assert re.search(rf"def {name}\b", source), f"{doc.name} names tests/{file}::{name}, which does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
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
    assert block[0].startswith("pip install torch==2.13.0 && pip install -e . && rpg-trl demo")
    assert block[1].startswith('pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q')
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in ci


def test_no_document_cites_files_outside_the_repository():
    for path in [*DOCS, *(ROOT / "rpg_trl").rglob("*.py"), *(ROOT / "examples").glob("*.py")]:
        assert "RPG_SPEC" not in path.read_text(), f"{path.relative_to(ROOT)} cites a file outside the repository"
