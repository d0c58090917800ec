"""Small shards packed into shared files: one file per pack, the same slots, digests, commit and errors.

Each test writes through the tier and checks the files on disk and the data read back (by the tier
and by a fresh opener) against the values written; the damage tests change the pack file behind the
tier's back. Crash safety of packs (SIGKILL in both update modes) is ``test_nvme_crash.py``, whose
writer packs its small keys; a full disk during a packed write is ``test_nvme_integrity.py``'s
``test_failed_write_removes_its_files`` (its 200 KiB keys are packed).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from zinf_jax.app.inspect import inspect_dir
from zinf_jax.tiers import NvmeTier, ShardSpec, TierDataError, TierError, read_manifest

SPECS = {  # 12 keys of 3 shards, three dtypes, odd sizes: one pack (36 shards of <= 8 KiB)
    f"k{j}/{name}": ShardSpec(shard_shape=shape, dtype=dtype, num_shards=3)
    for j in range(4)
    for name, shape, dtype in (("kernel", (16, 40), "float32"), ("bias", (7,), "bfloat16"), ("count", (), "int32"))
}


def _value(gen: int, key: str, index: int) -> np.ndarray:
    spec = SPECS.get(key, ShardSpec(shard_shape=(64,), dtype="float32", num_shards=3))
    dtype = ml_dtypes.bfloat16 if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
    rng = np.random.default_rng([gen, sorted(SPECS).index(key) if key in SPECS else 99, index])
    return (rng.standard_normal(spec.shard_shape) * 100).astype(dtype)


def _open(path: Path, **kw) -> NvmeTier:
    tier = NvmeTier(path, process_index=0, **{"update": "double_slot", **kw})
    for key, spec in SPECS.items():
        tier.declare(key, spec)
    return tier


def _write(tier: NvmeTier, gen: int, keys=SPECS, indices=range(3)) -> None:
    for key in keys:
        for i in indices:
            tier.put(key, i, _value(gen, key, i)).result()


def _committed(path: Path, **kw) -> NvmeTier:
    """A tier with generation 1 of every key of ``SPECS`` committed."""
    tier = _open(path, **kw)
    _write(tier, gen=1)
    tier.commit({"step": 1})
    return tier


def _check(tier: NvmeTier, want: dict[tuple[str, int], int]) -> None:
    """Every shard reads back bitwise as the generation ``want`` names for it."""
    for (key, i), gen in want.items():
        assert tier.get(key, i).result().tobytes() == _value(gen, key, i).tobytes(), (key, i, gen)


def _packs(tier_dir: Path) -> list[str]:
    return sorted(p.name for p in (tier_dir / "process_0" / "packs").iterdir())


@pytest.mark.parametrize("update", ["double_slot", "in_place"])
def test_small_keys_share_one_file_and_read_back_bitwise(tmp_path, update):
    tier = _committed(tmp_path, update=update)
    assert _packs(tmp_path) == ["p0.s0"]  # 36 shards of 12 keys: one file, no per-shard files
    assert not (tmp_path / "process_0" / "data").exists()
    man = read_manifest(tmp_path / "process_0")
    assert man["format"] == "zinf_jax.nvme/2" and list(man["packs"]) == ["p0"]
    offsets = [o for _, _, o, _ in man["packs"]["p0"]["members"]]
    assert all(o % 4096 == 0 for o in offsets) and len(set(offsets)) == 36  # page-aligned, one per shard
    assert all(v["pack"] == "p0" and len(v["checksums"]["0"]) == 1 for v in man["keys"].values())
    _write(tier, gen=2)
    tier.commit({"step": 2})
    # double slot: the second generation went to the pack's other slot; in place: the same file again
    assert _packs(tmp_path) == (["p0.s0", "p0.s1"] if update == "double_slot" else ["p0.s0"])
    assert read_manifest(tmp_path / "process_0")["packs"]["p0"]["slot"] == (1 if update == "double_slot" else 0)
    _check(tier, {(k, i): 2 for k in SPECS for i in range(3)})
    tier.close()
    again = _open(tmp_path, update=update)
    assert again.generation == 2 and again.metadata() == {"step": 2}
    _check(again, {(k, i): 2 for k in SPECS for i in range(3)})
    again.close()
    assert "0 (p0)" in inspect_dir(tmp_path) or "1 (p0)" in inspect_dir(tmp_path)


@pytest.mark.parametrize("update", ["double_slot", "in_place"])
def test_a_generation_writing_part_of_a_pack_keeps_the_rest(tmp_path, update):
    tier = _committed(tmp_path, update=update)
    _write(tier, gen=2, keys=["k1/kernel"], indices=[2])  # one shard of one key of the pack
    _write(tier, gen=2, keys=["k3/bias"])
    tier.commit({"step": 2})
    tier.close()
    want = {(k, i): 1 for k in SPECS for i in range(3)}
    want.update({("k1/kernel", 2): 2, **{("k3/bias", i): 2 for i in range(3)}})
    again = _open(tmp_path, update=update)
    _check(again, want)  # double slot: the commit copied the 32 other shards into the new file
    again.close()


def test_an_aborted_generation_deletes_its_pack_file_and_keeps_the_committed_one(tmp_path):
    tier = _committed(tmp_path)
    _write(tier, gen=2, keys=["k0/kernel"])
    assert _packs(tmp_path) == ["p0.s0", "p0.s1"]
    tier.declare("late/never", ShardSpec(shard_shape=(4,), dtype="float32", num_shards=3))
    tier.put("late/never", 0, np.zeros(4, np.float32)).result()  # only shard 0 of a new key: not committable
    with pytest.raises(TierError, match=r"'late/never' shards \[1, 2\] were never written"):
        tier.commit({"step": 2})
    assert _packs(tmp_path) == ["p0.s0"]  # the uncommitted slot's file (and the new key's pack) are gone
    _check(tier, {(k, i): 1 for k in SPECS for i in range(3)})
    tier.close()


def _member(tier_dir: Path, key: str, index: int, pending: bool = False) -> tuple[Path, int]:
    """The pack file holding a shard (its committed slot, or the other one) and the shard's offset in it."""
    man = read_manifest(tier_dir / "process_0")
    name = man["keys"][key]["pack"]
    slot = man["packs"][name]["slot"]
    off = next(o for k, i, o, _ in man["packs"][name]["members"] if (k, i) == (key, index))
    return tier_dir / "process_0" / "packs" / f"{name}.s{1 - slot if pending else slot}", off


def _damage_error(tier: NvmeTier, key: str, index: int, phrase: str, path: Path) -> str:
    with pytest.raises(TierDataError) as exc:
        tier.get(key, index).result()
    msg = str(exc.value)
    assert f"shard {index} of {key!r} is damaged" in msg and phrase in msg and repr(str(path)) in msg, msg
    assert "--resume" in msg and str(tier.dir) in msg, msg
    return msg


def test_a_bit_flip_in_a_pack_names_key_shard_and_file_and_stops_a_commit(tmp_path):
    tier = _committed(tmp_path)
    path, off = _member(tmp_path, "k2/kernel", 1)
    with open(path, "r+b") as f:
        f.seek(off + 100)
        b = f.read(1)[0]
        f.seek(off + 100)
        f.write(bytes([b ^ 0x10]))
    msg = _damage_error(tier, "k2/kernel", 1, f"at offset {off}", path)
    assert "does not match its checksum (xxh3_64 stored" in msg
    _check(tier, {(k, i): 1 for k in SPECS for i in range(3) if (k, i) != ("k2/kernel", 1)})  # neighbours fine
    tier.close()
    again = _open(tmp_path)  # a cold reader sees the same
    assert _damage_error(again, "k2/kernel", 1, "does not match", path) == msg
    again.put("k0/bias", 0, _value(2, "k0/bias", 0)).result()  # the commit copies the rest of the pack ...
    with pytest.raises(TierDataError, match="shard 1 of 'k2/kernel' is damaged"):  # ... and refuses the damaged one
        again.commit({"step": 2})
    assert again.generation == 1 and again.metadata() == {"step": 1}
    again.close()


def test_a_bit_flip_in_an_uncommitted_pack_write_is_caught_on_read_back(tmp_path):
    tier = _committed(tmp_path)
    _write(tier, gen=2, keys=["k0/kernel"])
    path, off = _member(tmp_path, "k0/kernel", 0, pending=True)
    with open(path, "r+b") as f:
        f.seek(off + 7)
        f.write(b"\x00\x01")
    _damage_error(tier, "k0/kernel", 0, "does not match its checksum", path)
    tier.close()


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_missing_or_short_pack_file_is_an_error(tmp_path, damage):
    tier = _committed(tmp_path)
    tier.close()
    path, off = _member(tmp_path, "k3/kernel", 2)
    size = path.stat().st_size
    if damage == "delete":
        path.unlink()
        phrase = "is missing"
    else:
        os.truncate(path, off + 10)
        phrase = f"has {off + 10} bytes, its pack needs {size}"
    again = _open(tmp_path)
    _damage_error(again, "k3/kernel", 2, phrase, path)
    again.close()


def test_a_process_packs_only_its_local_shards_and_refuses_another_layout(tmp_path):
    spec = ShardSpec(shard_shape=(64,), dtype="float32", num_shards=8)
    tier = NvmeTier(tmp_path, process_index=1)
    tier.declare("w", spec, [1, 5])
    for i in (1, 5):
        tier.put("w", i, np.full(64, i, np.float32)).result()
    tier.commit()
    members = read_manifest(tmp_path / "process_1")["packs"]["p0"]["members"]
    assert [(k, i) for k, i, _, _ in members] == [("w", 1), ("w", 5)]
    assert os.path.getsize(tmp_path / "process_1" / "packs" / "p0.s0") == 2 * 4096
    with pytest.raises(TierError, match=r"packed with local shards \[1, 5\], not \[1, 2\].*use an empty path"):
        tier.declare("w", spec, [1, 2])
    tier.declare("w", spec, [5, 1])  # the same shards again: fine
    assert tier.get("w", 5).result().tolist() == [5.0] * 64
    tier.close()


def test_keys_committed_unpacked_stay_in_their_arrays_and_new_small_keys_are_packed(tmp_path):
    _committed(tmp_path, pack_below_bytes=0).close()  # a directory written before packing (or with it off)
    tier = _open(tmp_path)
    tier.declare("new/scale", ShardSpec(shard_shape=(64,), dtype="float32", num_shards=3))
    _write(tier, gen=2, keys=[*SPECS, "new/scale"])
    tier.commit({"step": 2})
    tier.close()
    man = read_manifest(tmp_path / "process_0")
    assert [k for k, v in man["keys"].items() if "pack" in v] == ["new/scale"]
    assert _packs(tmp_path) == ["p0.s0"] and (tmp_path / "process_0" / "data" / "k0" / "kernel").is_dir()
    again = _open(tmp_path)
    again.declare("new/scale", ShardSpec(shard_shape=(64,), dtype="float32", num_shards=3))
    _check(again, {(k, i): 2 for k in [*SPECS, "new/scale"] for i in range(3)})
    again.close()


def test_packs_hold_whole_keys_up_to_chunk_bytes(tmp_path):
    spec = ShardSpec(shard_shape=(1000,), dtype="float32", num_shards=2)  # 2 shards of 4000 B: 8 KiB a key
    tier = NvmeTier(tmp_path, process_index=0, chunk_bytes=20 << 10)
    for j in range(5):
        tier.declare(f"w{j}", spec)
    tier.declare("big", ShardSpec(shard_shape=(2 << 20,), dtype="uint8", num_shards=2))  # 2 MiB: its own arrays
    for j in range(5):
        for i in range(2):
            tier.put(f"w{j}", i, np.full(1000, j * 10 + i, np.float32)).result()
    for i in range(2):
        tier.put("big", i, np.full(2 << 20, i, np.uint8)).result()
    tier.commit()
    man = read_manifest(tmp_path / "process_0")
    assert {k: v.get("pack") for k, v in man["keys"].items()} == {
        "w0": "p0", "w1": "p0", "w2": "p1", "w3": "p1", "w4": "p2", "big": None}  # 2 keys (16 KiB) a pack
    assert _packs(tmp_path) == ["p0.s0", "p1.s0", "p2.s0"]
    assert tier.get("w3", 1).result().tolist() == [31.0] * 1000
    tier.close()


def test_a_whole_pack_is_synced_in_the_background_and_the_rest_at_commit(tmp_path, monkeypatch):
    synced: list[tuple[str, str]] = []  # (file, thread)
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1], threading.current_thread().name))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    spec = ShardSpec(shard_shape=(1000,), dtype="float32", num_shards=2)
    tier = NvmeTier(tmp_path, process_index=0, chunk_bytes=20 << 10, update="in_place")  # p0: a, b; p1: c
    for k in "abc":
        tier.declare(k, spec)
    for k in "abc":
        for i in range(2):
            tier.put(k, i, np.full(1000, i, np.float32)).result()
    tier.commit()
    # each file was complete after its last member's put: synced by the background thread, once
    assert sorted(f for f, _ in synced) == ["p0.s0", "p1.s0"]
    assert all(t.startswith("zinf-nvme-pack-sync") for _, t in synced), synced
    synced.clear()
    tier.put("a", 0, np.ones(1000, np.float32)).result()  # in place, part of p0: synced by the commit itself
    tier.commit()
    assert synced == [("p0.s0", threading.current_thread().name)], synced
    tier.close()
