"""Test setup: every test sees a CPU mesh of 8 XLA host devices.

The device count must be fixed before JAX initialises its backends, so it is
set here, at import time, before any test module imports jax.
"""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def n_devices() -> int:
    """Number of XLA host devices the tests run on."""
    assert len(jax.devices()) == 8, "conftest must set JAX_NUM_CPU_DEVICES=8 before JAX starts"
    return len(jax.devices())
