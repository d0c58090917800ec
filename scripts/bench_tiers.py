"""Bandwidth of the NVMe tier against the raw disk, measured side by side.

For each shard size the script measures, on the same directory and with a cold
page cache:

* raw write: ``O_DIRECT`` writes of fresh files from page-aligned (mmap) buffers,
  then ``fsync``; with 1 stream and with ``--threads`` streams; and the same
  into the existing files in place (``overwrite``: no block allocation, which
  is what the tier does from its third commit on);
* raw read: ``O_DIRECT`` reads into page-aligned buffers (1 and ``--threads`` streams);
* tier write: ``NvmeTier.put`` of ``--keys`` keys x N shards, all in flight, then
  ``commit`` (fsync on, the crash-safe setting);
* tier cold read: ``NvmeTier.get(..., out=preallocated)`` of every shard, all in
  flight, after ``posix_fadvise(DONTNEED)`` over every file under the tier dir
  (``buffered``), or with the tier opened with ``direct_io=True`` (``direct``).

* the cost of checksums: every tier mode runs twice a rep, with checksums (the
  default: digests computed on write, verified on every read) and without
  (``NvmeTier(checksums=False)``, ``<mode>_unverified``): the tier is reopened
  each time on the same directory, so both write and read the same files (a
  separate directory each gave a steady +-15% from where the files lay on
  disk), and their order alternates rep by rep. The ratio verified /
  unverified is the median over reps of the ratio within a rep. Target:
  >= 0.95. The digest's single-thread speed (and the alternatives') is recorded.

Raw and tier runs alternate rep by rep, because a shared disk drifts. It records
per-rep GB/s, medians, and the ratio tier/raw as the median over reps of
tier / raw of the same rep and kind (raw = the faster of 1 and N streams; the
tier's first two reps create its slots' files and are compared with fresh raw
writes, later reps overwrite in place and are compared with raw overwrites) in
a JSON file. The target is ratio >= 0.8 for shards of 64 MiB and more.

Usage::

    python scripts/bench_tiers.py [--sizes 4,16,64,256] [--total 1GiB] [--reps 7]
        [--dir DIR] [--out results/bench_tiers.json] [--modes buffered,direct]
        [--chunk-mib 16] [--read-threads 4] [--write-threads 4]   # tier options (0 MiB: chunk = shard)
        [--checksums both|on|off]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MiB = 1 << 20
GB = 1e9
BLOCK = 8 * MiB  # raw I/O request size


def _parse_bytes(s: str) -> int:
    s = s.strip().lower()
    for suffix, mult in (("gib", 1 << 30), ("mib", MiB), ("kib", 1 << 10), ("g", 1 << 30), ("m", MiB)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(float(s))


def fstype(path: Path) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fs, *_ = line.split()
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, fs
    except OSError:
        pass
    return kind


def scratch_root(arg: str | None, prefix: str) -> Path:
    """A fresh directory on a real disk: under ``arg``, else the temp dir unless it is tmpfs, else results/."""
    if arg:
        base = Path(arg)
    else:
        base = Path(tempfile.gettempdir())
        if fstype(base.resolve()) in ("tmpfs", "ramfs"):
            base = Path(__file__).resolve().parents[1] / "results"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned, pre-faulted anonymous buffer (usable for O_DIRECT)."""
    m = mmap.mmap(-1, nbytes)
    np.frombuffer(m, np.uint8)[:] = 1
    return m


def drop_cache(root: Path) -> int:
    """fsync + posix_fadvise(DONTNEED) every file under ``root``; returns the file count."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


# ------------------------------------------------------------------ raw disk


def raw_write(d: Path, size: int, nfiles: int, threads: int, bufs: list[mmap.mmap], fresh: bool = True) -> float:
    """Writes ``nfiles`` files of ``size`` bytes with O_DIRECT + fsync; GB/s.

    ``fresh``: new files (blocks allocated as they are written); else in place
    over the files of the previous call.
    """
    if fresh:
        for i in range(nfiles):
            (d / f"raw_{i}").unlink(missing_ok=True)
    os.sync()

    def one(i: int) -> None:
        mv = memoryview(bufs[i % len(bufs)])
        fd = os.open(d / f"raw_{i}", os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0) | os.O_DIRECT, 0o644)
        try:
            off = 0
            while off < size:
                n = min(BLOCK, size - off)
                off += os.pwrite(fd, mv[off : off + n], off)
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(nfiles)))
    return size * nfiles / (time.perf_counter() - t0) / GB


def raw_read(d: Path, size: int, nfiles: int, threads: int, bufs: list[mmap.mmap]) -> float:
    """Reads the files back with O_DIRECT into aligned buffers; GB/s."""
    drop_cache(d)
    local = threading.local()
    free = list(bufs)
    lock = threading.Lock()

    def one(i: int) -> None:
        if not hasattr(local, "mv"):
            with lock:
                local.mv = memoryview(free.pop())
        fd = os.open(d / f"raw_{i}", os.O_RDONLY | os.O_DIRECT)
        try:
            off = 0
            while off < size:
                n = min(BLOCK, size - off)
                got = os.preadv(fd, [local.mv[off : off + n]], off)
                if got <= 0:
                    raise OSError(f"short read of raw_{i} at {off}")
                off += got
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(nfiles)))
    return size * nfiles / (time.perf_counter() - t0) / GB


def hash_speeds(nbytes: int = 64 * MiB, reps: int = 5) -> dict[str, float]:
    """Single-thread GB/s of the tier's digest and of the alternatives that are installed."""
    from zinf_jax.tiers.checksum import ALGORITHM, digest

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    fns = {f"{ALGORITHM} (the tier's)": digest, "zlib.crc32": zlib.crc32}
    try:
        import crc32c

        fns["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        fn(data)
        best = min(_timed(fn, data) for _ in range(reps))
        out[name] = nbytes / best / GB
    return out


def _timed(fn, data) -> float:
    t0 = time.perf_counter()
    fn(data)
    return time.perf_counter() - t0


# ------------------------------------------------------------------ the tier


def tier_round(tier, keys: list[str], nshards: int, src: list[np.ndarray], outs, step: int) -> tuple[float, float]:
    """One put+commit of every shard, then a cold read of every shard; (write, read) GB/s."""
    nbytes = sum(a.nbytes for a in src) * nshards
    t0 = time.perf_counter()
    for k, key in enumerate(keys):
        for i in range(nshards):
            tier.put(key, i, src[k])
    tier.commit({"step": step})
    w = nbytes / (time.perf_counter() - t0) / GB
    drop_cache(tier.dir)
    t0 = time.perf_counter()
    futs = [tier.get(key, i, out=outs[k][i]) for k, key in enumerate(keys) for i in range(nshards)]
    for f in futs:
        f.result()
    r = nbytes / (time.perf_counter() - t0) / GB
    return w, r


def _check_roundtrip(tier, keys, nshards, src, outs) -> None:
    for k in range(len(keys)):
        for i in range(nshards):
            if not np.array_equal(outs[k][i].view(np.uint8), src[k].view(np.uint8)):
                raise AssertionError(f"tier read back wrong data for {keys[k]}[{i}]")


def _stat(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "reps": xs}


def _variants(modes: list[str], checksums: str) -> dict[str, tuple[str, bool]]:
    """Tier runs: name -> (mode, checksums on); ``<mode>`` has checksums, ``<mode>_unverified`` not."""
    out = {}
    for mode in modes:
        if checksums in ("both", "on"):
            out[mode] = (mode, True)
        if checksums in ("both", "off"):
            out[f"{mode}_unverified"] = (mode, False)
    return out


def _checksum_cost(runs: dict[str, list[float]], modes: list[str], reps: int) -> dict:
    """Per mode and op: median over reps of verified / unverified GB/s of the same rep."""
    out = {}
    for mode in modes:
        for op in ("write", "read"):
            on, off = runs[f"tier_{mode}_{op}"], runs[f"tier_{mode}_unverified_{op}"]
            ratios = [a / b for a, b in zip(on, off)]
            out.setdefault(mode, {})[f"{op}_ratio"] = statistics.median(ratios)
            out[mode][f"{op}_ratio_per_rep"] = ratios
    return out


def _tier_rep(root: Path, variants: dict[str, tuple[str, bool]], rep: int, keys: list[str], nshards: int,
              src: list[np.ndarray], outs, tier_opts: dict, runs: dict[str, list[float]]) -> None:
    """One round per variant, each on its mode's directory, reopened with or without checksums."""
    from zinf_jax.tiers import NvmeTier, ShardSpec

    order = list(variants.items())
    for name, (mode, checks) in order if rep % 2 == 0 else order[::-1]:
        tier = NvmeTier(root / f"tier_{mode}", process_index=0, direct_io=(mode == "direct"), checksums=checks,
                        **tier_opts)
        try:
            for key in keys:
                tier.declare(key, ShardSpec(shard_shape=src[0].shape, dtype="float32", num_shards=nshards))
            w, r = tier_round(tier, keys, nshards, src, outs, rep)
            _check_roundtrip(tier, keys, nshards, src, outs)
        finally:
            tier.close()
        runs.setdefault(f"tier_{name}_write", []).append(w)
        runs.setdefault(f"tier_{name}_read", []).append(r)


def _overall_cost(results: list[dict]) -> dict:
    """Verified / unverified over every size and mode: median of all per-rep ratios, per op."""
    out = {}
    for op in ("write", "read"):
        xs = [x for r in results for c in r.get("checksum_cost", {}).values() for x in c[f"{op}_ratio_per_rep"]]
        if xs:
            out[f"{op}_ratio"] = statistics.median(xs)
    return out


def bench_size(root: Path, size: int, total: int, reps: int, threads: int, nkeys: int, modes: list[str],
               tier_opts: dict, checksums: str = "both") -> dict:
    """Measures one shard size; raw and tier runs are interleaved rep by rep (the disk drifts)."""
    nfiles = max(1, total // size)
    nshards = max(1, nfiles // nkeys)
    res: dict = {"shard_mib": size / MiB, "bytes_per_rep": size * nshards * nkeys, "files_raw": nfiles,
                 "keys": nkeys, "shards_per_key": nshards}
    streams = sorted({1, threads})
    raw_dir = root / "raw"
    raw_dir.mkdir()
    bufs = [_aligned(size) for _ in range(threads)]

    rng = np.random.default_rng(0)
    shape = (size // 4 // 1024, 1024)
    src = [rng.random(shape, dtype=np.float32) for _ in range(nkeys)]
    outs = [[np.ones(shape, np.float32) for _ in range(nshards)] for _ in range(nkeys)]  # pre-faulted
    keys = [f"bench/key{k}" for k in range(nkeys)]
    tiers = _variants(modes, checksums)
    for mode in modes:
        (root / f"tier_{mode}").mkdir()

    runs: dict[str, list[float]] = {}
    for rep in range(reps):
        for n in streams:
            runs.setdefault(f"raw_write_{n}stream", []).append(raw_write(raw_dir, size, nfiles, n, bufs))
            runs.setdefault(f"raw_overwrite_{n}stream", []).append(raw_write(raw_dir, size, nfiles, n, bufs, False))
            runs.setdefault(f"raw_read_{n}stream", []).append(raw_read(raw_dir, size, nfiles, n, bufs))
        _tier_rep(root, tiers, rep, keys, nshards, src, outs, tier_opts, runs)
        line = "  ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items())
        print(f"  rep {rep}: {line}", flush=True)
    shutil.rmtree(raw_dir)
    for b in bufs:
        b.close()

    for n in streams:
        res[f"raw_overwrite_{n}stream_gbps"] = _stat(runs[f"raw_overwrite_{n}stream"])
    # A mode's first two commits create the files of its two slots; later ones overwrite them in
    # place. Each tier rep is compared with the raw run of the same kind in the same rep.
    fresh_reps = -(-2 // (len(tiers) // len(modes)))  # commits per rep: one per variant
    tier_kind = ["write" if i < fresh_reps else "overwrite" for i in range(reps)]
    best = {k: [max(runs[f"raw_{k}_{n}stream"][i] for n in streams) for i in range(reps)]
            for k in ("write", "overwrite", "read")}
    res["tier_write_kind_per_rep"] = tier_kind
    for op in ("write", "overwrite", "read"):
        for n in streams:
            res[f"raw_{op}_{n}stream_gbps"] = _stat(runs[f"raw_{op}_{n}stream"])
        res[f"raw_{op}_gbps"] = _stat(best[op])
    for op in ("write", "read"):
        raw_rep = [best[tier_kind[i] if op == "write" else "read"][i] for i in range(reps)]
        for mode in tiers:
            t = runs[f"tier_{mode}_{op}"]
            ratios = [a / b for a, b in zip(t, raw_rep)]
            res.setdefault(f"tier_{mode}", {})[f"{op}_gbps"] = _stat(t)
            res[f"tier_{mode}"][f"{op}_ratio"] = statistics.median(ratios)
            res[f"tier_{mode}"][f"{op}_ratio_per_rep"] = ratios
    summary = [f"raw write {res['raw_write_gbps']['median']:.3f} (overwrite {res['raw_overwrite_gbps']['median']:.3f}) "
               f"read {res['raw_read_gbps']['median']:.3f} GB/s"]
    for mode in tiers:
        m = res[f"tier_{mode}"]
        summary.append(f"tier {mode}: write {m['write_gbps']['median']:.3f} ({m['write_ratio']:.0%}) "
                       f"read {m['read_gbps']['median']:.3f} ({m['read_ratio']:.0%})")
    if checksums == "both":
        res["checksum_cost"] = _checksum_cost(runs, modes, reps)
        summary += [f"verified/unverified {mode}: write {c['write_ratio']:.3f} read {c['read_ratio']:.3f}"
                    for mode, c in res["checksum_cost"].items()]
    print("  => " + "; ".join(summary), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4,16,64,256",
                   help="shard sizes in MiB, comma-separated (below direct_min_bytes, 1 MiB: tensorstore's I/O)")
    p.add_argument("--total", default="1GiB", help="bytes written and read per size and rep")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=4, help="raw I/O streams (compared with 1 stream)")
    p.add_argument("--keys", type=int, default=4, help="tier keys (shards of all keys are in flight together)")
    p.add_argument("--modes", default="buffered,direct",
                   help="tier modes: buffered (cold via fadvise), direct (direct_io=True)")
    p.add_argument("--inflight", default="1GiB", help="tier max_in_flight_bytes")
    p.add_argument("--chunk-mib", type=float, default=None, help="tier chunk_bytes in MiB (0: chunk = shard)")
    p.add_argument("--read-threads", type=int, default=None, help="tier read_threads")
    p.add_argument("--write-threads", type=int, default=None, help="tier write_threads")
    p.add_argument("--checksums", choices=["both", "on", "off"], default="both",
                   help="tier runs with checksums (on), without (off), or both in the same reps (their cost)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under cwd)")
    p.add_argument("--out", default="results/bench_tiers.json")
    a = p.parse_args(argv)

    sizes = [max(4096, int(float(s) * MiB) // 4096 * 4096) for s in a.sizes.split(",")]  # 0.5: the tensorstore route
    total = _parse_bytes(a.total)
    base = Path(a.dir) if a.dir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    fs = fstype(base)
    if fs in ("tmpfs", "ramfs"):
        print(f"warning: {base} is on {fs}: this measures RAM, not a disk", file=sys.stderr)
    tier_opts: dict = {"max_in_flight_bytes": _parse_bytes(a.inflight)}
    if a.chunk_mib is not None:
        tier_opts["chunk_bytes"] = int(a.chunk_mib * MiB) if a.chunk_mib > 0 else 1 << 62
    for opt in ("read_threads", "write_threads"):
        if getattr(a, opt) is not None:
            tier_opts[opt] = getattr(a, opt)
    n_tiers = len(a.modes.split(",")) * (2 if a.checksums == "both" else 1)
    need = int(total * (1.2 + 2.1 * n_tiers))  # raw files + both slots of every tier
    free = shutil.disk_usage(base).free
    if free < need:
        print(f"error: {base} has {free / GB:.1f} GB free, need {need / GB:.1f} GB", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix=".bench_tiers.", dir=base))
    print(f"measuring in {root} ({fs}); {total / MiB:.0f} MiB per size, {a.reps} reps", flush=True)
    results = []
    try:
        for size in sizes:
            print(f"shard {size / MiB:g} MiB:", flush=True)
            sub = root / f"s{size}"
            sub.mkdir()
            results.append(bench_size(sub, size, total, a.reps, a.threads, a.keys, a.modes.split(","), tier_opts,
                                      a.checksums))
            shutil.rmtree(sub, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    import tensorstore

    from zinf_jax.tiers.checksum import ALGORITHM

    doc = {
        "what": "NvmeTier vs raw disk bandwidth, cold cache, medians over reps (GB/s = 1e9 B/s)",
        "target": "tier/raw >= 0.8 for read and write at shard >= 64 MiB; checksum_cost (verified/unverified) >= 0.95",
        "checksum": {"algorithm": ALGORITHM, "hash_gbps_one_thread": hash_speeds(),
                     "verified_vs_unverified_all": _overall_cost(results)},
        "config": {"sizes_mib": [s / MiB for s in sizes], "total_bytes": total, "reps": a.reps,
                   "checksums": a.checksums,
                   "threads": a.threads, "keys": a.keys, "modes": a.modes.split(","),
                   "tier_options": {k: v for k, v in tier_opts.items()}, "dir": str(base), "fstype": fs},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "tensorstore": getattr(tensorstore, "__version__", "?"),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "results": results,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
