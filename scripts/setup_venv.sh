#!/usr/bin/env bash
# Create (or reuse) the development environment in .venv/ at the repository root.
# Installs the CPU build of torch pinned to 2.13.0 first, so that no later requirement pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.simstream-installed"
want="$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16)"
if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    # Prefer a CPU wheel the machine already offers (pip's find-links); otherwise ask PyTorch's CPU index.
    if "$PY" -m pip download --quiet --no-deps --no-index -d "$(mktemp -d)" "torch==2.13.0" 2>/dev/null; then
        "$PY" -m pip install --quiet "torch==2.13.0"
    else
        "$PY" -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
# The optional integrations (Ray, the LeRobot format) are installed too, so that their tests run.
"$PY" -m pip install --quiet -e ".[dev,ray,lerobot]"
echo "$want" > "$STAMP"
