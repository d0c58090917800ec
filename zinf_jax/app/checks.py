"""Up-front checks of the main job's settings: one line each, ``--flag VALUE: what is allowed``.

:func:`check_args` looks at the flags alone and runs before anything is built;
:func:`check_batch` needs the device count and the config (gradient
accumulation), so it runs once those are known, still before the run dir is
touched.
"""
from __future__ import annotations

import math
from typing import Any

from zinf_jax.config.zero import COMPUTE_DTYPES, DEVICES as TIERS, ENGINES, MOMENTS_DTYPES

__all__ = ["check_args", "check_batch", "flag", "allowed"]

# field -> (minimum, what is allowed)
_INTS = {
    "steps": (1, "a positive integer (the optimizer step to reach)"),
    "batch": (1, "a positive integer (sequences per step)"),
    "seq": (1, "a positive integer (tokens per sequence)"),
    "d_model": (1, "a positive integer"),
    "n_layers": (1, "a positive integer"),
    "n_heads": (1, "a positive integer that divides --d-model"),
    "warmup": (0, "an integer >= 0 (warmup steps)"),
    "save_every": (0, "an integer >= 0 (steps between checkpoints; 0: only at the end and on a signal)"),
    "keep": (0, "an integer >= 0 (the newest checkpoints to keep; 0 keeps all)"),
    "seed": (0, "an integer >= 0"),
    "gradient_accumulation_steps": (1, "a positive integer (micro-batches per optimizer step)"),
    "persistence_threshold": (0, "an integer >= 0 (elements)"),
    "log_every": (1, "a positive integer (steps between progress lines when not on a terminal)"),
    "num_processes": (1, "a positive integer (processes in the job)"),
    "process_id": (0, "an integer >= 0 (this process's index in the job)"),
    "peer_timeout": (1, "a positive integer (seconds)"),
}
# field -> (lowest allowed, the lowest excluded, what is allowed)
_FLOATS = {
    "lr": (0.0, True, "a finite number > 0"),
    "weight_decay": (0.0, False, "a finite number >= 0"),
    "clip": (0.0, False, "a finite number >= 0 (0: no clipping)"),
}


def flag(field: str) -> str:
    """The command-line flag of a ``TrainArgs`` field (``save_every`` -> ``--save-every``)."""
    return "--" + field.replace("_", "-")


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{flag(field)} {value}: must be {allowed}")


def _check_int(field: str, v: Any) -> None:
    low, allowed = _INTS[field]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(field, v, allowed)


def _check_float(field: str, v: Any) -> None:
    low, strict, allowed = _FLOATS[field]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < low or (strict and v == low):
        raise _bad(field, v, allowed)


def check_args(args: Any) -> None:
    """Checks every setting that needs nothing else (see module doc).

    Raises:
      ValueError: ``--flag VALUE: must be ...`` for the first bad one.
    """
    for field in _INTS:
        _check_int(field, getattr(args, field))
    for field in _FLOATS:
        _check_float(field, getattr(args, field))
    if args.d_model % args.n_heads:
        raise _bad("n_heads", args.n_heads, f"a divisor of --d-model {args.d_model}")
    from zinf_jax.app.models import corpus

    longest = len(corpus()) - 2
    if args.seq > longest:
        raise _bad("seq", args.seq, f"at most {longest} (the training text holds {longest + 2} bytes)")
    for field in ("param_device", "optimizer_device"):
        if getattr(args, field) not in TIERS:
            raise _bad(field, getattr(args, field), "one of " + ", ".join(TIERS))
    if args.nvme_update not in ("in_place", "double_slot"):
        raise _bad("nvme_update", args.nvme_update, "in_place or double_slot")
    if args.optimizer_update not in ("host", "device"):
        raise _bad("optimizer_update", args.optimizer_update, "host or device")
    if args.engine not in ENGINES:
        raise _bad("engine", args.engine, "one of " + ", ".join(ENGINES))
    if args.compute_dtype is not None and args.compute_dtype not in COMPUTE_DTYPES:
        raise _bad("compute_dtype", args.compute_dtype, "one of " + ", ".join(COMPUTE_DTYPES))
    if args.moments_dtype not in MOMENTS_DTYPES:
        raise _bad("moments_dtype", args.moments_dtype, " or ".join(MOMENTS_DTYPES))
    if not str(args.run_dir):
        raise _bad("run_dir", repr(args.run_dir), "a directory")
    if args.resume and args.overwrite:
        raise ValueError("--overwrite: cannot be combined with --resume (--resume continues the run in --run-dir, "
                         "--overwrite deletes it and starts over)")
    if args.config and args.deepspeed_config:
        raise ValueError("--config and --deepspeed-config: give one of them, not both")
    _check_processes(args)
    if args.tensorboard is not None:
        if not str(args.tensorboard):
            raise _bad("tensorboard", repr(args.tensorboard), "a directory")
        _check_tensorboard(args.tensorboard)


def _check_processes(args: Any) -> None:
    if args.process_id >= args.num_processes:
        raise _bad("process_id", args.process_id, f"less than --num-processes {args.num_processes} (0 to "
                                                  f"{args.num_processes - 1})")
    coord = args.coordinator
    if not coord:
        if args.num_processes > 1 or args.process_id:
            raise ValueError(f"--num-processes {args.num_processes} --process-id {args.process_id}: a multi-process "
                             "job needs --coordinator HOST:PORT (process 0's address, the same on every process) "
                             "or --coordinator auto")
        return
    if coord != "auto":
        host, _, port = coord.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad("coordinator", coord, "HOST:PORT (e.g. localhost:12345; process 0's address) or auto")
        if args.num_processes == 1:
            raise ValueError(f"--coordinator {coord}: give --num-processes (the job's process count) and "
                             "--process-id (this one's) with it")


def _check_tensorboard(logdir: str) -> None:
    """Raises ValueError naming what to install unless a TensorBoard writer package is importable."""
    import importlib.util

    if importlib.util.find_spec("tensorboardX") is None and importlib.util.find_spec("torch") is None:
        raise ValueError(f"--tensorboard {logdir}: needs tensorboardX (pip install 'zinf-jax[tensorboard]') "
                         "or PyTorch with tensorboard; neither is installed")


def allowed(field: str) -> str | None:
    """What a ``TrainArgs`` field accepts, in words (for the CLI's help), or None if anything goes."""
    if field in _INTS:
        return _INTS[field][1].split(" (")[0]
    if field in _FLOATS:
        return _FLOATS[field][2].split(" (")[0]
    if field in ("param_device", "optimizer_device"):
        return "one of " + ", ".join(TIERS)
    if field == "nvme_update":
        return "in_place or double_slot"
    if field == "optimizer_update":
        return "host or device"
    if field == "engine":
        return "one of " + ", ".join(ENGINES)
    if field == "moments_dtype":
        return " or ".join(MOMENTS_DTYPES)
    if field == "compute_dtype":
        return "one of " + ", ".join(COMPUTE_DTYPES)
    return None


def check_batch(args: Any, config: Any) -> None:
    """Checks that ``--batch`` splits over this process's devices and the accumulation steps.

    Raises:
      ValueError: ``--batch VALUE: must be a positive multiple of N (...)``.
    """
    import jax

    n, k = jax.local_device_count(), config.gradient_accumulation_steps
    if args.batch % (n * k):
        why = f"{n} devices" + (f" x {k} gradient accumulation steps" if k > 1 else "")
        raise _bad("batch", args.batch, f"a positive multiple of {n * k} (the batch is split over {why})")
