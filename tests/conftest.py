"""Test setup: every test sees a CPU mesh of 8 XLA host devices.

Layout: ``tests/<package>/test_*.py`` test the package of that name (``config``, ``plan``,
``tiers``, ``optim``, ``engine``, ``checkpoint``; ``api`` the public API and the estimator,
``app`` the CLI and main job), ``tests/test_layout.py`` the import layering;
``tests/helpers/`` holds shared models and helpers (``import helpers.engine_utils``),
``tests/workers/`` the scripts that subprocess tests run.

The device count must be fixed before JAX initialises its backends, so it is
set here, at import time, before any test module imports jax.
"""
import atexit
import os
import shutil
import sys
import tempfile

# Tests sit in one folder per package (tests/engine/, tests/tiers/, ...); their shared models and
# helpers in tests/helpers/, the scripts subprocess tests launch in tests/workers/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests check numbers, layouts and compile counts of small programs, not the speed of the code XLA:CPU
# generates, and LLVM's optimisation passes are a large part of compiling a step there: compile at LLVM's
# level 1. (Level 0 also drops the fused multiply-adds that levels 1 to 3 emit, so XLA's Adam no longer
# rounds as the host kernel does: the tests that compare the two bit for bit would then fail.) Fusions are
# emitted by XLA:CPU's classic LLVM IR emitters, not its MLIR fusion emitters, which take about a third more
# of a small step's compile time; and LLVM unrolls no loops (-unroll-threshold=0): with the classic emitters
# it unrolled every reduction of a parameter penalty's loop fusion, and compiling that one step took 30 s.
# (Subprocesses the tests start get the same flags: helpers.procs.job_env.)
from helpers.procs import TEST_XLA_FLAGS  # noqa: E402

if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# Many tests build engines of the same small models: share their compiled programs
# through a persistent compilation cache that lives for this test run only. The
# process that starts pytest makes it and names it in the environment, so the xdist
# workers it spawns (and their files' alike models) share it too; it removes it at exit.
_CACHE = os.environ.get("ZINF_TEST_SESSION_CACHE")
if _CACHE is None:
    _CACHE = os.environ["ZINF_TEST_SESSION_CACHE"] = tempfile.mkdtemp(prefix="zinf-test-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def no_persistent_cache():
    """Compile for real (tests that count compilations)."""
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


@pytest.fixture(scope="session")
def n_devices() -> int:
    """Number of XLA host devices the tests run on."""
    assert len(jax.devices()) == 8, "conftest must set JAX_NUM_CPU_DEVICES=8 before JAX starts"
    return len(jax.devices())
