# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The wheels `research/gpu/gpu_run.sh` carries to the lent GPU machine (no network), and which of them it installs there.

    python research/gpu/gpu_wheels.py pins                    # NAME==VERSION of the carried set, as installed here
    python research/gpu/gpu_wheels.py fallback-pins TIER      # the pins of one fallback tier (FALLBACKS)
    python research/gpu/gpu_wheels.py versions OUT.json       # the versions of IMAGE_PACKAGES in this Python
    python research/gpu/gpu_wheels.py choose WHEELS           # the wheel files to install into this Python
    python research/gpu/gpu_wheels.py tier WHEELS TIER        # the wheel files of a fallback tier's set (or main's)

The carried set is pinned to the versions installed where `--fetch-wheels` runs (the ones CI tests); a package missing
there stops the fetch instead of becoming an unpinned name. The image's pyarrow is not known in advance and the
datasets CI tests may need a newer one (datasets 5.2 needs pyarrow >= 24, and a pyarrow wheel, about 47 MiB, does not
fit the 64 MiB a call carries): `choose` reads the pyarrow requirement of each carried datasets wheel and takes the
newest one the installed pyarrow meets, with the packages its tier pins beside it.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import sys
import zipfile
from pathlib import Path


#: The packages the GPU image lacks (trl, datasets, math-verify, deepspeed and what they need beyond the image), and
#: transformers and peft, carried at the versions CI tests over the image's own. deepspeed is built from its source
#: distribution (gpu_run.sh), the others are downloaded as wheels.
CARRIED = [
    "trl",
    "transformers",
    "peft",
    "datasets",
    "dill",
    "multiprocess",
    "fsspec",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "hjson",
]
#: Older datasets for an image whose pyarrow is older than the carried datasets needs, each with the packages whose
#: versions it requires (its pins replace the carried ones). Tier name -> pins; each lands in wheels/fallback/<tier>/.
FALLBACKS = {
    # datasets 5.0.1: pyarrow >= 21 (trl 1.16's own floor), fsspec <= 2026.6.0.
    "pyarrow21": ["datasets==5.0.1", "fsspec==2026.6.0"],
    # datasets 4.0.0: pyarrow >= 15, dill < 0.3.9, multiprocess < 0.70.17, fsspec <= 2025.3.0.
    "pyarrow15": ["datasets==4.0.0", "dill==0.3.8", "multiprocess==0.70.16", "fsspec==2025.3.0"],
}
#: The versions gpu_run.sh records from the image before it installs anything (env.json's "image").
IMAGE_PACKAGES = [
    "torch",
    "accelerate",
    "transformers",
    "peft",
    "numpy",
    "pyarrow",
    "pandas",
    "regex",
    "huggingface-hub",
    "tokenizers",
    "safetensors",
    "fsspec",
    "xxhash",
    "pytest",
    "pytest-timeout",
    "matplotlib",
]


def canonical(name: str) -> str:
    """PEP 503's normalised name (`Math_Verify` -> `math-verify`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(names=CARRIED) -> list[str]:
    """`NAME==VERSION` for each of `names` as installed in this Python; exits naming the missing ones."""
    found, missing = [], []
    for name in names:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        sys.exit(
            f"gpu_wheels.py: {missing} not installed in {sys.executable}: the carried wheels are pinned to the versions "
            "CI tests, read from the environment that runs --fetch-wheels (pip install -e '.[deepspeed,test]' there)"
        )
    return found


def versions(names=IMAGE_PACKAGES) -> dict:
    """The installed version of each of `names` (None where absent)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def wheel_name(path: Path) -> str:
    """The canonical project name of a wheel file (its name up to the first dash)."""
    return canonical(Path(path).name.split("-")[0])


def requirement_of(wheel: Path, project: str):
    """The `Requires-Dist` of `wheel` on `project` (a `packaging` Requirement, environment markers ignored), or None."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        for line in zf.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if canonical(req.name) == canonical(project) and not (req.marker and "extra" in str(req.marker)):
                    return req
    return None


def combine(main: list[Path], tier: list[Path]) -> list[Path]:
    """The wheels of `main` with those of a fallback `tier` in place of the same packages'."""
    replaced = {wheel_name(w) for w in tier}
    return sorted([w for w in main if wheel_name(w) not in replaced] + list(tier))


def choose(wheels: Path, pyarrow: str | None) -> list[Path]:
    """The wheels to install where pyarrow `pyarrow` is installed: those of `wheels/`, with the datasets of the first
    tier of `wheels/fallback/` (newest datasets first) whose pyarrow requirement `pyarrow` meets replacing its own
    (the tier's other wheels replace theirs too) when the carried datasets needs a newer pyarrow."""
    from packaging.version import Version

    wheels = Path(wheels)
    main = sorted(wheels.glob("*.whl"))
    tiers = [sorted(d.glob("*.whl")) for d in sorted((wheels / "fallback").glob("*")) if d.is_dir()]
    candidates = [main] + sorted(
        (t for t in tiers if any(wheel_name(w) == "datasets" for w in t)),
        key=lambda t: Version(next(w for w in t if wheel_name(w) == "datasets").name.split("-")[1]),
        reverse=True,
    )
    if pyarrow is None:
        sys.exit("gpu_wheels.py: pyarrow is not installed here; carry a pyarrow wheel (datasets needs one)")
    for tier in candidates:
        datasets = [w for w in tier if wheel_name(w) == "datasets"]
        if not datasets:
            return main  # nothing to choose: no datasets carried
        req = requirement_of(datasets[0], "pyarrow")
        if req is None or req.specifier.contains(pyarrow, prereleases=True):
            if tier is main:
                return main
            return combine(main, tier)
    needs = [str(requirement_of(next(w for w in t if wheel_name(w) == "datasets"), "pyarrow")) for t in candidates]
    sys.exit(
        f"gpu_wheels.py: pyarrow {pyarrow} is installed here, and no carried datasets accepts it (they need {needs}): "
        "carry a newer pyarrow wheel or an older datasets (FALLBACKS in research/gpu/gpu_wheels.py)"
    )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "pins":
        print("\n".join(pins()))
    elif command == "fallback-pins" and len(rest) == 1 and rest[0] in FALLBACKS:
        print("\n".join(FALLBACKS[rest[0]]))
    elif command == "fallback-tiers":
        print("\n".join(FALLBACKS))
    elif command == "versions" and len(rest) == 1:
        found = versions()
        Path(rest[0]).write_text(json.dumps(found, indent=2) + "\n")
        print("image:", ", ".join(f"{k} {v}" for k, v in found.items()))
    elif command == "tier" and len(rest) == 2:
        wheels = Path(rest[0])
        tier = sorted((wheels / "fallback" / rest[1]).glob("*.whl")) if rest[1] != "main" else []
        print("\n".join(str(w) for w in combine(sorted(wheels.glob("*.whl")), tier)))
    elif command == "choose" and len(rest) == 1:
        pyarrow = versions(["pyarrow"])["pyarrow"]
        chosen = choose(Path(rest[0]), pyarrow)
        print("\n".join(str(w) for w in chosen))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
