"""``zinf-jax``: train | estimate | inspect | plot. Parses arguments, then calls the library.

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
import re
import sys

from zinf_jax._internal import native_memory
from zinf_jax.distributed.stop import StopAgreement
from zinf_jax.config.zero import MOMENTS_DTYPES
from zinf_jax.errors import Interrupted, NonFiniteLossError, ZinfError

__all__ = ["main", "console_main", "make_parser", "field_docs", "EXAMPLES"]

ARENAS = 2
"""glibc malloc arenas a ``zinf-jax`` process keeps (unless ``MALLOC_ARENA_MAX`` says otherwise): with the
default (8 per core) the soak's RSS crept up ~100 MB over 2,000 steps in freed fragments; see ``scripts/soak.py``."""


EXAMPLES = """examples:
  zinf-jax train                                   # the main job: GPT on nvme tiers under runs/gpt
  zinf-jax train --param-device cpu --optimizer-device cpu --steps 300 --save-every 100 --keep 2
  zinf-jax train --resume                          # continue runs/gpt from its newest good checkpoint
  zinf-jax estimate --layers 32 --hidden 4096 --devices 8 --gpu-gib 80 --host-gib 512 --disk-gib 3000
  zinf-jax inspect runs/gpt/ckpt                   # what a checkpoint (or an nvme tier directory) holds
  zinf-jax plot runs/gpt                           # loss, tokens/s and bytes per tier -> runs/gpt/metrics.png
"""


def field_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of a Google-style class docstring.

    An entry may name several fields (``d_model, n_layers, n_heads: model shape``); continuation
    lines (indented deeper) join the entry.
    """
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    entries: list[tuple[list[str], str]] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break
        if depth == indent and ":" in line:
            names, text = line.strip().split(":", 1)
            entries.append(([n.strip() for n in names.split(",")], text.strip()))
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    return {n: text for names, text in entries for n in names}


def plain(text: str) -> str:
    """Docstring markup as terminal text: ``:class:`~a.b.C``` as ``C``, ``:mod:`a.b``` as ``a.b``, ````x```` as
    ``x``."""
    text = re.sub(r":[a-z]+:`~?([^`<]*?)(?: <[^>]*>)?`", lambda m: m.group(1).rsplit(".", 1)[-1]
                  if m.group(0).split("`")[1].startswith("~") else m.group(1), text)
    return text.replace("``", "")


def _flag_help(name: str, doc: str, default: object) -> str:
    from zinf_jax.app.checks import allowed

    accepts = allowed(name)
    parts = [plain(doc.rstrip(".")) if doc else name.replace("_", " ")]
    if accepts:
        parts.append(f"accepts {accepts}")
    parts.append("default: %(default)s" if default not in (None, "") else "default: none")
    return "; ".join(parts)


_METAVARS = {"run_dir": "DIR", "nvme_dir": "DIR", "tensorboard": "DIR", "profile": "DIR", "config": "FILE",
             "deepspeed_config": "FILE", "compute_dtype": "DTYPE", "param_device": "TIER", "optimizer_device": "TIER", "nvme_update": "MODE", "optimizer_update": "WHERE", "engine": "ENGINE", "moments_dtype": "DTYPE",
             "coordinator": "HOST:PORT"}


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from zinf_jax.app.train import TrainArgs

    p = sub.add_parser("train", help="train the bundled GPT on CPython's help text (nvme tiers by default)",
                       description=plain((TrainArgs.__doc__ or "").split("\n\n")[0]))
    docs = field_docs(TrainArgs)
    for f in dataclasses.fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        text = _flag_help(f.name, docs.get(f.name, ""), f.default)
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default, help=text, metavar=_METAVARS.get(f.name) or (
                f.name.upper() if kind is str else {int: "N", float: "X"}[kind]))


def _estimate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="memory per tier (device, host, nvme) for each offload configuration")
    p.add_argument("--params", type=float, help="total parameters (e.g. 1.3e9); default: from the sizes")
    p.add_argument("--layers", type=int, help="transformer blocks (required)")
    p.add_argument("--hidden", type=int, help="model width, d_model (required)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size; default: %(default)s")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence; default: %(default)s")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (whole job); default: %(default)s")
    p.add_argument("--devices", type=int, default=8, help="accelerators in the whole job; default: %(default)s")
    p.add_argument("--processes", type=int, default=1, help="processes (hosts) the devices are spread over evenly; "
                   "host and nvme figures are per process; default: %(default)s")
    p.add_argument("--gpu-gib", type=float, help="memory per device in GiB, to report what fits (with --host-gib "
                   "and --disk-gib)")
    p.add_argument("--host-gib", type=float, help="host RAM in GiB")
    p.add_argument("--disk-gib", type=float, help="free NVMe in GiB")
    p.add_argument("--disk-gbps", type=float, help="disk bandwidth per host in GB/s: adds each configuration's disk "
                   "bytes a step and the seconds they need (the step's I/O bound)")
    p.add_argument("--device-tflops", type=float, help="compute rate one device achieves on this model in TFLOP/s "
                   "(e.g. from a plain jax.jit step of a few of its blocks): adds the predicted compute and step "
                   "seconds (the step's disk part needs --disk-gbps)")
    p.add_argument("--moments-dtype", default="float32", choices=MOMENTS_DTYPES,
                   help="Adam moments' storage; default: %(default)s")
    p.add_argument("--host-memory-limit", metavar="BYTES", help="host RAM one process may use (e.g. 8GiB, 16GB; "
                   "ZeroConfig.host_memory_limit): says per configuration whether the engine's host plan fits, the "
                   "smallest limit that does and what bounds it")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


_POSITIVE_INTS = ("layers", "hidden", "vocab", "seq", "batch", "devices", "processes")
_POSITIVE_FLOATS = ("disk_gbps", "device_tflops", "params", "gpu_gib", "host_gib", "disk_gib")


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
    if a.devices % a.processes:
        raise ValueError(f"--processes {a.processes}: must divide --devices {a.devices} (the devices are spread evenly)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zinf-jax`` console script. Returns the exit code.

    SIGINT, SIGTERM and SIGHUP are turned into a stop request first thing (see
    :mod:`zinf_jax.distributed.stop`), so no interrupt can land inside compilation.
    """
    stop = StopAgreement(fd=_stderr_fd())
    try:
        return _main(argv, stop)
    finally:
        stop.restore()


def console_main() -> int:
    """The ``zinf-jax`` console script (and ``python -m zinf_jax.app.cli``): :func:`main` in a process of its own.

    It first caps glibc's malloc arenas (:data:`ARENAS`), before XLA's and tensorstore's threads
    allocate: a process-wide setting, so :func:`main` called from your own process leaves it alone.
    """
    native_memory.limit_arenas(ARENAS)
    return main()


def make_parser() -> argparse.ArgumentParser:
    """The ``zinf-jax`` argument parser: every subcommand, every flag with its help text."""
    parser = argparse.ArgumentParser(prog="zinf-jax", description=plain(__doc__ or ""), epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _estimate_parser(sub)
    ins = sub.add_parser("inspect", help="what a checkpoint or an nvme tier directory holds")
    ins.add_argument("dir", help="a checkpoint directory (step_<N> or its parent) or an nvme tier directory")
    plot = sub.add_parser("plot", help="draw a run's loss, tokens/s and bytes per tier (needs matplotlib)")
    plot.add_argument("run_dir", help="a run directory holding metrics.jsonl (zinf-jax train --run-dir)")
    plot.add_argument("--out", help="the PNG to write; default: RUN_DIR/metrics.png")
    return parser


def _main(argv: list[str] | None, stop: StopAgreement) -> int:
    a = make_parser().parse_args(argv)
    try:
        if a.command == "train":
            return _train(a, stop, _given(argv))
        stop.restore()  # the other commands are short: a signal interrupts them the ordinary way
        stop.check("startup")
        if a.command == "inspect":
            from zinf_jax.app.inspect import inspect_dir

            print(inspect_dir(a.dir))
            return 0
        if a.command == "plot":
            from zinf_jax.app.plot import plot_run

            print(f"zinf-jax plot: wrote {plot_run(a.run_dir, a.out)}")
            return 0
        from zinf_jax.estimate import Machine, estimate_from_sizes, format_host_plans, format_report

        _check_estimate(a)
        if a.layers is None or a.hidden is None:
            raise ValueError("estimate needs --layers and --hidden (and optionally --params, --vocab, --seq, --batch)")
        from zinf_jax.config import ZeroConfig

        ests = estimate_from_sizes(None if a.params is None else int(a.params), a.layers, a.hidden, a.vocab, a.seq,
                                   a.batch, n_devices=a.devices, n_processes=a.processes, platform="gpu",
                                   config=ZeroConfig(moments_dtype=a.moments_dtype,
                                                     host_memory_limit=a.host_memory_limit))
        gib = 1 << 30
        machine = None
        if None not in (a.gpu_gib, a.host_gib, a.disk_gib):
            machine = Machine(gpu_bytes=int(a.gpu_gib * gib), host_bytes=int(a.host_gib * gib),
                              disk_bytes=int(a.disk_gib * gib), n_devices=a.devices // a.processes)
        if a.json:
            import dataclasses as dc
            rows = [dc.asdict(e) | ({"io_seconds": e.io_seconds(a.disk_gbps)} if a.disk_gbps else {})
                    | ({"step_seconds": e.step_seconds(a.device_tflops, a.disk_gbps)}
                       if a.device_tflops and (a.disk_gbps or not e.uses_disk) else {})
                    for e in ests]
            print(json.dumps(rows, indent=1, default=str))
        else:
            print(format_report(ests, machine, disk_gbps=a.disk_gbps, device_tflops=a.device_tflops))
            if a.host_memory_limit is not None:
                print(format_host_plans(ests))
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


def _given(argv: list[str] | None) -> frozenset[str]:
    """The ``train`` flags given on the command line (field names), not taken from their defaults."""
    parser = make_parser()
    train = next(act for act in parser._subparsers._group_actions if act.dest == "command").choices["train"]
    for action in train._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(sys.argv[1:] if argv is None else argv))) - {"command"}


def _train(a: argparse.Namespace, stop: StopAgreement, given: frozenset[str] | None = None) -> int:
    """``zinf-jax train``: checks every flag, then runs the main job under ``stop``."""
    from zinf_jax.app.train import TrainArgs, check_args, train

    args = TrainArgs(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainArgs)})
    check_args(args)  # before anything is built
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        import jax  # without an accelerator, train on a mesh of 8 XLA host devices (before backends start)

        jax.config.update("jax_num_cpu_devices", max(1, 8 // args.num_processes))  # the job's 8 over its processes
    if args.coordinator:
        from zinf_jax.app.job import start

        start(args.coordinator, args.num_processes, args.process_id, args.peer_timeout, args.run_dir)
    stop.check("startup")
    summary = train(args, stop=stop, given=given)
    if summary["interrupted"]:
        return summary["exit_code"]
    if stop.requested:  # it came after the last save: everything is saved, but the signal is not swallowed
        print(f"zinf-jax train: {stop.name} after the run finished (everything is saved)", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(console_main())
