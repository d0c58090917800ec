"""``zinf-jax``: train | estimate | inspect. Parses arguments, then calls the library."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

__all__ = ["main"]


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from zinf_jax.train import TrainArgs

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zinf-jax`` console script. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="zinf-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _estimate_parser(sub)
    ins = sub.add_parser("inspect", help="what a checkpoint or an nvme tier directory holds")
    ins.add_argument("dir")
    a = parser.parse_args(argv)
    from zinf_jax.checkpoint import CheckpointError
    from zinf_jax.config import ConfigError
    from zinf_jax.engine.store import ParamMismatchError
    from zinf_jax.tiers import TierError
    from zinf_jax.units import UnitPolicyError

    if a.command == "train" and "JAX_NUM_CPU_DEVICES" not in os.environ:
        import jax  # without an accelerator, train on a mesh of 8 XLA host devices (before backends start)

        jax.config.update("jax_num_cpu_devices", 8)
    try:
        if a.command == "train":
            from zinf_jax.train import TrainArgs, train

            kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainArgs)}
            summary = train(TrainArgs(**kw))
            return 130 if summary["interrupted"] else 0
        if a.command == "inspect":
            from zinf_jax.inspect import inspect_dir

            print(inspect_dir(a.dir))
            return 0
        from zinf_jax.estimate import Machine, estimate_from_sizes, format_report

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
    except (ConfigError, TierError, CheckpointError, ParamMismatchError, UnitPolicyError, ValueError, OSError) as e:
        print(f"zinf-jax {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
