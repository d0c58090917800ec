"""``zinf-jax``: train | estimate | inspect. Parses arguments, then calls the library.

Exit status: 0 done; 1 the run failed (final loss non-finite, loss scale
underflow); 2 bad input (a flag, a config, a checkpoint, a locked or reused run
dir, a tier error); ``128 + signal`` stopped by SIGINT (130), SIGHUP (129) or
SIGTERM (143): after the step in progress, with a checkpoint, or during startup
with nothing saved.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from zinf_jax.app.interrupts import StopRequest
from zinf_jax.errors import Interrupted, NonFiniteLossError, ZinfError

__all__ = ["main"]


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from zinf_jax.app.train import TrainArgs

    p = sub.add_parser("train", help="train the bundled GPT on CPython's help text (nvme tiers by default)")
    for f in dataclasses.fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default)


def _estimate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="memory per tier (device, host, nvme) for each offload configuration")
    p.add_argument("--params", type=float, help="total parameters (e.g. 1.3e9)")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (whole job)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--gpu-gib", type=float, help="memory per device, to report what fits")
    p.add_argument("--host-gib", type=float, help="host RAM")
    p.add_argument("--disk-gib", type=float, help="free NVMe")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


_POSITIVE_INTS = ("layers", "hidden", "vocab", "seq", "batch", "devices")
_POSITIVE_FLOATS = ("params", "gpu_gib", "host_gib", "disk_gib")


def _check_estimate(a: argparse.Namespace) -> None:
    """``--flag VALUE: must be ...`` for the first bad ``estimate`` flag."""
    for name in _POSITIVE_INTS:
        v = getattr(a, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} {v}: must be a positive integer")
    for name in _POSITIVE_FLOATS:
        v = getattr(a, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name.replace('_', '-')} {v}: must be a finite number > 0")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zinf-jax`` console script. Returns the exit code.

    SIGINT, SIGTERM and SIGHUP are turned into a stop request first thing (see
    :mod:`zinf_jax.app.interrupts`), so no interrupt can land inside compilation.
    """
    stop = StopRequest(fd=_stderr_fd()).install()
    try:
        return _main(argv, stop)
    finally:
        stop.restore()


def _main(argv: list[str] | None, stop: StopRequest) -> int:
    parser = argparse.ArgumentParser(prog="zinf-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _estimate_parser(sub)
    ins = sub.add_parser("inspect", help="what a checkpoint or an nvme tier directory holds")
    ins.add_argument("dir")
    a = parser.parse_args(argv)
    try:
        if a.command == "train":
            return _train(a, stop)
        stop.restore()  # the other commands are short: a signal interrupts them the ordinary way
        stop.check("startup")
        if a.command == "inspect":
            from zinf_jax.app.inspect import inspect_dir

            print(inspect_dir(a.dir))
            return 0
        from zinf_jax.estimate import Machine, estimate_from_sizes, format_report

        _check_estimate(a)
        if a.layers is None or a.hidden is None:
            raise ValueError("estimate needs --layers and --hidden (and optionally --params, --vocab, --seq, --batch)")
        ests = estimate_from_sizes(None if a.params is None else int(a.params), a.layers, a.hidden, a.vocab, a.seq,
                                   a.batch, n_devices=a.devices, platform="gpu")
        gib = 1 << 30
        machine = None
        if None not in (a.gpu_gib, a.host_gib, a.disk_gib):
            machine = Machine(gpu_bytes=int(a.gpu_gib * gib), host_bytes=int(a.host_gib * gib),
                              disk_bytes=int(a.disk_gib * gib), n_devices=a.devices)
        if a.json:
            import dataclasses as dc
            print(json.dumps([dc.asdict(e) for e in ests], indent=1, default=str))
        else:
            print(format_report(ests, machine))
        return 0
    except Interrupted as e:
        print(f"zinf-jax {a.command}: {e}", file=sys.stderr)
        return e.exit_code
    except (NonFiniteLossError, FloatingPointError) as e:  # the run failed: diverged, loss-scale underflow
        print(f"zinf-jax {a.command}: error: {e}", file=sys.stderr)
        return 1
    except (ZinfError, ValueError, OSError) as e:  # bad input: a flag, a config, a checkpoint, a tier, the run dir
        print(f"zinf-jax {a.command}: error: {e}", file=sys.stderr)
        return 2


def _train(a: argparse.Namespace, stop: StopRequest) -> int:
    """``zinf-jax train``: checks every flag, then runs the main job under ``stop``."""
    from zinf_jax.app.train import TrainArgs, check_args, train

    args = TrainArgs(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainArgs)})
    check_args(args)  # before anything is built
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        import jax  # without an accelerator, train on a mesh of 8 XLA host devices (before backends start)

        jax.config.update("jax_num_cpu_devices", 8)
    stop.check("startup")
    summary = train(args, stop=stop)
    if summary["interrupted"]:
        return summary["exit_code"]
    if stop.requested:  # it came after the last save: everything is saved, but the signal is not swallowed
        print(f"zinf-jax train: {stop.name} after the run finished (everything is saved)", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
