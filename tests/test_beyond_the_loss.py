"""docs/beyond_the_loss.md lists, in one table, everything RPGTrainer does beyond the loss; it is checked here against
the code (every override of a GRPOTrainer/Trainer name in the class line, every callback the trainer installs, every
test the table cites), and the README's "Swap the class" snippet is run on this CPU as written."""

import ast
import re
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from rpg_trl import RPGConfig, RPGTrainer

from helpers.tiny_runs import PROMPTS, make_trainer


ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "beyond_the_loss.md"
README = ROOT / "README.md"
#: The table's columns, in order.
COLUMNS = ("behaviour", "where", "what it does", "why", "off", "test")
#: A method or attribute named in the "where" column: `Class.name`.
OVERRIDE_RE = re.compile(r"`(\w+)\.(\w+)`")
#: A callback named in the "where" column: `Name` (callback).
CALLBACK_RE = re.compile(r"`(\w+)` \(callback\)")
#: A test node id: tests/test_x.py::test_name (a parametrized test is cited by its function).
TEST_RE = re.compile(r"`(tests/test_\w+\.py)::(\w+)`")


def table_rows() -> list[dict[str, str]]:
    """The rows of the page's one table, as {column: cell}."""
    lines = [line for line in PAGE.read_text().splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert tuple(cells[0]) == COLUMNS, f"the table's header is {cells[0]}, not {COLUMNS}"
    assert set("".join(cells[1])) <= set("-"), "the second line of the table is not its separator"
    rows = []
    for row in cells[2:]:
        # A `|` inside a cell would shift the columns: every row has exactly the header's cells.
        assert len(row) == len(COLUMNS), f"a row of {len(row)} cells, not {len(COLUMNS)}: {row[0]}"
        rows.append(dict(zip(COLUMNS, row, strict=True)))
    return rows


def overrides_in_the_class_line() -> set[str]:
    """`Class.name` for every name that a class of this project in RPGTrainer's MRO defines and that GRPOTrainer or a
    base of it (transformers' Trainer) defines too: the overridden methods (and class attributes such as the model
    card's `_tag_names`). Dunders other than `__init__` (`__doc__`, `__module__`, ...) are not behaviour."""
    upstream = set().union(*(vars(base) for base in GRPOTrainer.__mro__ if base is not object))
    ours = [cls for cls in RPGTrainer.__mro__ if cls.__module__.startswith("rpg_trl")]
    return {
        f"{cls.__name__}.{name}"
        for cls in ours
        for name in vars(cls)
        if name in upstream and (name == "__init__" or not name.startswith("__"))
    }


def test_every_override_in_the_class_line_has_a_row_and_every_row_names_real_overrides():
    """A method added to RPGTrainer or one of its mixins that overrides GRPOTrainer's or Trainer's must be described on
    the page (what it does, why, how to turn it off, its test); a row that names a method that no longer overrides
    anything is stale."""
    overrides = overrides_in_the_class_line()
    # The computation finds what the code is known to override (so an empty set cannot pass): RPG's loss, the reward
    # guard, the committed checkpoints, the monitors' `log` and the mixins' constructors.
    assert {
        "RPGTrainer._compute_loss",
        "ReliabilityMixin._calculate_rewards",
        "CommittedCheckpointsMixin._save_checkpoint",
        "ImportanceWeightMonitorMixin.log",
        "KLDriftMonitorMixin.log",
        "ReliabilityMixin.__init__",
    } <= overrides
    named = {f"{cls}.{name}" for row in table_rows() for cls, name in OVERRIDE_RE.findall(row["where"])}
    assert not overrides - named, f"overrides without a row in {PAGE.name}: {sorted(overrides - named)}"
    assert not named - overrides, f"{PAGE.name} names what is not an override: {sorted(named - overrides)}"


def test_every_row_says_what_why_how_to_turn_it_off_and_cites_a_test():
    rows = table_rows()
    assert len(rows) >= 20  # one row per behaviour (the page lists 22)
    for row in rows:
        empty = [column for column in COLUMNS if not row[column]]
        assert not empty, f"the row {row['behaviour']!r} has no {empty}"
        assert TEST_RE.search(row["test"]), f"the row {row['behaviour']!r} cites no test node id"


def test_every_test_the_table_cites_exists():
    """Each `tests/...::test_name` of the page is a test function of that module (found with `ast`, without importing
    or running the module: some need vLLM or a GPU)."""
    cited = TEST_RE.findall(PAGE.read_text())
    assert len(cited) >= 30
    functions = {}
    for path, name in cited:
        if path not in functions:
            tree = ast.parse((ROOT / path).read_text())
            functions[path] = {
                node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        assert name.startswith("test_") and name in functions[path], f"{PAGE.name} cites {path}::{name}, not a test"


def test_every_callback_the_trainer_installs_has_a_row(tiny_model_dir, tmp_path):
    """With every option that installs a callback of this project (a reference synced by KL and periodically, a KL
    budget), the trainer's callbacks from `rpg_trl` are exactly those the table names, and TRL's own
    `SyncRefModelCallback`, which `sync_ref_model=True` makes GRPOTrainer install, is gone (the page says it is
    replaced). Callbacks are installed in one place only (`KLFedCallback.install`), so no other option adds one."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        kl_anchor="reference",
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_sync_kl_threshold=0.5,
        kl_target=0.1,
    )
    callbacks = trainer.callback_handler.callbacks
    installed = {type(cb).__name__ for cb in callbacks if type(cb).__module__.startswith("rpg_trl")}
    named = {name for row in table_rows() for name in CALLBACK_RE.findall(row["where"])}
    assert installed == named == {"RefModelSyncCallback", "AdaptiveKLCallback"}
    assert not any(isinstance(cb, SyncRefModelCallback) for cb in callbacks)
    sites = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "rpg_trl").rglob("*.py")
        if "add_callback(" in path.read_text() and "async_rpg" not in path.parts
    ]
    assert sites == ["rpg_trl/_kl_callback.py"], f"callbacks are added in {sites}: name them in {PAGE.name}"


# ---------------------------------------------------------------------------------------------------- the README snippet
def readme_swap_snippet() -> str:
    """The Python block of the README's "Swap the class" section."""
    section = README.read_text().split("\n## Swap the class\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


class _TinyModel(ast.NodeTransformer):
    """Replaces the README's Hub model id by the path of the tiny local Qwen3."""

    def __init__(self, path: str):
        self.path, self.replaced = path, 0

    def visit_Constant(self, node):
        if node.value == "Qwen/Qwen3-0.6B":
            self.replaced += 1
            return ast.copy_location(ast.Constant(self.path), node)
        return node


def test_the_readme_swap_snippet_runs_on_a_cpu_as_written(tiny_model_dir, tmp_path, monkeypatch):
    """The README's "Swap the class" snippet, run on this CPU statement by statement as written, but for what would
    download or take long: `load_dapo_math_17k()` (the Hub dataset) returns 100 local prompts with a `solution`
    column, the model id "Qwen/Qwen3-0.6B" is the tiny local Qwen3 (the same call, another string), and the last
    statement, `trainer.train()`, is checked but not run (training is tested elsewhere; on the README's settings the
    tiny model would train for minutes). The config line runs exactly as written: `RPGConfig(...)` with
    `GRPOConfig`'s `bf16` default raises transformers' "Your setup doesn't support bf16/gpu" on a CPU."""
    monkeypatch.chdir(tmp_path)  # the snippet's output_dir is relative
    module = ast.parse(readme_swap_snippet())
    *statements, last = module.body
    # The last statement trains: `trainer.train()`.
    assert ast.unparse(last) == "trainer.train()"
    transformer = _TinyModel(tiny_model_dir)
    statements = [ast.fix_missing_locations(transformer.visit(statement)) for statement in statements]
    assert transformer.replaced == 1

    dataset = PROMPTS.add_column("solution", ["0"] * len(PROMPTS))

    def load_dapo_math_17k_offline(*args, **kwargs):
        assert not args and not kwargs  # the README loads the default: the paper's English subset
        return dataset

    namespace = {}
    for statement in statements:
        exec(compile(ast.Module([statement], type_ignores=[]), "README.md", "exec"), namespace)
        if "load_dapo_math_17k" in namespace and namespace["load_dapo_math_17k"] is not load_dapo_math_17k_offline:
            namespace["load_dapo_math_17k"] = load_dapo_math_17k_offline  # right after the import that brings it
    args, trainer = namespace["args"], namespace["trainer"]
    assert isinstance(args, RPGConfig) and isinstance(trainer, RPGTrainer) and trainer.args is args
    assert args.bf16 is torch.cuda.is_available()  # float32 on a CPU (here), TRL's bf16 default on a GPU
    assert args.steps_per_generation == 8 and Path(args.output_dir).name == "Qwen3-0.6B-RPG"
    assert trainer.train_dataset is dataset and isinstance(trainer.train_dataset, Dataset)
    assert trainer.reward_func_names == ["accuracy_reward"]


def test_the_readme_swap_snippet_keeps_grpo_configs_bf16_default_on_a_gpu(monkeypatch):
    """On a GPU the snippet's config keeps `GRPOConfig`'s default, `bf16=True` (TRL's base config sets
    `bf16 = not fp16` when it is not given), and on a CPU it is False. Checked by evaluating the arguments of the
    snippet's `RPGConfig(...)` call with `torch.cuda.is_available` answering True, then False (building the config
    itself with bf16 needs a GPU)."""
    module = ast.parse(readme_swap_snippet())
    calls = [node for node in ast.walk(module) if isinstance(node, ast.Call) and ast.unparse(node.func) == "RPGConfig"]
    assert len(calls) == 1
    (call,) = calls
    keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords}
    assert "bf16" in keywords, "without bf16, RPGConfig(...) takes GRPOConfig's default, which a CPU refuses"
    assert "fp16" not in keywords and "use_cpu" not in keywords
    for cuda, expected in ((True, True), (False, False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert eval(keywords["bf16"], {"torch": torch}) is expected
