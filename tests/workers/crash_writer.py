"""A process that writes and commits NVMe tier steps until it is killed.

Used by ``tests/test_nvme_crash.py``: the parent kills it with SIGKILL at a
random moment, reopens the tier and checks the committed step bitwise against
:func:`expected`. Run as ``python tests/crash_writer.py DIR [MAX_STEPS [UPDATE]]`` (UPDATE: the tier's
update mode, ``double_slot`` by default).

The child resumes after the step the directory holds, prints ``ready <step>``
once the tier is open and ``committed <step>`` (flushed) after every commit
returns. Step ``s`` writes, for every key, deterministic values seeded by
``(s, key id, shard index)``; the ``sparse/...`` key rewrites only half of its
shards each step, so the tier's commit must copy the others from the previous
generation. The tier cuts shards into chunks of at most 200 kB, so most shards
span several chunk files (the parent reopens with the default chunking and must
still read them). Keys under 1 MiB a shard are packed (files of at most 200 kB, a
larger key alone): ``blocks/0/ln/scale``, ``m/blocks/0/attn/qkv`` and the sparse
``sparse/bias`` share one file, so a commit completes a pack file with shards
written one step earlier.
"""
from __future__ import annotations

import sys

import numpy as np

from zinf_jax.tiers.base import ShardSpec, np_dtype

# key -> (spec, sparse); several shard sizes (odd ones too), bfloat16 and float32
KEYS: dict[str, tuple[ShardSpec, bool]] = {
    "embed/table": (ShardSpec(shard_shape=(256, 512), dtype="bfloat16", num_shards=4), False),   # 256 KiB
    "blocks/0/mlp/up/kernel": (ShardSpec(shard_shape=(512, 384), dtype="float32", num_shards=8), False),  # 768 KiB
    "blocks/0/ln/scale": (ShardSpec(shard_shape=(7,), dtype="float32", num_shards=2), False),
    "m/blocks/0/attn/qkv": (ShardSpec(shard_shape=(33, 65, 3), dtype="bfloat16", num_shards=3), False),
    "sparse/head": (ShardSpec(shard_shape=(1024, 257), dtype="float32", num_shards=4), True),     # ~1 MiB
    "sparse/bias": (ShardSpec(shard_shape=(300,), dtype="float32", num_shards=4), True),
}


def shard_data(step: int, key: str, index: int) -> np.ndarray:
    """The values ``step`` writes to shard ``index`` of ``key``."""
    spec, _ = KEYS[key]
    kid = sorted(KEYS).index(key)
    rng = np.random.default_rng(seed=[step, kid, index])
    return rng.standard_normal(spec.shard_shape, dtype=np.float32).astype(np_dtype(spec.dtype))


def writes(step: int, key: str, index: int) -> bool:
    """Whether ``step`` rewrites shard ``index`` of ``key`` (step 1 writes everything)."""
    _, sparse = KEYS[key]
    return step == 1 or not sparse or (step + index) % 2 == 0


def expected(step: int, key: str, index: int) -> np.ndarray:
    """The committed values of shard ``index`` of ``key`` after ``step``."""
    s = step
    while not writes(s, key, index):
        s -= 1
    return shard_data(s, key, index)


def main(path: str, max_steps: int, update: str = "double_slot") -> None:
    from zinf_jax.tiers.nvme import NvmeTier

    # small chunk_bytes: the larger shards are stored as several chunk files (one ragged)
    tier = NvmeTier(path, process_index=0, max_in_flight_bytes=4 << 20, chunk_bytes=200_000, update=update)
    for key, (spec, _) in KEYS.items():
        tier.declare(key, spec)
    step = int(tier.metadata().get("step", 0))
    print(f"ready {step}", flush=True)
    for step in range(step + 1, step + 1 + max_steps):
        futs = [
            tier.put(key, i, shard_data(step, key, i))
            for key in KEYS
            for i in range(KEYS[key][0].num_shards)
            if writes(step, key, i)
        ]
        del futs  # commit waits for them
        tier.commit({"step": step, "writer": "crash_writer"})
        print(f"committed {step}", flush=True)
    tier.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30, *sys.argv[3:4])
