"""Benchmark the streamed Adam on the NVMe tier: bounded RAM and I/O-bound step time.

The optimizer state of ``--gib`` GiB (12 B per parameter: float32 master, m, v)
lives in an :class:`~zinf_jax.tiers.NvmeTier` under ``--dir`` (on the disk being
measured, not tmpfs). The parameters are ``--params`` 2-D arrays split into
``--shards`` shards each; the first parameter (an "embedding") is three times
larger than the others, so its shards span several sub-groups. The script
measures, in one run:

* **memory**: RSS growth over the RSS before the step (psutil, sampled every
  few ms in a thread, and the kernel's VmHWM after a ``clear_refs`` reset),
  for the first step (which allocates the ``buffer_count`` sub-group buffers)
  and for later ones. Target: < 1 GiB for 4 GiB of state with
  ``buffer_count=4``, ``sub_group_size=16M``.
* **time**: each timed step starts with a cold page cache (fsync +
  ``posix_fadvise(DONTNEED)`` over every file of the tier); it reads and writes
  24 B per parameter (gradients stay in RAM). The raw disk bandwidth comes
  from ``O_DIRECT`` writes then reads of files of the same total size, in the
  same directory (fresh files and overwritten in place, before and after
  the steps), with 1 and ``--threads`` streams (the fastest counts).
  ``ratio = (read_bytes / raw_read + write_bytes / raw_write) / step_time``;
  target >= 0.8 (the Adam kernel hidden behind the I/O).
* **overlap**: the same steps with the Adam kernel replaced by a no-op (the
  driver's I/O alone, same pipeline, same tier); ``io_only_s / step_s`` near 1
  means the compute is fully hidden and the tier's I/O sets the step time.

Usage::

    .venv/bin/python scripts/bench_optim_stream.py [--gib 4] [--dir DIR] [--steps 3]
        [--sub-group-size 16777216] [--buffer-count 4] [--out results/bench_optim_stream.json]
"""
from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench_tiers import drop_cache  # noqa: E402  (same folder: fsync + fadvise every file)

GiB, MiB, GB = 1 << 30, 1 << 20, 1e9
REPO = Path(__file__).resolve().parent.parent


def raw_bandwidth(d: Path, total: int, block: int, streams: int) -> tuple[float, float, float]:
    """O_DIRECT writes (then fsync) of ``streams`` fresh files totalling ``total`` bytes, the same
    over the existing files in place, then reads; GB/s each (write, overwrite, read)."""
    d.mkdir(parents=True, exist_ok=True)
    per = max(block, total // streams // block * block)
    bufs = [mmap.mmap(-1, block) for _ in range(streams)]
    for b in bufs:
        np.frombuffer(b, np.uint8)[:] = 7

    def write(i: int, fresh: bool = True) -> None:
        fd = os.open(d / f"raw_{i}", os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0) | os.O_DIRECT, 0o644)
        try:
            for off in range(0, per, block):
                os.pwrite(fd, bufs[i], off)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(d / f"raw_{i}", os.O_RDONLY | os.O_DIRECT)
        try:
            for off in range(0, per, block):
                if os.preadv(fd, [bufs[i]], off) <= 0:
                    raise OSError(f"short read of raw_{i}")
        finally:
            os.close(fd)

    def overwrite(i: int) -> None:
        write(i, fresh=False)

    out = []
    for fn in (write, overwrite, read):
        drop_cache(d)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(streams) as ex:
            list(ex.map(fn, range(streams)))
        out.append(per * streams / (time.perf_counter() - t0) / GB)
    shutil.rmtree(d)
    return out[0], out[1], out[2]


def measure_raw(d: Path, total: int, threads: int, earlier: dict | None = None) -> dict:
    """Raw bandwidth with 1 and ``threads`` streams (merged with an earlier measurement, labelled)."""
    raw = dict(earlier or {})
    tag = "after" if earlier else "before"
    for streams in sorted({1, threads}):
        w, o, r = raw_bandwidth(d, total, 64 * MiB, streams)
        raw[f"{tag}_{streams}stream"] = {"write_gbps": w, "overwrite_gbps": o, "read_gbps": r}
        print(f"raw {tag}, {streams} stream(s): write {w:.2f} (overwrite {o:.2f}) GB/s, read {r:.2f} GB/s",
              flush=True)
    return raw


class DiskStats:
    """Bytes read and written and busy time of the block device holding a path (/proc/diskstats).

    The device counts everyone's I/O: more bytes than the step moved mean another
    job shared the disk during the measurement.
    """

    def __init__(self, path: Path):
        st = os.stat(path)
        self.dev = (os.major(st.st_dev), os.minor(st.st_dev))

    def read(self) -> tuple[int, int, int] | None:
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    x = line.split()
                    if (int(x[0]), int(x[1])) == self.dev:
                        return int(x[5]) * 512, int(x[9]) * 512, int(x[12])
        except (OSError, ValueError, IndexError):
            pass
        return None

    def delta(self, before) -> dict | None:
        after = self.read()
        if before is None or after is None:
            return None
        return {"read_bytes": after[0] - before[0], "write_bytes": after[1] - before[1],
                "busy_s": (after[2] - before[2]) / 1000}


class RssSampler:
    """Peak RSS while active: a sampling thread plus the kernel's VmHWM (reset by clear_refs)."""

    def __init__(self, period: float = 0.002):
        self.proc, self.period = psutil.Process(), period

    @staticmethod
    def _hwm() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM)
            self.hwm_ok = True
        except OSError:
            self.hwm_ok = False
        self.base = self.proc.memory_info().rss
        self.peak, self._stop = self.base, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        hwm = self._hwm() if self.hwm_ok else None
        self.growth_sampled = self.peak - self.base
        self.growth_hwm = None if hwm is None else hwm - self.base


def build_layouts(total_params: int, n_params: int, shards: int, width: int = 1024):
    """``n_params`` 2-D parameters (the first 3x the others), rows a multiple of ``shards``."""
    from zinf_jax.plan.partition import ParamLayout

    unit = total_params / (n_params + 2)
    out = {}
    for k in range(n_params):
        rows = max(shards, int((3 if k == 0 else 1) * unit / width) // shards * shards)
        path = "embed/embedding" if k == 0 else f"blocks/{k - 1}/kernel"
        out[path] = ParamLayout(path=path, shape=(rows, width), dtype="float32", kind="sharded", dim=0,
                                num_shards=shards)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of optimizer state (12 B/param)")
    ap.add_argument("--dir", default=None, help="directory on the measured disk (default: results/ in the repo)")
    ap.add_argument("--params", type=int, default=8, help="number of parameters")
    ap.add_argument("--shards", type=int, default=4, help="shards per parameter (all local)")
    ap.add_argument("--sub-group-size", type=int, default=16 * MiB, help="elements per sub-group")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--threads", type=int, default=4, help="streams of the multi-stream raw baseline")
    ap.add_argument("--direct-io", action="store_true", help="open the tier with O_DIRECT")
    ap.add_argument("--no-io-only", action="store_true", help="skip the I/O-only (no-op kernel) steps")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_optim_stream.json"))
    ap.add_argument("--keep", action="store_true", help="keep the tier directory")
    args = ap.parse_args()

    from zinf_jax.optim import StreamedAdam, adamw, warmup
    from zinf_jax.tiers import NvmeTier

    warmup()
    base_dir = Path(args.dir) if args.dir else REPO / "results"
    base_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_optim_stream_", dir=base_dir))
    total_params = int(args.gib * GiB / 12)
    layouts = build_layouts(total_params, args.params, args.shards)
    n = sum(math.prod(l.shape) for l in layouts.values())
    state_bytes = 12 * n
    max_shard = max(math.prod(l.shard_shape) for l in layouts.values())
    print(f"{n / 1e6:.1f}M params, {state_bytes / GiB:.2f} GiB state, {len(layouts)} params x {args.shards} shards, "
          f"largest shard {max_shard / 1e6:.1f}M, dir {work}", flush=True)
    res: dict = {"host": platform.node(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                 "dir": str(work), "params": n, "state_bytes": state_bytes, "args": vars(args)}
    try:
        raw_before = measure_raw(work / "raw", state_bytes, args.threads)
        (tdir := work / "tier").mkdir()
        tier = NvmeTier(tdir, process_index=0, max_in_flight_bytes=2 * GiB, direct_io=args.direct_io)
        opt = StreamedAdam(adamw(1e-4, weight_decay=0.01, clip_norm=1.0), tier, layouts,
                           local_indices=lambda p: list(range(args.shards)),
                           sub_group_size=args.sub_group_size, buffer_count=args.buffer_count)
        opt.declare()
        rng = np.random.default_rng(0)
        src = rng.standard_normal(max_shard, dtype=np.float32)
        grads = (rng.standard_normal(max_shard, dtype=np.float32) * np.float32(1e-3))
        t0 = time.perf_counter()
        for p, lay in layouts.items():
            k = math.prod(lay.shard_shape)
            for i in range(args.shards):
                opt.init_shard(p, i, src[:k].reshape(lay.shard_shape))
        opt.commit({})
        res["init_s"] = time.perf_counter() - t0
        res["init_write_gbps"] = state_bytes / res["init_s"] / GB
        print(f"init {res['init_s']:.1f}s ({res['init_write_gbps']:.2f} GB/s)", flush=True)
        del src

        def grad(p, i):
            lay = layouts[p]
            return grads[:math.prod(lay.shard_shape)].reshape(lay.shard_shape)

        def write_param(p, i, arr):  # the engine would cast and put it; here it only touches it
            return float(arr.reshape(-1)[0])

        steps, disk = [], DiskStats(tdir)
        rss_before_first = psutil.Process().memory_info().rss
        for s in range(args.steps + 1):
            files = drop_cache(tdir)
            d0 = disk.read()
            with RssSampler() as rss:
                t0 = time.perf_counter()
                met = opt.step(grad, write_param)
                dt = time.perf_counter() - t0
            dd = disk.delta(d0)
            rec = {"step_s": dt, "rss_growth_sampled": rss.growth_sampled, "rss_growth_hwm": rss.growth_hwm,
                   "rss_peak_over_baseline": max(rss.peak, rss.base + (rss.growth_hwm or 0)) - rss_before_first,
                   "files_dropped": files, "metrics": met, "stats": dict(opt.last_stats),
                   "peak_live_buffers": opt.peak_live_buffers, "device": dd}
            steps.append(rec)
            hwm = "n/a" if rss.growth_hwm is None else f"{rss.growth_hwm / GiB:.3f}"
            dev = "" if dd is None else (f"; device read {dd['read_bytes'] / GB:.2f} GB, write "
                                         f"{dd['write_bytes'] / GB:.2f} GB, busy {dd['busy_s'] / dt:.0%}")
            print(f"step {s}{' (warm-up)' if s == 0 else ''}: {dt:.2f}s, {24 * n / dt / GB:.2f} GB/s moved, "
                  f"rss +{rss.growth_sampled / GiB:.3f} GiB sampled, +{hwm} GiB hwm, "
                  f"+{rec['rss_peak_over_baseline'] / GiB:.3f} GiB over the RSS before step 0{dev}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in opt.last_stats.items()), flush=True)
        res["steps"] = steps
        io_only = []
        if not args.no_io_only:
            import zinf_jax.optim.driver as drv

            real = drv.adam_update_shard
            drv.adam_update_shard = lambda *a, **k: None  # the same pipeline without the Adam kernel
            try:
                for s in range(args.steps):
                    drop_cache(tdir)
                    t0 = time.perf_counter()
                    opt.step(grad, write_param)
                    io_only.append(time.perf_counter() - t0)
                    print(f"I/O-only step {s}: {io_only[-1]:.2f}s, {24 * n / io_only[-1] / GB:.2f} GB/s moved; "
                          + ", ".join(f"{k} {v:.2f}" for k, v in opt.last_stats.items()), flush=True)
            finally:
                drv.adam_update_shard = real
        res["io_only_step_s"] = io_only
        tier.close()

        raw = measure_raw(work / "raw", state_bytes, args.threads, raw_before)
        raw_w = max(max(v["write_gbps"], v["overwrite_gbps"]) for v in raw.values())
        raw_r = max(v["read_gbps"] for v in raw.values())
        res["raw"] = {**raw, "write_gbps": raw_w, "read_gbps": raw_r}

        timed = [s["step_s"] for s in steps[1:]] or [steps[0]["step_s"]]
        step_s = statistics.median(timed)
        ideal = 12 * n / (raw_r * GB) + 12 * n / (raw_w * GB)
        res["summary"] = {
            "state_gib": state_bytes / GiB,
            "bytes_moved_per_step": 24 * n,
            "step_s_median": step_s,
            "step_s_ideal_at_raw_bandwidth": ideal,
            "ratio": ideal / step_s,
            "moved_gbps": 24 * n / step_s / GB,
            "rss_growth_first_step_gib": max(steps[0]["rss_growth_sampled"], steps[0]["rss_growth_hwm"] or 0) / GiB,
            "rss_growth_later_steps_gib": max(max(s["rss_growth_sampled"], s["rss_growth_hwm"] or 0)
                                              for s in steps[1:]) / GiB if len(steps) > 1 else None,
            "rss_peak_over_baseline_later_steps_gib": max(s["rss_peak_over_baseline"] for s in steps[1:]) / GiB
            if len(steps) > 1 else None,
            "buffer_bytes": args.buffer_count * min(args.sub_group_size, max_shard) * 12,
            "adam_s_median": statistics.median(s["stats"]["adam_s"] for s in steps[1:] or steps),
            "io_only_step_s_median": statistics.median(io_only) if io_only else None,
            "overlap_ratio": statistics.median(io_only) / step_s if io_only else None,
        }
        print(json.dumps(res["summary"], indent=1), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
