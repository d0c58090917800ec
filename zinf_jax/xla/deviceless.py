"""A step's program compiled by XLA's GPU or TPU compiler on a machine without the accelerator.

On the CPU backend a move between host and device memory is a no-op, so a CPU mesh cannot show whether an
offloaded program is one an accelerator's compiler accepts, what it moves, and whether the moves overlap
compute. XLA's compilers answer that without the hardware: the CUDA plugin compiles for a GPU described
by :mod:`zinf_jax.xla.targets`, libtpu's compile-only client for a TPU topology. Both need their wheels at the
installed jax's version: ``scripts/setup_compilers.sh`` puts them in ``.venv/xla-compilers``
(:func:`compilers_dir`), outside the interpreter's import path, so that only the child that compiles loads
them; installed in site-packages instead, they are found there.

:func:`compile_programs` takes programs lowered on this machine for the target's platform
(``engine.lower(batch, platforms=("cuda",))``), compiles them in a child process
(:mod:`zinf_jax.xla.worker`: a compiler that hangs or aborts takes only that process with it, under a
time limit and a cap on what it logs), and returns one :class:`CompiledProgram` per program: whether it
compiled, XLA's warnings, and the compiled program's transfers, overlap, host compute and reductions
(:mod:`zinf_jax.xla.hlo`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from zinf_jax.xla import hlo
from zinf_jax.xla.targets import Target, target as find_target

__all__ = ["CompiledProgram", "compile_programs", "available", "compilers_dir", "HOST_COMPUTE_WARNINGS"]

HOST_COMPUTE_WARNINGS = ("does device compute in host memory space", "does not move the tensor back to device",
                         "converted into host compute")
"""Phrases of XLA's HostOffloader warnings: device work on a host-memory value, turned into host compute."""

_LOG_CAP = 64 << 20
"""Bytes of compiler log a job may write before the child is stopped (libtpu, failing, writes gigabytes)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledProgram:
    """One program as an accelerator's compiler left it.

    Attributes:
      target: the target's name.
      label: the caller's name for the program.
      ok: it compiled (within the time limit).
      error: why not (the compiler's error, a time-out, a crash), else ``None``.
      seconds: compile time.
      warnings: XLA's HostOffloader warnings (device compute on host memory), one per line.
      hlo_text: the compiled, scheduled HLO (empty if it did not compile).
      memory: the compiled program's memory statistics (bytes per device), if the client gives them.
    """

    target: str
    label: str
    ok: bool
    error: str | None
    seconds: float
    warnings: tuple[str, ...]
    hlo_text: str
    memory: Mapping[str, int] | None

    @functools.cached_property
    def module(self) -> hlo.Module:
        """The parsed compiled program."""
        return hlo.parse(self.hlo_text)

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        """Transfers, overlap, host compute and reduction types (:func:`zinf_jax.xla.hlo.summary`), and
        :attr:`ok`, :attr:`error` and :attr:`warnings`."""
        out: dict[str, Any] = {"target": self.target, "program": self.label, "ok": self.ok, "error": self.error,
                               "seconds": round(self.seconds, 2), "warnings": len(self.warnings)}
        if self.ok:
            out.update(hlo.summary(self.module))
        return out

    @property
    def clean(self) -> bool:
        """Compiled, no HostOffloader warning, no host compute in the program."""
        return self.ok and not self.warnings and not hlo.host_compute(self.module)


def compilers_dir() -> Path | None:
    """The folder holding XLA's GPU and TPU compilers apart from site-packages: ``$ZINF_XLA_COMPILERS``, else
    ``xla-compilers`` in the running environment (``.venv/xla-compilers``, where ``scripts/setup_compilers.sh``
    puts them); ``None`` if it does not exist."""
    d = Path(os.environ.get("ZINF_XLA_COMPILERS") or Path(sys.prefix) / "xla-compilers")
    return d if d.is_dir() else None


def _has(*parts: str) -> bool:
    """Whether the package folder ``parts`` (``"nvidia", "cuda_nvcc"``) is in :func:`compilers_dir` or importable."""
    d = compilers_dir()
    if d is not None and d.joinpath(*parts).is_dir():
        return True
    try:
        return importlib.util.find_spec(".".join(parts)) is not None
    except ImportError:  # a parent package that is not there
        return False


def available(t: Target | str) -> str | None:
    """``None`` if this machine can compile for ``t``, else what to install."""
    t = find_target(t) if isinstance(t, str) else t
    import jax

    v = jax.__version__
    if t.platform == "cuda":
        if not _has("jax_plugins", "xla_cuda12"):
            return f"the CUDA plugin: jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} (scripts/setup_compilers.sh)"
        if not _has("nvidia", "cuda_nvcc"):
            return "ptxas: nvidia-cuda-nvcc-cu12 (scripts/setup_compilers.sh)"
        return None
    if not _has("libtpu"):
        return f"libtpu: the one 'jax[tpu]=={v}' pins (scripts/setup_compilers.sh)"
    return None


def _env(t: Target) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"  # the compile-only client is made from the topology, not a backend
    d = compilers_dir()
    if d is not None:  # the child alone imports the compilers
        env["PYTHONPATH"] = os.pathsep.join([str(d), *filter(None, [os.environ.get("PYTHONPATH")])])
    if t.platform == "tpu":
        env["TPU_ACCELERATOR_TYPE"] = t.tpu_accelerator_type or ""
        env["TPU_WORKER_HOSTNAMES"] = "localhost"
        env["LIBTPU_INIT_ARGS"] = "--logtostderr"  # never log files without bound
        env["TPU_SKIP_MDS_QUERY"] = "1"
        # The compile-only client holds no chip, so compiles may run side by side (pytest workers): without
        # this, libtpu's single-process lock (/tmp/libtpu_lockfile) aborts every process but the first.
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    return env


def compile_programs(programs: Sequence[tuple[str, Any]], t: Target | str, *,
                     options: Mapping[str, Any] | None = None, timeout: float = 180.0) -> list[CompiledProgram]:
    """Compiles each ``(label, lowered)`` for the target ``t`` in a child process.

    Args:
      programs: labels and ``jax.stages.Lowered`` programs lowered for ``t``'s platform
        (``lowering_platforms=(t.platform,)``; ``engine.lower(batch, platforms=...)``).
      t: the target or its name (:data:`zinf_jax.xla.targets.TARGETS`).
      options: XLA options to compile with (as ``Lowered.compile(compiler_options=...)``); the same for all.
        A program lowered by the engine carries its own: pass them with ``options`` (see
        :func:`zinf_jax.engine.compiled.compiler_options`).
      timeout: seconds each program may take to compile.

    Returns:
      One result per program, in order.

    Raises:
      RuntimeError: the target's compiler is not installed (the message says what to install).
    """
    from zinf_jax._internal.jax_private import lowered_program

    t = find_target(t) if isinstance(t, str) else t
    missing = available(t)
    if missing is not None:
        raise RuntimeError(f"cannot compile for {t.name} here: install {missing}")
    with tempfile.TemporaryDirectory(prefix=f"zinf-xla-{t.name}-") as folder:
        jobs = []
        for k, (label, lowered) in enumerate(programs):
            job = f"job{k}"
            prog = lowered_program(lowered)
            with open(os.path.join(folder, job + ".program"), "wb") as f:
                f.write(prog.pop("bytecode"))
            with open(os.path.join(folder, job + ".json"), "w") as f:
                json.dump({**prog, "options": dict(options or {}), "label": label}, f)
            jobs.append((job, label))
        with open(os.path.join(folder, "request.json"), "w") as f:
            json.dump({"target": t.name, "jobs": [j for j, _ in jobs]}, f)
        _run(folder, [j for j, _ in jobs], t, timeout)
        return [_result(folder, job, label, t) for job, label in jobs]


def _run(folder: str, jobs: list[str], t: Target, timeout: float) -> None:
    """Runs the worker until every job is done, restarting it after a job that hung or crashed it."""
    while True:
        pending = [j for j in jobs if not os.path.exists(os.path.join(folder, j + ".done"))]
        if not pending:
            return
        proc = subprocess.Popen([sys.executable, "-m", "zinf_jax.xla.worker", folder], env=_env(t),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        current, started = None, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.2)
            now_pending = [j for j in jobs if not os.path.exists(os.path.join(folder, j + ".done"))]
            if not now_pending:
                break
            if now_pending[0] != current:
                current, started = now_pending[0], time.monotonic()
            log = os.path.join(folder, current + ".log")
            size = os.path.getsize(log) if os.path.exists(log) else 0
            why = ("timed out" if time.monotonic() - started > timeout else
                   "logged over 64 MiB" if size > _LOG_CAP else None)
            if why:
                proc.kill()
                proc.wait()
                _fail(folder, current, f"the compiler {why} (after {time.monotonic() - started:.0f} s)")
                break
        proc.wait()
        if proc.returncode not in (0, None, -9):
            after = [j for j in jobs if not os.path.exists(os.path.join(folder, j + ".done"))]
            if after:  # the job in progress crashed the process
                stderr = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")[-2000:]
                _fail(folder, after[0], f"the compiler crashed the process (exit {proc.returncode}): "
                                        f"{_tail(os.path.join(folder, after[0] + '.log')) or stderr}")
        if proc.stderr:
            proc.stderr.close()


def _tail(path: str, n: int = 3000) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(l for l in lines if "Check failed" in l or "RET_CHECK" in l or "Error" in l)[-1500:] or \
        "\n".join(lines[-5:])


def _fail(folder: str, job: str, why: str) -> None:
    with open(os.path.join(folder, job + ".done"), "w") as f:
        json.dump({"ok": False, "error": why, "seconds": 0.0}, f)


def _result(folder: str, job: str, label: str, t: Target) -> CompiledProgram:
    with open(os.path.join(folder, job + ".done")) as f:
        res = json.load(f)
    text = ""
    if res.get("ok") and os.path.exists(os.path.join(folder, job + ".hlo")):
        with open(os.path.join(folder, job + ".hlo")) as f:
            text = f.read()
    warnings = []
    log = os.path.join(folder, job + ".log")
    if os.path.exists(log):
        with open(log, "rb") as f:
            for line in f.read(_LOG_CAP).decode(errors="replace").splitlines():
                if any(p in line for p in HOST_COMPUTE_WARNINGS):
                    warnings.append(line.strip())
    return CompiledProgram(target=t.name, label=label, ok=bool(res.get("ok")), error=res.get("error"),
                           seconds=float(res.get("seconds", 0.0)), warnings=tuple(warnings), hlo_text=text,
                           memory=res.get("memory"))
