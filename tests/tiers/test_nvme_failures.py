"""The NVMe tier fails loudly and keeps committed state: lock held, bad paths, full disk.

The path and full-disk tests mount small tmpfs file systems (root only); they
skip with the reason when mounting is not permitted.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from zinf_jax.tiers import NvmeTier, ShardSpec, TierError, np_dtype
from helpers.tmpfs import mounted

# ---------------------------------------------------------------- helpers


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts tmpfs file systems on request; unmounts every one at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda name, *options: stack.enter_context(mounted(tmp_path / name, ",".join(options)))


def _data(step: int, key_id: int, index: int, spec: ShardSpec) -> np.ndarray:
    rng = np.random.default_rng(seed=[step, key_id, index])
    return rng.standard_normal(spec.shard_shape, dtype=np.float32).astype(np_dtype(spec.dtype))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


# ---------------------------------------------------------------- lock

_SECOND_OPENER = textwrap.dedent(
    """
    import sys
    from zinf_jax.tiers import NvmeTier, TierError
    try:
        NvmeTier(sys.argv[1], process_index=0).close()
    except TierError as e:
        print("TierError:", e)
        sys.exit(3)
    print("opened")
    """
)


def _open_in_subprocess(path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", _SECOND_OPENER, str(path)], capture_output=True, text=True, timeout=120, env=env
    )


def test_second_opener_in_same_process_fails_then_opens_after_close(tmp_path):
    first = NvmeTier(tmp_path, process_index=0)
    with pytest.raises(TierError, match="locked by pid") as exc:
        NvmeTier(tmp_path, process_index=0)
    msg = str(exc.value)
    assert "another job" in msg and str(tmp_path / "process_0") in msg
    assert f"pid {os.getpid()}" in msg
    # another process index is another directory: not locked
    NvmeTier(tmp_path, process_index=1).close()
    first.close()
    NvmeTier(tmp_path, process_index=0).close()


def test_second_opener_in_another_process_fails_at_once_then_opens_after_close(tmp_path):
    first = NvmeTier(tmp_path, process_index=0)
    try:
        r = _open_in_subprocess(tmp_path)
        assert r.returncode == 3, r.stdout + r.stderr
        assert "locked by pid" in r.stdout and "another job" in r.stdout, r.stdout
        assert f"pid {os.getpid()}" in r.stdout
    finally:
        first.close()
    r = _open_in_subprocess(tmp_path)
    assert r.returncode == 0 and "opened" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------- bad paths


def test_missing_path(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(TierError, match="does not exist") as exc:
        NvmeTier(missing, process_index=0)
    assert str(missing) in str(exc.value)
    assert not missing.exists()


def test_regular_file_path(tmp_path):
    f = tmp_path / "a_file"
    f.write_bytes(b"not a directory")
    with pytest.raises(TierError, match="not a directory") as exc:
        NvmeTier(f, process_index=0)
    assert str(f) in str(exc.value)
    assert f.read_bytes() == b"not a directory"


def test_read_only_path(tmpfs):
    ro = tmpfs("ro", "ro", "size=1m")
    with pytest.raises(TierError, match="not writable") as exc:
        NvmeTier(ro, process_index=0)
    msg = str(exc.value)
    assert str(ro) in msg and "Read-only" in msg


# ---------------------------------------------------------------- full disk

_SMALL = {"a": ShardSpec(shard_shape=(128, 256), dtype="bfloat16", num_shards=4),   # 4 x 64 KiB
          "b": ShardSpec(shard_shape=(300, 257), dtype="float32", num_shards=3)}    # 3 x ~301 KiB
_BIG = ShardSpec(shard_shape=(512, 512), dtype="float32", num_shards=4)              # 4 x 1 MiB


def _write(tier: NvmeTier, specs: dict[str, ShardSpec], step: int) -> list:
    futs = []
    for kid, (key, spec) in enumerate(sorted(specs.items())):
        tier.declare(key, spec)
        for i in range(spec.num_shards):
            futs.append(tier.put(key, i, _data(step, kid, i, spec)))
    return futs


def _check(tier: NvmeTier, specs: dict[str, ShardSpec], step: int) -> None:
    for kid, (key, spec) in enumerate(sorted(specs.items())):
        assert tier.spec(key) == spec
        for i in range(spec.num_shards):
            got = tier.get(key, i).result()
            out = np.empty(spec.shard_shape, np_dtype(spec.dtype))
            tier.get(key, i, out=out).result()
            want = _data(step, kid, i, spec)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{key}[{i}] step {step}")
            np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=f"{key}[{i}] step {step} (out=)")


def test_full_disk_keeps_committed_generation(tmpfs):
    disk = tmpfs("disk", "size=4m")
    tier = NvmeTier(disk, process_index=0, update="double_slot")
    _write(tier, _SMALL, step=1)
    tier.commit({"step": 1, "note": "gen 1"})
    assert tier.generation == 1

    # generation 2 rewrites the small keys (into the other slot) and adds 4 MiB: cannot fit
    errors: list[TierError] = []
    futs = []
    try:
        futs = _write(tier, {**_SMALL, "big": _BIG}, step=2)
    except TierError as e:  # a put may fail at once (e.g. creating the array's metadata)
        errors.append(e)
    for f in futs:
        try:
            f.result()
        except TierError as e:
            errors.append(e)
    with pytest.raises(TierError) as exc:
        tier.commit({"step": 2})
    errors.append(exc.value)
    for e in errors:
        msg = str(e)
        assert "disk full" in msg and "intact" in msg and "generation 1" in msg, msg
        assert str(disk / "process_0") in msg
    # nothing was published, in memory or on disk
    assert tier.generation == 1 and tier.metadata() == {"step": 1, "note": "gen 1"}
    _check(tier, _SMALL, step=1)
    tier.close()

    # a new opener sees generation 1, bitwise, with its metadata
    tier = NvmeTier(disk, process_index=0, update="double_slot")
    assert tier.generation == 1
    assert tier.metadata() == {"step": 1, "note": "gen 1"}
    assert sorted(tier.keys()) == ["a", "b"]
    _check(tier, _SMALL, step=1)

    # a generation that fits commits (the failed one's files were removed)
    for f in _write(tier, _SMALL, step=3):
        f.result()
    tier.commit({"step": 3})
    _check(tier, _SMALL, step=3)
    tier.close()
    tier = NvmeTier(disk, process_index=0, update="double_slot")
    assert tier.generation == 2 and tier.metadata() == {"step": 3}
    _check(tier, _SMALL, step=3)
    tier.close()


def test_full_disk_then_space_freed_same_tier_commits(tmpfs):
    disk = tmpfs("disk", "size=4m")
    tier = NvmeTier(disk, process_index=0, update="double_slot")
    _write(tier, _SMALL, step=1)
    tier.commit({"step": 1})
    # another tenant fills the disk
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\1" * (free - 256 * 1024))
    with pytest.raises(TierError, match="disk full") as exc:
        try:
            for f in _write(tier, _SMALL, step=2):
                f.exception()
        finally:
            tier.commit({"step": 2})
    assert "intact" in str(exc.value)
    assert tier.generation == 1 and tier.metadata() == {"step": 1}
    _check(tier, _SMALL, step=1)

    # space is freed: the same tier object commits the next generation
    filler.unlink()
    for f in _write(tier, _SMALL, step=2):
        f.result()
    tier.commit({"step": 2})
    assert tier.generation == 2
    _check(tier, _SMALL, step=2)
    tier.close()
    tier = NvmeTier(disk, process_index=0, update="double_slot")
    assert tier.metadata() == {"step": 2}
    _check(tier, _SMALL, step=2)
    tier.close()
