"""Launching the processes of a multi-process test job and reading what they print."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"


def free_port() -> int:
    """A localhost port nothing listens on (for a job's coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


TEST_XLA_FLAGS = ("--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false "
                  "--xla_backend_extra_options=-unroll-threshold=0")
"""What the test process compiles with (see tests/conftest.py), for the processes it starts."""


def job_env(jax_cache: bool = False, devices: int | None = None) -> dict[str, str]:
    """This environment without JAX_/XLA_ settings (each worker sets its own devices) but the tests' compile
    flags (:data:`TEST_XLA_FLAGS`); ``devices`` sets the processes' CPU device count
    (``JAX_NUM_CPU_DEVICES``); ``jax_cache`` passes the test run's compilation cache directory on
    (``ZINF_TEST_JAX_CACHE``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    if devices is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
    if jax_cache:
        import jax

        env["ZINF_TEST_JAX_CACHE"] = jax.config.jax_compilation_cache_dir or ""
    return env


def use_session_jax_cache() -> None:
    """In a worker: compiles through the test run's compilation cache (``ZINF_TEST_JAX_CACHE``, see
    :func:`job_env`), every program cached, as in the test process; nothing if it is not set."""
    cache = os.environ.get("ZINF_TEST_JAX_CACHE")
    if cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def start(argvs: list[list[str]], env: dict[str, str]) -> list[subprocess.Popen]:
    """One Python process per argv (``[script or -m module, args...]``), output captured."""
    return [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             text=True) for argv in argvs]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Waits for every process; each must exit 0 (else its stderr's tail is the failure). Their (stdout, stderr)."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append((out, err))
    return outs


def last_json(procs: list[subprocess.Popen], timeout: float = 400) -> list[dict]:
    """:func:`finish`, then each process's last stdout line as JSON."""
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in finish(procs, timeout)]
