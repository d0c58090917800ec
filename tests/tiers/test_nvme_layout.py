"""The NVMe tier writes chunk files itself: they must be exactly what tensorstore's zarr3 driver reads.

The reference is plain tensorstore opening the slot directory the manifest
names, with no zinf code in the read path. The shards here are small, so the
tiers are opened with ``pack_below_bytes=0`` (every key in arrays of its own;
packed shards: ``test_nvme_packs.py``).
"""
import json
import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from zinf_jax.tiers import NvmeTier, ShardSpec, TierDataError, TierError
from zinf_jax.tiers.direct import ALIGN, ChunkIO, aligned_empty, chunk_ranges, untouched_zeros

CASES = [
    # shard shape, dtype, chunk_bytes: cut on dim 0 with a partial last chunk; cut on an inner dim
    # (leading dims become 1); scalar shards; a shard of one chunk; 1-byte and 2-byte types
    ((37, 5, 3), "float32", 1024),
    ((3, 1001), "bfloat16", 512),
    ((), "int32", 1 << 20),
    ((16, 16), "float16", 1 << 20),
    ((9, 4099), "uint8", 8192),
]


def _plain_tensorstore(tier_dir, key):
    man = json.loads((tier_dir / "MANIFEST.json").read_text())
    slot = man["keys"][key]["slot"]
    path = tier_dir / "data" / key / f"s{slot}"
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, open=True).result()


@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("shape,dtype,chunk_bytes", CASES)
def test_chunk_files_read_by_plain_tensorstore(tmp_path, shape, dtype, chunk_bytes, direct_io):
    rng = np.random.default_rng(0)
    np_t = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    vals = [(rng.standard_normal(shape) * 100).astype(np_t) for _ in range(3)]
    tier = NvmeTier(tmp_path, process_index=0, chunk_bytes=chunk_bytes, direct_io=direct_io, pack_below_bytes=0)
    tier.declare("w", ShardSpec(shard_shape=shape, dtype=dtype, num_shards=3))
    for gen in range(3):  # generations 2 and 3 overwrite the slots of generations 0 and 1 in place
        for f in [tier.put("w", i, v + gen) for i, v in enumerate(vals)]:
            f.result()
        tier.commit({"gen": gen})
        arr = _plain_tensorstore(tier.dir, "w")
        got = arr.read().result()
        want = np.stack([v + gen for v in vals])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        arr[1].write(want[1] * 2).result()  # a write behind the tier's back fails its checksum...
        damaged = r"shard 1 of 'w' is damaged: chunk file '[^']*/c/1\b[^']*' does not match"
        with pytest.raises(TierDataError, match=damaged):
            tier.get("w", 1).result()
        arr[1].write(want[1]).result()  # ...and the bytes the tier wrote read back fine again
        assert tier.get("w", 1).result().tobytes() == want[1].tobytes()
    tier.close()
    again = NvmeTier(tmp_path, process_index=0, chunk_bytes=chunk_bytes, direct_io=direct_io, pack_below_bytes=0)
    assert again.get("w", 2).result().tobytes() == (vals[2] + 2).tobytes()
    with pytest.raises(TierError, match="C-contiguous"):
        again.get("w", 2, out=np.empty(shape, np.float64))
    again.close()


def test_chunk_ranges_cover_the_shard_once():
    for shape, chunk in [((37, 5, 3), (13, 5, 3)), ((3, 1001), (1, 256)), ((4, 2, 6), (1, 1, 6)), ((), ())]:
        seen = np.zeros(int(np.prod(shape)), int)
        for grid, start, count, padded in chunk_ranges(shape, chunk):
            assert len(grid) == len(shape) and count <= padded
            seen[start : start + count] += 1
        assert (seen == 1).all()
    with pytest.raises(ValueError, match="not contiguous"):
        list(chunk_ranges((4, 6), (2, 3)))


@pytest.mark.parametrize("stage", [ALIGN, 3 * ALIGN])
@pytest.mark.parametrize("nbytes,offset", [(3 * ALIGN, 0), (3 * ALIGN + 17, 0), (5000, 3), (20 << 10, 16)])
def test_writer_pads_truncates_and_overwrites(tmp_path, nbytes, offset, stage):
    """Aligned sources are written without staging, unaligned ones through it; sizes are exact."""
    w = ChunkIO(2, 2, block_bytes=2 * ALIGN, stage_bytes=stage)
    src = aligned_empty(nbytes + offset)[offset:]
    src[:] = np.arange(nbytes) % 251
    path = tmp_path / "chunk"
    path.write_bytes(b"\xff" * (nbytes * 2))  # an older, longer file is cut to size
    w.write(path, src, nbytes + 100).result()
    data = path.read_bytes()
    assert len(data) == nbytes + 100
    assert data[:nbytes] == src.tobytes() and data[nbytes:] == b"\0" * 100
    for direct in (False, True):  # into an unaligned buffer, staged when direct
        r = ChunkIO(1, 1, block_bytes=2 * ALIGN, stage_bytes=stage, direct_read=direct)
        out = aligned_empty(nbytes + offset + 1)[offset + 1 :]
        assert r.read(path, out).result() is out and out.tobytes() == src.tobytes()
        r.close()
    with pytest.raises(OSError, match="shorter"):
        w.read(path, np.empty(nbytes + 200, np.uint8)).result()
    w.close()


def test_writer_makes_a_chunk_files_directory_and_the_reader_does_not(tmp_path):
    """A chunk file's directory is made by the I/O thread that writes (or allocates) it; a read of a missing file
    fails and makes nothing."""
    io = ChunkIO(1, 1)
    src = np.arange(3 * ALIGN, dtype=np.uint8)
    io.write(tmp_path / "a" / "c" / "0" / "1", src, src.nbytes).result()
    io.allocate(tmp_path / "b" / "c" / "2" / "0", 2 * ALIGN).result()
    assert (tmp_path / "a" / "c" / "0" / "1").read_bytes() == src.tobytes()
    assert (tmp_path / "b" / "c" / "2" / "0").read_bytes() == b"\0" * (2 * ALIGN)
    with pytest.raises(FileNotFoundError):
        io.read(tmp_path / "d" / "c" / "0", np.empty(ALIGN, np.uint8)).result()
    assert not (tmp_path / "d").exists()
    io.close()


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_untouched_zeros_take_no_memory_and_cannot_be_written():
    """put_zeros hands the tier zeros that cost neither a memset nor memory (np.zeros clears every byte of a block
    malloc serves from its heap)."""
    before = _rss()
    z = untouched_zeros((64, 1 << 20), np.float32)  # 256 MiB
    assert z.shape == (64, 1 << 20) and z.dtype == np.float32 and not z.flags.writeable
    assert not z[::7, ::4096].any() and not z[-1].any()  # read: the kernel's zero page, still no memory
    assert _rss() - before < 32 << 20
    with pytest.raises(ValueError, match="read-only"):
        z[0, 0] = 1
    small = untouched_zeros((3,), np.int8)  # below a page: plain zeros
    assert small.tolist() == [0, 0, 0] and not small.flags.writeable


def test_writes_bypass_the_page_cache_on_a_disk(tmp_path):
    if os.uname().sysname != "Linux":
        pytest.skip("O_DIRECT is Linux-specific")
    w = ChunkIO(1, 1)
    w.write(tmp_path / "c", aligned_empty(ALIGN * 4), ALIGN * 4).result()
    assert w.direct_writes, "the test disk accepted no O_DIRECT write"
    w.close()


@pytest.mark.parametrize("sync", ["write", "commit", False])
def test_sync_modes_round_trip_and_reopen(tmp_path, sync):
    """Every durability mode writes the same files (only when they reach the disk differs)."""
    vals = [np.arange(3000, dtype=np.float32) * (i + 1) for i in range(4)]
    tier = NvmeTier(tmp_path, process_index=0, sync=sync, chunk_bytes=4096)
    tier.declare("k", ShardSpec(shard_shape=(3000,), dtype="float32", num_shards=4))
    for gen in range(3):
        for f in [tier.put("k", i, v + gen) for i, v in enumerate(vals)]:
            f.result()
        tier.commit({"gen": gen})
    tier.close()
    again = NvmeTier(tmp_path, process_index=0)
    assert again.metadata() == {"gen": 2}
    assert all(again.get("k", i).result().tobytes() == (v + 2).tobytes() for i, v in enumerate(vals))
    again.close()
    with pytest.raises(ValueError, match="sync"):
        NvmeTier(tmp_path, process_index=0, sync="sometimes")
    NvmeTier(tmp_path, process_index=0).close()  # and the refused open left no lock behind


def test_unreadable_manifest_is_a_clear_error_and_releases_the_lock(tmp_path):
    tier = NvmeTier(tmp_path, process_index=0)
    tier.declare("k", ShardSpec(shard_shape=(4,), dtype="float32", num_shards=1))
    tier.put("k", 0, np.ones(4, np.float32)).result()
    tier.commit()
    tier.close()
    (tier.dir / "MANIFEST.json").write_text('{"generation": 1, "keys": ')
    with pytest.raises(TierError, match="MANIFEST.json.*unreadable"):
        NvmeTier(tmp_path, process_index=0)
    (tier.dir / "MANIFEST.json").unlink()
    NvmeTier(tmp_path, process_index=0).close()  # the lock was released


@pytest.mark.parametrize("direct_min_bytes", [0, 1 << 30])
def test_small_and_large_shard_paths_write_the_same_files(tmp_path, direct_min_bytes):
    """Small shards go through tensorstore's I/O, large ones through ChunkIO: same bytes on disk either way."""
    vals = [np.arange(5000, dtype=np.float32) + i for i in range(2)]
    tier = NvmeTier(tmp_path, process_index=0, chunk_bytes=4096, direct_min_bytes=direct_min_bytes,
                    pack_below_bytes=0)
    tier.declare("k", ShardSpec(shard_shape=(5000,), dtype="float32", num_shards=2))
    for f in [tier.put("k", i, v) for i, v in enumerate(vals)]:
        f.result()
    tier.commit()
    assert _plain_tensorstore(tier.dir, "k").read().result().tobytes() == np.stack(vals).tobytes()
    out = np.empty(5000, np.float32)
    assert tier.get("k", 1, out=out).result() is out and out.tobytes() == vals[1].tobytes()
    tier.close()
