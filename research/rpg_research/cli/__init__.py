# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
r"""The ``rpg-trl`` command line (console script declared in ``setup.cfg``; also ``python -m rpg_research.cli``).

The command line belongs to the research package, not to the library: the commands train on the offline toy task of
[`rpg_research.toy`] and call the library (`rpg_trl`); no library module imports `rpg_research.cli`.

Each subcommand lives in its own module of this package, which registers itself with two functions:

```python
def add_parser(subparsers) -> argparse.ArgumentParser:
    # Add and return the subcommand's parser: `subparsers.add_parser("name", help=..., ...)`. The parsers are
    # `trl.TrlParser`s, so `dataclass_types=[MyArguments]` declares the options as a dataclass (TRL's convention),
    # and `rpg-trl name --config args.yaml` reads them from a YAML file.
    ...


def run(args: argparse.Namespace) -> int | None:
    # Execute the subcommand; an integer return value is the exit status, anything else (None, a results dict)
    # means success.
    ...
```

To add a subcommand, write such a module and list it in [`SUBCOMMAND_MODULES`] (always present) or
[`OPTIONAL_SUBCOMMAND_MODULES`] (registered only when the module exists and imports). Modules must import quickly: keep
`torch`/`trl` imports inside `run`, so that ``rpg-trl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
from collections.abc import Sequence


#: Subcommand modules of rpg_trl, in the order of ``rpg-trl --help``.
SUBCOMMAND_MODULES = (
    "rpg_research.cli.demo",
    "rpg_research.cli.plot",
    "rpg_research.cli.bench_algos",
    "rpg_research.cli.bench_optimum",
    "rpg_research.cli.bench_async",
    "rpg_research.cli.kl_budget",
    "rpg_research.cli.bench_kl_variance",
    "rpg_research.cli.task_stats",
)
#: Subcommand modules registered only when present and importable.
OPTIONAL_SUBCOMMAND_MODULES = ("rpg_research.cli.bench_speed",)


class CommandError(Exception):
    """An error the user can fix (bad path, bad value): ``rpg-trl`` prints it without a traceback and exits with 2."""


def dataclass_arguments(args: argparse.Namespace, dataclass_type):
    """The subcommand's arguments dataclass built from the parsed `args`; its `ValueError`s become [`CommandError`]s."""
    try:
        return dataclass_type(**{name: getattr(args, name) for name in dataclass_type.__dataclass_fields__})
    except ValueError as exc:
        raise CommandError(str(exc)) from exc


def check_arguments(args, *, at_least_one=(), at_least_zero=(), positive=()) -> None:
    """Raise a `ValueError` naming the first field of `args` out of range: the fields `at_least_one` and
    `at_least_zero` must be integers >= 1 and >= 0, the fields `positive` finite numbers > 0."""
    for names, minimum in ((at_least_one, 1), (at_least_zero, 0)):
        for name in names:
            value = getattr(args, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an integer >= {minimum}; got {value!r}.")
    for name in positive:
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number; got {value!r}.")


def apply_preset(args, presets: dict, quick: bool) -> None:
    """Give the fields of `args` left unset (None) their value in ``presets["quick"]`` or ``presets["full"]``."""
    for key, value in presets["quick" if quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)


def machine() -> dict:
    """Where and when a command's numbers were measured: the CPU, the ATen CPU capability (the kernels PyTorch chose:
    AVX-512, AVX2 or none; float32 results move with it, docs/guarantees.md), the torch threads, the package
    versions and the UTC date. Recorded in every command's JSON output."""
    import platform
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for package in ("rpg_trl", "trl", "transformers", "torch"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "versions": versions,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def print_report(output_dir: str, seconds: float, written: str) -> None:
    """The end of a benchmark command: its ``table.md`` (from `output_dir`), the total time and what it wrote."""
    from pathlib import Path

    print()
    print((Path(output_dir) / "table.md").read_text())
    print(f"Total time {seconds:.0f} s. Wrote {written}")


def _load_optional(name: str):
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken optional module must not take the other subcommands down
        print(
            f"rpg-trl: warning: subcommand module {name!r} failed to import ({type(exc).__name__}: {exc}); "
            "its subcommand is unavailable.",
            file=sys.stderr,
        )
        return None


def build_parser() -> argparse.ArgumentParser:
    """The ``rpg-trl`` parser with every available subcommand registered."""
    from trl import TrlParser

    from rpg_trl import __version__

    parser = TrlParser(
        prog="rpg-trl",
        description="RPG (Regularized Policy Gradient, ICLR 2026) for TRL: demos, benchmarks and plots.",
    )
    parser.add_argument("--version", action="version", version=f"rpg_trl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    modules = [importlib.import_module(name) for name in SUBCOMMAND_MODULES]
    modules += [m for m in map(_load_optional, OPTIONAL_SUBCOMMAND_MODULES) if m is not None]
    for module in modules:
        for attribute in ("add_parser", "run"):
            if not callable(getattr(module, attribute, None)):
                raise TypeError(
                    f"Subcommand module {module.__name__!r} must define `{attribute}`; see rpg_research.cli."
                )
        subparser = module.add_parser(subparsers)
        if not isinstance(subparser, argparse.ArgumentParser):
            raise TypeError(
                f"`{module.__name__}.add_parser` must return the subcommand's ArgumentParser; got {subparser!r}."
            )
        subparser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rpg-trl``: parse `argv` (default: ``sys.argv[1:]``) and run the subcommand."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # TrlParser reads `--config file.yaml` (defaults for the subcommand's options), then the command line.
    args = parser.parse_args_and_config(argv)[0]
    if args.command is None:
        parser.print_help()
        return 1
    try:
        status = args._run(args)
    except (CommandError, FileNotFoundError) as exc:
        # Errors the user can fix name the bad value; a traceback would only hide the message.
        print(f"rpg-trl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) and not isinstance(status, bool) else 0
