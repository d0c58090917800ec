"""What a checkpoint or an nvme tier directory holds, as readable text.

A damaged tier manifest is reported as the tier's own
:class:`~zinf_jax.tiers.base.TierDataError`, which names the file and what to
do; this module never lets a bare decode error through.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from zinf_jax.checkpoint import format as fmt
from zinf_jax.checkpoint.restore import latest_step_dir, read_meta
from zinf_jax.errors import CheckpointError
from zinf_jax.tiers.base import ShardSpec
from zinf_jax.tiers.nvme import MANIFEST, read_manifest

__all__ = ["inspect_dir", "describe_checkpoint", "describe_tier"]


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(l) for l in lines))
    return "\n".join(lines)


def describe_checkpoint(step_dir: Path) -> str:
    """Step, optimizer counters, user state and the parameter table of a checkpoint."""
    meta = read_meta(step_dir)
    unit_of = {p: k for k, g in enumerate(meta["groups"]) for p in g}
    rows = [("group", "parameter", "shape", "dtype", "bytes (fp32 master+m+v)")]
    total = 0
    for path, (shape, dtype) in meta["params"].items():
        b = math.prod(shape) * 4 * 3
        total += b
        rows.append((str(unit_of.get(path, "?")), path, str(tuple(shape)), dtype, f"{b:,}"))
    opt = meta.get("optimizer", {})
    cfg = meta.get("config", {})
    head = [
        f"checkpoint {step_dir}",
        f"  step {meta['step']}  applied {opt.get('count')}  skipped {opt.get('skipped')}  "
        f"loss scaler {opt.get('loss_scaler')}",
        f"  saved from tiers: param={cfg.get('offload_param', {}).get('device')} "
        f"optimizer={cfg.get('offload_optimizer', {}).get('device')}",
        f"  {len(meta['params'])} parameters in {len(meta['groups'])} groups, {total:,} bytes of optimizer state",
        f"  user state: {meta.get('user_state')}",
    ]
    return "\n".join(head) + "\n" + _table(rows)


def describe_tier(tier_dir: Path) -> str:
    """Keys, shard layouts, checksums, generation and metadata of nvme tier directories.

    Raises:
      TierDataError: a manifest is damaged.
    """
    out = []
    for proc in sorted(tier_dir.rglob(MANIFEST)):
        man = read_manifest(proc.parent)
        rows = [("key", "shards (local/total)", "shard shape", "dtype", "bytes", "slot", "checksums")]
        total = 0
        for key, v in man["keys"].items():
            spec = ShardSpec.from_json(v["spec"])
            b = spec.shard_nbytes * len(v["local"])
            total += b
            rows.append((key, f"{len(v['local'])}/{spec.num_shards}", str(spec.shard_shape), spec.dtype, f"{b:,}",
                         str(v["slot"]) + (f" ({v['pack']})" if "pack" in v else ""),
                         "yes" if v.get("checksums") is not None else "no"))
        meta = {k: v for k, v in man.get("metadata", {}).items()}
        out.append(f"nvme tier {proc.parent}: generation {man['generation']}, {len(man['keys'])} keys, "
                   f"{total:,} committed bytes, metadata {meta}\n" + (_table(rows) if len(rows) > 1 else ""))
    if not out:
        raise CheckpointError(f"{str(tier_dir)!r} holds neither a zinf_jax checkpoint nor an nvme tier")
    return "\n\n".join(out + _coverage(sorted(tier_dir.rglob(MANIFEST))))


def _coverage(manifests: list[Path]) -> list[str]:
    """Per tier held by several processes (a multi-process job's ``process_<I>`` parts): whether every shard
    of every sharded key is held by exactly one of them."""
    by_root: dict[Path, list[dict]] = {}
    for m in manifests:
        by_root.setdefault(m.parent.parent, []).append(read_manifest(m.parent))
    lines = []
    for root, mans in by_root.items():
        if len(mans) < 2:
            continue
        held: dict[str, list[int]] = {}
        total: dict[str, int] = {}
        for man in mans:
            for key, v in man["keys"].items():
                n = ShardSpec.from_json(v["spec"]).num_shards
                if n > 1:
                    total[key] = n
                    held.setdefault(key, []).extend(v["local"])
        bad = [f"{k} (held: {sorted(h)} of {total[k]})" for k, h in held.items() if sorted(h) != list(range(total[k]))]
        lines.append(f"{root}: {len(mans)} processes; " + (
            f"every shard of its {len(held)} sharded keys is held by exactly one of them" if not bad else
            f"shards missing or held twice: {'; '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")))
    return lines


def inspect_dir(directory: str | os.PathLike) -> str:
    """Describes a checkpoint directory (newest step) or an nvme tier directory.

    Raises:
      CheckpointError: the directory holds neither.
      TierDataError: a tier manifest is damaged (the message names it and what to do).
    """
    d = Path(directory)
    if not d.exists():
        raise CheckpointError(f"{str(d)!r} does not exist")
    if fmt.is_complete(d) or fmt.list_steps(d):
        return describe_checkpoint(latest_step_dir(d))
    return describe_tier(d)
