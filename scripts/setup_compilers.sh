#!/usr/bin/env bash
# Installs XLA's GPU and TPU compilers at the installed jax's version, for compiling a step for an H100/H200 or a
# TPU v5e/v6e on a machine without one (zinf_jax.xla, engine.compile_for; the suite's tests/xla). GPU: the CUDA
# PJRT plugin and ptxas (from the nvcc wheel); no driver or CUDA runtime is needed. TPU: the libtpu that jax[tpu]
# pins. Both must match jax exactly, so they are not extras of zinf-jax.
#
# They go to .venv/xla-compilers, outside the interpreter's import path: only the child process that compiles
# (zinf_jax.xla.deviceless) sees them. Installed into site-packages they would load in every JAX process of the
# venv, which on a machine without a GPU or a TPU prints their failed start-up on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
V=$($PY -c "import jax; print(jax.__version__)")
TPU=$($PY -c "
import importlib.metadata as m, re
print(next(re.sub(r';.*', '', r).replace(' ', '') for r in m.requires('jax') if r.startswith('libtpu') and 'tpu' in r))")
# an older setup put them in site-packages: take them out of every process's way
$PY -m pip uninstall -q -y jax-cuda12-plugin jax-cuda12-pjrt libtpu nvidia-cuda-nvcc-cu12 >/dev/null 2>&1 || true
DIR=.venv/xla-compilers
if ! [ -f "$DIR/.jax-$V" ]; then
  rm -rf "$DIR"
  $PY -m pip install -q --no-deps --target "$DIR" "jax-cuda12-plugin==$V" "jax-cuda12-pjrt==$V" \
    "nvidia-cuda-nvcc-cu12>=12.6.85" "$TPU"
  touch "$DIR/.jax-$V"
fi
