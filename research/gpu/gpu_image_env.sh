#!/usr/bin/env bash
# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
#
# A Python 3.12 virtual environment built like the lent GPU machine's fixed image (research/docs/benchmarks.md), for the CPU
# dry run of research/gpu/gpu_run.sh with the carried wheels, as the GPU machine will install them:
#
#   bash research/gpu/gpu_image_env.sh [--venv DIR] [--python PYTHON3.12] [--pyarrow VERSION]
#   PYTHON=DIR/bin/python bash research/gpu/gpu_run.sh --dry-run --archive /tmp/dry-run.tar.gz
#
# The image: Python 3.12.3, torch 2.11.0, accelerate 1.15.0, transformers 5.17.0, numpy 2.5.2, huggingface_hub 1.33.0,
# tokenizers 0.23.2, pandas, pyarrow, peft, pytest; no trl, datasets, deepspeed, math-verify or vLLM. Its pyarrow
# version is not known: the default here (18.1.0) is older than datasets 5.x accepts, so that the dry run exercises
# gpu_run.sh's fallback datasets wheel (--pyarrow 24.0.0 for the other branch). torch 2.11.0 comes from PyPI (a CUDA
# build, with its nvidia-* requirements: several GB) unless PyTorch's CPU index answers.
set -euo pipefail

VENV="${RPG_GPU_IMAGE_VENV:-$HOME/.cache/rpg_trl/gpu-image-py312}"
PY312="${PYTHON312:-}"
PYARROW="18.1.0"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --venv) VENV="$2"; shift ;;
        --python) PY312="$2"; shift ;;
        --pyarrow) PYARROW="$2"; shift ;;
        -h | --help) sed -n '4,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_image_env.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [[ -z "$PY312" ]]; then
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
        if "$candidate" -c "" >/dev/null 2>&1; then PY312="$candidate"; break; fi  # a pyenv shim may not run
    done
fi
[[ -n "$PY312" ]] || { echo "gpu_image_env.sh: no Python 3.12 found; give one with --python" >&2; exit 1; }

"$PY312" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
index=()
if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=10)" \
    2>/dev/null; then
    index=(--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple)
fi
"${pip[@]}" "${index[@]}" "torch==2.11.0"
"${pip[@]}" "accelerate==1.15.0" "transformers==5.17.0" "numpy==2.5.2" "huggingface_hub==1.33.0" \
    "tokenizers==0.23.2" pandas "pyarrow==$PYARROW" peft pytest "torch==2.11.0" \
    xxhash psutil pyyaml jinja2 sympy typer einops msgpack ninja py-cpuinfo pytest-timeout requests aiohttp  # also there
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import platform

names = ["torch", "accelerate", "transformers", "numpy", "huggingface_hub", "tokenizers", "pandas", "pyarrow", "peft",
         "pytest", "pytest-timeout", "regex", "xxhash"]
print(f"Python {platform.python_version()}:", ", ".join(f"{n} {m.version(n)}" for n in names))
EOF
echo "The emulated image: $VENV (PYTHON=$VENV/bin/python bash research/gpu/gpu_run.sh --dry-run)"
