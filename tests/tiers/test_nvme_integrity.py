"""The NVMe tier never hands back damaged data silently, and a failed write leaves no files behind.

Every chunk file is checksummed on write and verified on read, on both I/O
routes (tensorstore for small shards, ChunkIO's direct I/O for large ones:
``direct_min_bytes`` picks the route here, so the arrays stay tiny; packing is
off, packed shards have their own tests in ``test_nvme_packs.py``). A bit flip,
a truncated or deleted chunk file, a deleted slot directory and a damaged
manifest are each a ``TierDataError`` naming the key, the shard and the file.
The full-disk test mounts a small tmpfs (root only) and skips otherwise.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from zinf_jax.app.inspect import inspect_dir
from zinf_jax.tiers import NvmeTier, ShardSpec, TierDataError, TierError, read_manifest
from helpers.tmpfs import mounted

SPEC = ShardSpec(shard_shape=(64, 32), dtype="float32", num_shards=3)  # 8 KiB shards ...
CHUNK_BYTES = 2048  # ... of 4 chunk files each: c/<shard>/<0..3>/0
ROUTES = {"tensorstore": 1 << 30, "direct": 0}  # direct_min_bytes choosing each I/O route


def _open(path: Path, route: str, **kw) -> NvmeTier:
    kw = {"update": "double_slot", **kw}  # the tests of slots (the default, in_place, has one)
    return NvmeTier(path, process_index=0, chunk_bytes=CHUNK_BYTES, direct_min_bytes=ROUTES[route], pack_below_bytes=0,
                    **kw)


def _value(gen: int, index: int) -> np.ndarray:
    return np.random.default_rng([gen, index]).standard_normal(SPEC.shard_shape, dtype=np.float32)


def _write(tier: NvmeTier, gen: int, key: str = "w", indices=range(SPEC.num_shards)) -> None:
    tier.declare(key, SPEC)
    for f in [tier.put(key, i, _value(gen, i)) for i in indices]:
        f.result()


def _committed(path: Path, route: str, **kw) -> NvmeTier:
    """A tier with generation 1 of key ``w`` committed."""
    tier = _open(path, route, **kw)
    _write(tier, gen=1)
    tier.commit({"step": 1})
    return tier


def _slot_dir(tier: NvmeTier, key: str = "w") -> Path:
    return tier.dir / "data" / key / f"s{read_manifest(tier.dir)['keys'][key]['slot']}"


def _read_ok(tier: NvmeTier, gen: int, key: str = "w") -> None:
    for i in range(SPEC.num_shards):
        out = np.empty(SPEC.shard_shape, np.float32)
        tier.get(key, i, out=out).result()
        assert out.tobytes() == _value(gen, i).tobytes(), f"{key}[{i}]"


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))


def _damage_error(tier: NvmeTier, index: int, phrase: str, path: Path) -> str:
    with pytest.raises(TierDataError) as exc:
        tier.get("w", index).result()
    msg = str(exc.value)
    assert f"shard {index} of 'w' is damaged" in msg and phrase in msg and repr(str(path)) in msg, msg
    assert "--resume" in msg and str(tier.dir) in msg, msg
    return msg


# ---------------------------------------------------------------- damaged data


@pytest.mark.parametrize("route", ROUTES)
def test_bit_flip_in_committed_chunk_is_an_error_naming_key_shard_and_file(tmp_path, route):
    tier = _committed(tmp_path, route)
    victim = _slot_dir(tier) / "c" / "1" / "2" / "0"
    _flip_bit(victim, 100)
    msg = _damage_error(tier, 1, "does not match its checksum (xxh3_64 stored", victim)
    with pytest.raises(TierDataError, match="does not match its checksum"):  # into a caller's buffer too
        tier.get("w", 1, out=np.empty(SPEC.shard_shape, np.float32)).result()
    for i in (0, 2):  # the other shards are fine
        assert tier.get("w", i).result().tobytes() == _value(1, i).tobytes()
    tier.close()
    again = _open(tmp_path, route)  # a cold reader sees the same
    assert _damage_error(again, 1, "does not match its checksum", victim) == msg
    # a commit that rewrites only shard 0 copies shards 1 and 2 across: it refuses the damaged one
    again.put("w", 0, _value(2, 0)).result()
    with pytest.raises(TierDataError, match="shard 1 of 'w' is damaged"):
        again.commit({"step": 2})
    assert again.generation == 1 and again.metadata() == {"step": 1}
    again.close()


@pytest.mark.parametrize("route", ROUTES)
def test_bit_flip_in_an_uncommitted_write_is_caught_on_read_back(tmp_path, route):
    tier = _committed(tmp_path, route)
    _write(tier, gen=2)
    pending = tier.dir / "data" / "w" / f"s{1 - read_manifest(tier.dir)['keys']['w']['slot']}"
    _flip_bit(pending / "c" / "0" / "0" / "0", 7)
    _damage_error(tier, 0, "does not match its checksum", pending / "c" / "0" / "0" / "0")
    tier.close()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_missing_or_truncated_chunk_file_is_an_error(tmp_path, route, damage):
    tier = _committed(tmp_path, route)
    victim = _slot_dir(tier) / "c" / "2" / "3" / "0"
    if damage == "delete":
        victim.unlink()
        phrase = "is missing"
    else:
        os.truncate(victim, 1000)
        phrase = f"has 1000 bytes, its array needs {CHUNK_BYTES}"
    _damage_error(tier, 2, phrase, victim)
    tier.close()
    again = _open(tmp_path, route)
    _damage_error(again, 2, phrase, victim)
    again.close()


@pytest.mark.parametrize("route", ROUTES)
def test_missing_slot_directory_is_an_error(tmp_path, route):
    tier = _committed(tmp_path, route)
    slot = _slot_dir(tier)
    shutil.rmtree(slot)
    for i in range(SPEC.num_shards):  # the open tier (its array handle cached) ...
        _damage_error(tier, i, "slot directory", slot)
    tier.close()
    again = _open(tmp_path, route)  # ... and a new one, which cannot open the array
    _damage_error(again, 0, "is missing", slot)
    again.close()
    shutil.rmtree(tmp_path / "process_0" / "data")  # the whole data directory
    again = _open(tmp_path, route)
    _damage_error(again, 1, "is missing", slot)
    again.close()


@pytest.mark.parametrize("route", ROUTES)
def test_checksums_survive_reopen_and_partial_rewrites(tmp_path, route):
    tier = _committed(tmp_path, route)
    tier.declare("other", SPEC)
    _write(tier, gen=5, key="other")
    tier.commit({"step": 1.5})
    _write(tier, gen=2, indices=[1])  # shards 0 and 2 are copied (verified) into the new slot
    tier.commit({"step": 2})
    tier.close()
    man = read_manifest(tmp_path / "process_0")
    assert man["checksum"] == "xxh3_64"
    for key in ("w", "other"):
        sums = man["keys"][key]["checksums"]
        assert sorted(sums) == ["0", "1", "2"] and all(len(d) == 4 for d in sums.values()), sums
    again = _open(tmp_path, route)
    assert again.generation == 3 and again.metadata() == {"step": 2}
    assert again.get("w", 1).result().tobytes() == _value(2, 1).tobytes()
    for i in (0, 2):
        assert again.get("w", i).result().tobytes() == _value(1, i).tobytes()
    _read_ok(again, gen=5, key="other")  # not rewritten since generation 2: its digests carried over
    again.close()
    other = "direct" if route == "tensorstore" else "tensorstore"  # digests describe data, not the route
    again = _open(tmp_path, other)
    _read_ok(again, gen=5, key="other")
    again.close()


def test_checksums_off_writes_none_and_reads_unverified(tmp_path):
    """The benchmark's switch: no digests written, none checked (data committed that way stays readable)."""
    tier = _committed(tmp_path, "direct", checksums=False)
    tier.close()
    assert "checksums" not in read_manifest(tmp_path / "process_0")["keys"]["w"]
    again = _open(tmp_path, "direct")
    _read_ok(again, gen=1)
    again.close()
    inspected = inspect_dir(tmp_path)
    assert "checksums" in inspected and inspected.splitlines()[-1].rstrip().endswith("no"), inspected


# ---------------------------------------------------------------- damaged manifest


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbage", b'{"generation": 1, "keys": ', b"[]",
                                     b'{"generation": 1, "keys": []}', b'{"generation": 1, "keys": {"w": 3}}'],
                         ids=["empty", "binary", "truncated", "list", "keys-list", "bad-entry"])
def test_damaged_manifest_is_an_error_naming_the_file(tmp_path, capsys, content):
    _committed(tmp_path, "direct").close()
    manifest = tmp_path / "process_0" / "MANIFEST.json"
    manifest.write_bytes(content)
    with pytest.raises(TierDataError) as exc:
        _open(tmp_path, "direct")
    msg = str(exc.value)
    assert repr(str(manifest)) in msg and "unreadable" in msg and "--resume" in msg, msg
    assert f"delete {str(manifest.parent)!r}" in msg, msg
    with pytest.raises(TierDataError) as exc2:  # inspect says the same
        inspect_dir(tmp_path)
    assert str(exc2.value) == msg
    from zinf_jax.app.cli import main

    assert main(["inspect", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err
    manifest.unlink()  # the refused opens left the lock free
    _open(tmp_path, "direct").close()


# ---------------------------------------------------------------- failed writes


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs (root only: skips with the reason otherwise)."""
    with mounted(tmp_path / "disk", "size=4m") as mnt:
        yield mnt


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("finish", ["close", "commit"])
def test_failed_write_removes_its_files(tiny_disk, finish):
    big = ShardSpec(shard_shape=(512, 512), dtype="float32", num_shards=4)     # 1 MiB shards: direct route
    small = ShardSpec(shard_shape=(200, 256), dtype="float32", num_shards=12)  # 200 KiB: tensorstore's
    tier = NvmeTier(tiny_disk, process_index=0, update="double_slot")
    _write(tier, gen=1)
    tier.commit({"step": 1})
    committed, used = _files(tiny_disk), _used(tiny_disk)

    errors: list[TierError] = []
    futs = []
    for key, spec in (("big", big), ("small", small)):  # 5.3 MiB more on a 4 MiB disk
        tier.declare(key, spec)
        for i in range(spec.num_shards):
            try:
                futs.append(tier.put(key, i, np.ones(spec.shard_shape, np.float32)))
            except TierError as e:  # a put may fail at once (creating its array's metadata)
                errors.append(e)
    errors += [f.exception() for f in futs if f.exception() is not None]
    assert errors
    for e in errors:
        msg = str(e)
        assert "disk full" in msg and "(file '" in msg and str(tiny_disk) in msg and "generation 1" in msg, msg
        named = Path(msg.split("(file '")[1].split("'")[0])
        assert "/data/big/" not in str(named) or not named.is_file(), f"failed write left {named}"
    with pytest.raises(TierError, match="disk full"):
        tier.close() if finish == "close" else tier.commit({"step": 2})
    assert _files(tiny_disk) == committed  # every file of the failed generation is gone
    assert _used(tiny_disk) <= used + 64 * 1024
    if finish == "commit":
        _read_ok(tier, gen=1)
        tier.close()
    again = NvmeTier(tiny_disk, process_index=0, update="double_slot")
    assert again.generation == 1 and again.metadata() == {"step": 1}
    _read_ok(again, gen=1)
    again.close()


def test_failed_in_place_write_leaves_a_refused_half_updated_tier(tiny_disk):
    """In place there is no older copy to fall back on: after a failed write the tier refuses every use, and so
    does the next opener, until it is rebuilt (the committed generation 1 is not readable any more)."""
    tier = NvmeTier(tiny_disk, process_index=0, update="in_place")
    _write(tier, gen=1)
    tier.commit({"step": 1})
    big = ShardSpec(shard_shape=(512, 512), dtype="float32", num_shards=8)  # 8 MiB more on a 4 MiB disk
    tier.declare("big", big)
    futs = []
    with pytest.raises(TierError, match="disk full"):
        for i in range(big.num_shards):
            futs.append(tier.put("big", i, np.ones(big.shard_shape, np.float32)))
        tier.commit({"step": 2})
    for call in (lambda: tier.get("w", 0).result(), lambda: tier.commit({"step": 2})):
        with pytest.raises(TierDataError, match="half-updated"):
            call()
    tier.close()  # the failed write was reported by the commit; the slot's files stay (they are the only ones)
    with pytest.raises(TierDataError, match="half-updated.*--resume"):
        NvmeTier(tiny_disk, process_index=0, update="in_place")


# ---------------------------------------------------------------- shards of zeros


@pytest.mark.parametrize("update", ["double_slot", "in_place"])
def test_put_zeros_allocates_the_files_and_reads_back_verified_zeros(tmp_path, update):
    """put_zeros (a fresh optimizer's moments) reserves the chunk files' blocks instead of writing them: the
    shards read as zeros, now and after a reopen, over data committed before (in place too); they are
    checksummed like any write; nothing counts as bytes written."""
    tier = _committed(tmp_path, "direct", update=update)
    written = tier.bytes_written
    for f in [tier.put_zeros("w", i) for i in range(SPEC.num_shards)]:
        f.result()
    assert tier.bytes_written == written and tier.bytes_zeroed == SPEC.num_shards * SPEC.shard_nbytes
    zero = np.zeros(SPEC.shard_shape, np.float32)
    assert all(tier.get("w", i).result().tobytes() == zero.tobytes() for i in range(SPEC.num_shards))
    tier.commit({"step": 2})
    files = sorted((_slot_dir(tier) / "c").rglob("0"))
    files = [p for p in files if p.is_file()]
    assert len(files) == 4 * SPEC.num_shards
    for p in files:  # full size, blocks reserved (a full disk fails now, not at the first step)
        st = p.stat()
        assert st.st_size == CHUNK_BYTES and st.st_blocks * 512 >= CHUNK_BYTES, p
    tier.close()
    again = _open(tmp_path, "direct", update=update)
    assert all(again.get("w", i).result().tobytes() == zero.tobytes() for i in range(SPEC.num_shards))
    _flip_bit(files[5], 3)  # a zero shard is checksummed like any other
    with pytest.raises(TierDataError, match="does not match its checksum"):
        [again.get("w", i).result() for i in range(SPEC.num_shards)]
    again.close()


def test_put_zeros_of_small_shards_writes_them(tmp_path):
    """Shards on tensorstore's route (and packed ones) are written as zeros like any put."""
    tier = _committed(tmp_path, "tensorstore")
    written = tier.bytes_written
    for f in [tier.put_zeros("w", i) for i in range(SPEC.num_shards)]:
        f.result()
    assert tier.bytes_zeroed == 0 and tier.bytes_written == written + SPEC.num_shards * SPEC.shard_nbytes
    tier.commit({"step": 2})
    assert all(not tier.get("w", i).result().any() for i in range(SPEC.num_shards))
    tier.close()


def test_put_zeros_on_a_full_disk_fails_like_a_write(tiny_disk):
    tier = NvmeTier(tiny_disk, process_index=0, update="double_slot")
    _write(tier, gen=1)
    tier.commit({"step": 1})
    committed = _files(tiny_disk)
    big = ShardSpec(shard_shape=(512, 512), dtype="float32", num_shards=8)  # 8 MiB of zeros on a 4 MiB disk
    tier.declare("big", big)
    errors = []
    for i in range(big.num_shards):
        try:
            errors.append(tier.put_zeros("big", i).exception())
        except TierError as e:
            errors.append(e)
    errors = [e for e in errors if e is not None]
    assert errors and all("disk full" in str(e) and "generation 1" in str(e) for e in errors), errors
    with pytest.raises(TierError, match="disk full"):
        tier.commit({"step": 2})
    assert _files(tiny_disk) == committed  # the allocated files of the failed generation are gone
    _read_ok(tier, gen=1)
    tier.close()
