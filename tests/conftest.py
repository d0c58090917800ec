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


# The order xdist hands test files to its two workers (``--dist loadfile --no-loadscope-reorder`` in
# pyproject's addopts): the slowest files first, so that the run does not end with one worker busy on a
# long file while the other idles (xdist's own reorder puts files with many tests first, which left the
# multi-process and scanned-stack files, few tests each but a minute or more, at the end). Measured
# seconds per file on the 2-core box, slowest first; files not named keep their place after these.
# Only the schedule depends on it: a stale entry costs time, never a test.
HEAVY_FIRST = (
    "tests/api/test_multiprocess.py",           # ~120 s (two multi-process jobs)
    "tests/engine/test_idioms.py",              # ~110 s
    "tests/engine/test_param_reads.py",         # ~85 s
    "tests/engine/test_compiled.py",            # ~75 s
    "tests/engine/test_scanned_stacks.py",      # ~70 s
    "tests/engine/test_engine.py",              # ~60 s
    "tests/engine/test_scanned_runs.py",        # ~50 s
    "tests/app/test_cli_deepspeed.py",          # ~50 s
    "tests/api/test_train.py",                  # ~50 s
    "tests/app/test_cli_safety.py",             # ~45 s
    "tests/api/test_workflows.py",              # ~45 s
    "tests/engine/test_fused_update.py",        # ~45 s
    "tests/api/test_estimate.py",               # ~40 s
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as collected


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
