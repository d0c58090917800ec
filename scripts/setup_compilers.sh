#!/usr/bin/env bash
# Installs XLA's GPU and TPU compilers into .venv at the installed jax's version, for compiling a step for an
# H100/H200 or a TPU v5e/v6e on a machine without one (zinf_jax.xla, engine.compile_for; the suite's
# tests/xla). GPU: the CUDA PJRT plugin and ptxas (from the nvcc wheel); no driver or CUDA runtime is needed.
# TPU: the libtpu that jax[tpu] pins. Both must match jax exactly, so they are not extras of zinf-jax.
set -euo pipefail
cd "$(dirname "$0")/.."
V=$(.venv/bin/python -c "import jax; print(jax.__version__)")
.venv/bin/python -m pip install -q "jax-cuda12-plugin==$V" "jax-cuda12-pjrt==$V" nvidia-cuda-nvcc-cu12 "jax[tpu]==$V"
