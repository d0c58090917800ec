"""``host_memory_limit`` against the kernel: a child process held to a memory cgroup cap equal to its limit
trains to completion; one under a cap below its plan's minimum is refused up front (exit 2, nothing written).
And ``zinf-jax estimate --host-memory-limit``.

The cgroup test needs root and a cgroup v1 memory controller (``/sys/fs/cgroup/memory``); it is skipped with
the reason elsewhere.
"""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers.procs import WORKERS, job_env
from zinf_jax.app.cli import main

MEMCG = Path("/sys/fs/cgroup/memory")
MODEL = ["512", "2", "2", "8"]  # d_model, layers, steps, devices: a small model (13M params), two steps


def _why_no_memcg() -> str | None:
    if not (MEMCG / "memory.limit_in_bytes").exists():
        return "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    if not os.access(MEMCG, os.W_OK):
        return "the memory cgroup hierarchy is not writable (needs root)"
    return None


needs_memcg = pytest.mark.skipif(_why_no_memcg() is not None, reason=_why_no_memcg() or "")


class Capped:
    """A memory cgroup of its own for one child process, capped at ``cap`` bytes (swap included where the
    kernel accounts it); removed on exit."""

    def __init__(self, cap: int):
        self.dir = MEMCG / f"zinf_test_{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        (self.dir / "memory.limit_in_bytes").write_text(str(cap))
        memsw = self.dir / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(cap))

    def run(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        procs = str(self.dir / "cgroup.procs")

        def enter() -> None:  # in the child, before exec: everything it allocates is charged to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                              env=job_env(jax_cache=True), preexec_fn=enter)

    def read(self, name: str) -> int:
        return int((self.dir / name).read_text())

    def __enter__(self) -> "Capped":
        return self

    def __exit__(self, *exc) -> None:
        self.dir.rmdir()


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@needs_memcg
def test_a_child_capped_at_its_host_memory_limit_trains_and_one_below_its_plan_is_refused_up_front(tmp_path):
    limit = 5 << 28  # 1.25 GiB
    with Capped(limit) as group:
        ok = group.run([str(WORKERS / "host_limit_worker.py"), str(tmp_path / "ok"), str(limit), *MODEL])
        peak, kills = group.read("memory.max_usage_in_bytes"), group.read("memory.failcnt")
    assert ok.returncode == 0, f"exit {ok.returncode} (-9: killed past the cap; peak {peak}):\n{ok.stderr[-3000:]}"
    out = json.loads(ok.stdout.strip().splitlines()[-1])
    assert len(out["losses"]) == 2 and all(x == x for x in out["losses"])
    assert (tmp_path / "ok" / "ckpt").exists() and peak <= limit, (peak, kills)
    assert out["runtime"] < out["plan_minimum"] <= out["plan_total"] <= limit

    # a cap (and limit) above what the process needs to start, below the plan's minimum: refused before any write
    low = (out["runtime"] + out["plan_minimum"]) // 2
    with Capped(low + (64 << 20)) as group:  # the cap leaves the interpreter room to print its refusal
        refused = group.run([str(WORKERS / "host_limit_worker.py"), str(tmp_path / "low"), str(low), *MODEL])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "host_memory_limit" in refused.stderr and "at least" in refused.stderr, refused.stderr[-3000:]
    assert _files(tmp_path / "low") == [], _files(tmp_path / "low")


def test_estimate_says_whether_the_host_plan_fits_the_limit_and_what_bounds_it(capsys):
    args = ["estimate", "--layers", "32", "--hidden", "1024", "--vocab", "256", "--seq", "64", "--devices", "8"]
    assert main([*args, "--host-memory-limit", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "(nvme, nvme) host: fits 4.0 GiB" in out and "(cpu, cpu) host: does not fit 4.0 GiB" in out
    assert "smallest limit that fits" in out and "bounded by: resident_tiers" in out  # cpu tiers hold the state
    assert main([*args, "--host-memory-limit", "lots"]) == 2
    assert "host_memory_limit" in capsys.readouterr().err
