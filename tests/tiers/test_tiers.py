"""Every tier: bitwise round trips, concurrency, bounded in-flight bytes, atomic commit."""
import gc
import threading
import weakref
from concurrent.futures import Future

import ml_dtypes
import numpy as np
import pytest

from zinf_jax._internal.futures import all_of
from zinf_jax.tiers import CpuTier, DeviceTier, NvmeTier, ShardSpec, TierError

KINDS = ["device", "cpu", "cpu-numpy", "nvme"]


def _open(kind, tmp_path, bound=1 << 30):
    if kind == "device":
        return DeviceTier(max_in_flight_bytes=bound)
    if kind == "cpu":
        return CpuTier(max_in_flight_bytes=bound)
    if kind == "cpu-numpy":
        return CpuTier(memory="numpy", max_in_flight_bytes=bound)
    return NvmeTier(tmp_path, max_in_flight_bytes=bound)


@pytest.fixture(params=KINDS)
def tier(request, tmp_path):
    t = _open(request.param, tmp_path)
    yield t
    t.close()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
def test_roundtrip_bitwise(tier, dtype):
    rng = np.random.default_rng(1)
    spec = ShardSpec(shard_shape=(33, 7), dtype=np.dtype(dtype).name, num_shards=3)
    tier.declare("p/w", spec)
    vals = [(rng.standard_normal((33, 7)) * 1e3).astype(dtype) for _ in range(3)]
    for f in [tier.put("p/w", i, v) for i, v in enumerate(vals)]:
        f.result()
    got = [np.asarray(tier.get("p/w", i).result()) for i in range(3)]  # read-your-writes
    assert all(g.tobytes() == v.tobytes() and g.dtype == v.dtype for g, v in zip(got, vals))
    tier.commit({"step": 3})
    assert tier.metadata() == {"step": 3}
    out = np.empty((33, 7), dtype)
    assert tier.get("p/w", 1, out=out).result() is out
    assert out.tobytes() == vals[1].tobytes()


def test_many_concurrent_ops_and_bound(tmp_path):
    for kind in KINDS:
        shard = (256, 256)  # 256 KiB float32: at INLINE_BYTES, so memory tiers use their pool
        nbytes = 256 * 256 * 4
        bound = 3 * nbytes
        t = _open(kind, tmp_path / kind, bound) if kind != "nvme" else None
        if t is None:
            (tmp_path / kind).mkdir()
            t = _open(kind, tmp_path / kind, bound)
        spec = ShardSpec(shard_shape=shard, dtype="float32", num_shards=8)
        keys = [f"k{j}" for j in range(6)]
        for k in keys:
            t.declare(k, spec)
        rng = np.random.default_rng(2)
        vals = {(k, i): rng.standard_normal(shard).astype(np.float32) for k in keys for i in range(8)}
        seen = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.append(t.budget.in_flight)

        w = threading.Thread(target=watch)
        w.start()
        futs = [t.put(k, i, v) for (k, i), v in vals.items()]
        for f in futs:
            f.result()
        t.commit()
        reads = {(k, i): t.get(k, i) for (k, i) in vals}
        ok = all(np.array_equal(np.asarray(f.result()), vals[ki]) for ki, f in reads.items())
        stop.set()
        w.join()
        assert ok, kind
        assert t.budget.peak <= bound, (kind, t.budget.peak)
        assert max(seen) <= bound and t.budget.in_flight == 0
        assert t.budget.peak >= nbytes  # the accounting did count the work
        t.close()


def test_spec_mismatch_and_unknown(tier):
    tier.declare("a", ShardSpec(shard_shape=(4,), dtype="float32", num_shards=2))
    with pytest.raises(TierError, match="'a'"):
        tier.declare("a", ShardSpec(shard_shape=(5,), dtype="float32", num_shards=2))
    with pytest.raises(TierError, match="unknown key"):
        tier.put("nope", 0, np.zeros(4, np.float32))
    with pytest.raises(TierError, match="shape"):
        tier.put("a", 0, np.zeros(5, np.float32)).result()


def test_nvme_commit_is_atomic_and_persistent(tmp_path):
    spec = ShardSpec(shard_shape=(128,), dtype="float32", num_shards=4)
    t = NvmeTier(tmp_path, update="double_slot")
    t.declare("w", spec)
    old = [np.full(128, i, np.float32) for i in range(4)]
    for i, v in enumerate(old):
        t.put("w", i, v)
    t.commit({"step": 1})
    # a new generation, written but not committed, then the process "dies"
    for i in range(4):
        t.put("w", i, old[i] + 100).result()
    t.close()
    t = NvmeTier(tmp_path, update="double_slot")
    assert t.metadata() == {"step": 1} and t.generation == 1
    assert all(np.array_equal(t.get("w", i).result(), old[i]) for i in range(4))
    # a partial rewrite keeps unwritten shards from the committed slot
    t.put("w", 2, old[2] + 7)
    t.commit({"step": 2})
    t.close()
    t = NvmeTier(tmp_path, update="double_slot")
    got = [t.get("w", i).result() for i in range(4)]
    assert np.array_equal(got[2], old[2] + 7) and all(np.array_equal(got[i], old[i]) for i in (0, 1, 3))
    t.close()


def test_nvme_local_indices_only(tmp_path):
    t = NvmeTier(tmp_path, process_index=1, update="double_slot")
    t.declare("w", ShardSpec(shard_shape=(8,), dtype="float32", num_shards=4), local_indices=[2, 3])
    assert (tmp_path / "process_1").is_dir()
    with pytest.raises(TierError, match="not stored by this process"):
        t.put("w", 0, np.zeros(8, np.float32))
    t.close()


def test_put_does_not_alias_the_callers_buffer(tier):
    """The optimizer reuses its buffers once a put resolves; the tier must hold its own copy."""
    tier.declare("buf", ShardSpec(shard_shape=(64,), dtype="float32", num_shards=1))
    buf = np.arange(64, dtype=np.float32)
    tier.put("buf", 0, buf).result()
    buf[:] = -1.0
    assert np.array_equal(np.asarray(tier.get("buf", 0).result()), np.arange(64, dtype=np.float32))


@pytest.mark.parametrize("kind", ["device", "cpu", "cpu-numpy"])
def test_memory_tiers_hold_one_copy_in_program_order(kind, tmp_path):
    """No second copy while a step is uncommitted (the optimizer state would cost 24 B/param), and a
    get issued right after a put (not waited for) sees the put."""
    t = _open(kind, tmp_path)
    spec = ShardSpec(shard_shape=(1 << 16,), dtype="float32", num_shards=4)
    t.declare("s", spec)
    for f in [t.put("s", i, np.full(1 << 16, i, np.float32)) for i in range(4)]:
        f.result()
    t.commit({"step": 1})
    one = t.stored_bytes()
    assert one == 4 * spec.shard_nbytes
    for step in range(2, 5):
        got = []
        for i in range(4):
            t.put("s", i, np.full(1 << 16, 10 * step + i, np.float32))
            got.append(t.get("s", i))
        assert [float(np.asarray(g.result())[-1]) for g in got] == [10 * step + i for i in range(4)]
        assert t.stored_bytes() == one
        t.commit({"step": step})
    t.close()


def test_shards_kept_as_rows_of_one_array_follow_every_later_put():
    """CpuTier.share_rows: the optimizer's masters of a scanned run, read in one piece ([Note: masters in rows])."""
    t = CpuTier(memory="numpy")
    spec = ShardSpec(shard_shape=(1 << 17,), dtype="float32", num_shards=2)  # past INLINE_BYTES: puts on the pool
    keys = [f"master/l{k}" for k in range(3)]
    for k, key in enumerate(keys):
        t.declare(key, spec)
        for i in range(2):
            t.put(key, i, np.full(1 << 17, 10 * k + i, np.float32))
    rows = t.share_rows(keys, 1)  # waits for the puts in flight
    assert rows.shape == (3, 1 << 17) and [float(r[0]) for r in rows] == [1.0, 11.0, 21.0]
    t.wait()  # (shard 0's puts may still be in flight: they count once they land)
    before = t.stored_bytes()
    t.put(keys[1], 1, np.full(1 << 17, -5, np.float32)).result()
    t.put_many([(keys[2], 1, np.full(1 << 17, -7, np.float32))])
    assert [float(r[-1]) for r in rows] == [1.0, -5.0, -7.0] and t.stored_bytes() == before
    assert float(np.asarray(t.get(keys[1], 0).result())[0]) == 10.0  # another shard index is not touched
    assert t.share_rows(keys, 1) is rows and t.share_rows(keys[:2], 1) is not rows
    t.declare("other", ShardSpec(shard_shape=(8,), dtype="float32", num_shards=2))
    t.put("other", 1, np.zeros(8, np.float32)).result()
    with pytest.raises(TierError, match="differ in shape"):
        t.share_rows([keys[0], "other"], 1)
    t.declare("empty", spec)
    with pytest.raises(TierError, match="no data"):
        t.share_rows([keys[0], "empty"], 1)
    pinned = CpuTier(memory="pinned_host")
    pinned.declare("p", spec)
    with pytest.raises(TierError, match="memory='numpy'"):
        pinned.share_rows(["p"], 0)
    t.close()
    pinned.close()


def test_shards_handed_out_to_be_written_in_place_are_what_the_tier_holds():
    """CpuTier.writable: the optimizer's updates in place ([Note: updates in place]): the arrays handed out are
    the stored ones, after any put in flight; the version grows; nothing is copied."""
    t = CpuTier(memory="numpy")
    spec = ShardSpec(shard_shape=(1 << 17,), dtype="float32", num_shards=2)  # past INLINE_BYTES: puts on the pool
    t.declare("m/a", spec)
    t.declare("v/a", spec)
    for key in ("m/a", "v/a"):
        t.put(key, 1, np.full(1 << 17, 3, np.float32))
    m, v = t.writable([("m/a", 1), ("v/a", 1)])  # waits for the puts in flight
    assert float(m[0]) == float(v[-1]) == 3.0
    copied, version = t.copied_bytes, t.version
    again = t.writable([("m/a", 1), ("v/a", 1)])
    assert again[0] is m and again[1] is v and t.version > version and t.copied_bytes == copied
    m += 1
    assert float(np.asarray(t.get("m/a", 1).result())[-1]) == 4.0
    with pytest.raises(TierError, match="no data"):
        t.writable([("m/a", 0)])
    with pytest.raises(TierError, match="out of range"):
        t.writable([("m/a", 2)])
    pinned = CpuTier(memory="pinned_host")
    pinned.declare("p", spec)
    with pytest.raises(TierError, match="memory='numpy'"):
        pinned.writable([("p", 0)])
    t.close()
    pinned.close()


def test_small_memory_transfers_complete_in_the_caller():
    # below INLINE_BYTES a put/get is done when it returns (no pool round trip); at it, it goes to the pool
    from zinf_jax.tiers.memory import INLINE_BYTES

    t = CpuTier(memory="numpy")
    small = ShardSpec(shard_shape=(INLINE_BYTES // 8,), dtype="float32", num_shards=1)
    big = ShardSpec(shard_shape=(INLINE_BYTES // 4,), dtype="float32", num_shards=1)
    t.declare("s", small)
    t.declare("b", big)
    gate = threading.Event()
    t._pool.submit(gate.wait)  # hold the pool's workers busy: a pooled transfer cannot finish yet
    t._pool.submit(gate.wait)
    assert t.put("s", 0, np.ones(small.shard_shape, np.float32)).done()
    fut = t.put("b", 0, np.ones(big.shard_shape, np.float32))
    assert not fut.done()
    gate.set()
    fut.result()
    np.testing.assert_array_equal(t.get("s", 0).result(), 1.0)
    t.close()


def test_put_many_and_get_many_round_trip_after_single_puts(tier):
    """Several shards in one call (a pack of small shards): bitwise as one at a time, in program order with earlier
    single puts (a large one still in flight is waited for), the caller's buffers not aliased."""
    rng = np.random.default_rng(2)
    tier.declare("a", ShardSpec(shard_shape=(5,), dtype="float32", num_shards=4))
    tier.declare("b", ShardSpec(shard_shape=(1 << 17,), dtype="bfloat16", num_shards=2))  # 256 KB: off the caller
    big = [rng.standard_normal(1 << 17).astype(ml_dtypes.bfloat16) for _ in range(2)]
    first = [tier.put("b", i, x) for i, x in enumerate(big)]  # maybe still in flight below
    small = [rng.standard_normal(5).astype(np.float32) for _ in range(4)]
    items = [("a", i, x) for i, x in enumerate(small)] + [("b", 1, big[0])]
    for f in tier.put_many(items):
        f.result()
    for f in first:
        f.result()
    want = [x.copy() for x in small]
    for x in small:
        x[:] = -1  # the tier kept copies
    outs = [np.empty(5, np.float32) for _ in range(4)] + [np.empty(1 << 17, ml_dtypes.bfloat16)]
    for f in tier.get_many([("a", i, outs[i]) for i in range(4)] + [("b", 0, outs[4])]):
        f.result()
    assert [o.tobytes() for o in outs[:4]] == [w.tobytes() for w in want]
    assert [np.asarray(tier.get("a", i).result()).tobytes() for i in range(4)] == [w.tobytes() for w in want]
    assert outs[4].tobytes() == big[0].tobytes()
    assert np.asarray(tier.get("b", 1).result()).tobytes() == big[0].tobytes()  # put_many's write, after put's
    with pytest.raises(TierError, match="shape"):
        tier.put_many([("a", 0, np.zeros(6, np.float32))])


def test_all_of_reports_the_first_error_in_list_order_and_leaves_no_cycle():
    gc.collect()
    gc.disable()  # what is freed here is freed by reference counting alone
    try:
        a, b, c = Future(), Future(), Future()
        out = all_of([a, b, c])
        c.set_exception(KeyError("c"))
        b.set_exception(ValueError("b"))  # fails after c, but comes first in the list
        assert not out.done()
        a.set_result(np.zeros(4))
        assert isinstance(out.exception(), ValueError)
        refs = [weakref.ref(x) for x in (a, b, c, out)]
        del a, b, c, out
        assert [r() for r in refs] == [None] * 4
        assert all_of([]).result() is None
    finally:
        gc.enable()


def test_finished_io_is_freed_without_the_cycle_collector(tier):
    # a future's callbacks must not reach the future again (see [Note: no future cycles]): a finished read
    # or write is freed, with its buffer, once the caller drops it, not when the cyclic collector runs
    spec = ShardSpec(shard_shape=(1024, 1024), dtype="float32", num_shards=2)  # 4 MiB: still in flight when
    tier.declare("p/w", spec)                                                  # its callbacks are added
    gc.collect()
    gc.disable()
    try:
        puts = [tier.put("p/w", i, np.full((1024, 1024), i, np.float32)) for i in range(2)]
        for f in puts:
            f.result()
        tier.commit()
        gets = [tier.get("p/w", i) for i in range(2)]
        got = [f.result() for f in gets]
        assert [float(np.asarray(g)[0, 0]) for g in got] == [0.0, 1.0]
        refs = [weakref.ref(f) for f in puts + gets]
        bufs = [weakref.ref(g) for g in got if isinstance(g, np.ndarray)]  # (jax.Arrays: the tier's own)
        del puts, gets, got, f
        assert [r() for r in refs + bufs] == [None] * len(refs + bufs)
    finally:
        gc.enable()
