#!/usr/bin/env bash
# Adds the benchmark extra (matplotlib, torch, DeepSpeed) to .venv, for scripts/bench_*.py.
# torch comes first as its CPU build: the default torch wheel on Linux pulls ~5 GB of CUDA
# libraries that CPU benchmarks never use. Override the source with TORCH_SPEC / TORCH_INDEX.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
TORCH_SPEC="${TORCH_SPEC:-torch}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # a local CPU wheel (pip's find-links) or the CPU index; fall back to the default index
  .venv/bin/python -m pip install -q --index-url "$TORCH_INDEX" "$TORCH_SPEC" 2>/dev/null \
    || .venv/bin/python -m pip install -q "$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | tail -1)" 2>/dev/null \
    || .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
# DeepSpeed's sdist imports torch while it builds: build it against the torch just installed.
.venv/bin/python -m pip install -q --no-build-isolation -e ".[bench]"
