#!/usr/bin/env bash
# Creates .venv (once) and installs zinf-jax with its test extra into it, and XLA's GPU and TPU compilers at
# the jax version it got (scripts/setup_compilers.sh: the suite compiles steps for them without the hardware).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
bash scripts/setup_compilers.sh
