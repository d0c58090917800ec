"""Table (markdown) and plot (PNG) of several ``scripts/scale_run.py`` results.

Usage::

    python scripts/scale_plot.py results/scale_run_*.json [--png results/scale_run.png]

Prints one markdown row per run (by size): parameters, init seconds and its ratio
to the raw disk write bandwidth, the median step time after the first and its
split, the step's I/O bound (its bytes at raw disk bandwidth), the overlap ratio
where measured, peak RSS growth, bytes on disk per parameter, and the estimator's
ratios. The PNG shows, per size, the step split as stacked bars next to the I/O
bound, and the RSS growth and disk bytes per parameter against size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

GiB = 1 << 30


def load(paths: list[str]) -> list[dict]:
    """The runs, by size, with the estimate recomputed by the current estimator."""
    from scale_run import estimate_vs_measured  # same folder

    runs = sorted((r for r in (json.loads(Path(p).read_text()) for p in paths) if "disk" in r),
                  key=lambda r: r["params"])
    for r in runs:
        if "rss_base" not in r:  # runs before the base was recorded: recover it from the first estimate
            r["rss_base"] = r["estimate"]["host_rss_bytes"] / r["estimate"]["rss_ratio"] - r["rss_growth"]
        r["args"].setdefault("nvme_update", "in_place")
        r["estimate"] = estimate_vs_measured(r)
    return runs


def _steady(run: dict) -> list[dict]:
    return run["steps"][1:] or run["steps"]


def _med(run: dict, f) -> float:
    return statistics.median(f(s) for s in _steady(run))


def split(run: dict) -> dict[str, float]:
    """Median seconds of each part of a step (after the first)."""
    ts = lambda k: _med(run, lambda s: s["time_split"].get(k, 0.0))  # noqa: E731
    fwd_bwd, fetch, grads = ts("forward_backward_s"), ts("fetch_wait_s"), ts("grads_out_s")
    return {"compute": fwd_bwd - fetch - grads, "fetch wait": fetch, "grads out": grads,
            "opt read wait": ts("optimizer_read_wait_s"), "opt update": ts("optimizer_adam_s"),
            "opt write wait": ts("optimizer_write_wait_s"),
            "opt other": ts("optimizer_total_s") - ts("optimizer_read_wait_s") - ts("optimizer_adam_s")
            - ts("optimizer_write_wait_s")}


def table(runs: list[dict]) -> str:
    head = ("| params | devices | init s (× raw write) | step s | compute / fetch wait / grads out / optimizer s | "
            "I/O bound s | overlap | loss | RSS growth GiB | disk B/param | estimate RSS, disk |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        sp = split(r)
        opt = sum(v for k, v in sp.items() if k.startswith("opt"))
        ov = r.get("overlap", {}).get("ratio")
        losses = " → ".join(f"{s['loss']:.2f}" for s in r["steps"])
        rows.append(
            f"| {r['params'] / 1e9:.2f}B | {r['devices']} | {r['init']['seconds']:.0f} "
            f"({r['init']['ratio_to_raw_write']:.2f}×) | {_med(r, lambda s: s['step_time_s']):.1f} | "
            f"{sp['compute']:.1f} / {sp['fetch wait']:.1f} / {sp['grads out']:.1f} / {opt:.1f} | "
            f"{_med(r, lambda s: s['io_bound_s']):.1f} | {'—' if ov is None else f'{ov:.2f}×'} | {losses} | "
            f"{r['rss_growth'] / GiB:.2f} | {r['disk']['bytes_per_param']:.1f} | "
            f"{r['estimate']['rss_ratio']:.2f}×, {r['estimate']['nvme_ratio']:.2f}× |")
    return "\n".join(rows)


def plot(runs: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['params'] / 1e9:.1f}B" for r in runs]
    bottom = [0.0] * len(runs)
    for part in split(runs[0]):
        vals = [split(r)[part] for r in runs]
        a.bar(labels, vals, bottom=bottom, label=part, width=0.5)
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.plot(labels, [_med(r, lambda s: s["io_bound_s"]) for r in runs], "k--o", label="I/O bytes / raw disk")
    a.set_ylabel("seconds per step (median after the first)")
    a.set_yscale("log")
    a.legend(fontsize=7)
    a.set_title("step time split, params + optimizer on nvme")
    x = [r["params"] / 1e9 for r in runs]
    b.plot(x, [r["rss_growth"] / GiB for r in runs], "o-", label="peak RSS growth (GiB)")
    b.plot(x, [r["disk"]["bytes_per_param"] for r in runs], "s-", label="disk bytes / param")
    b.axhline(3, color="gray", ls=":", label="bars: 3 GiB RSS growth; 16 B/param fp32, 12 with bf16 moments")
    b.axhline(16, color="gray", ls=":")
    b.axhline(12, color="gray", ls=":")
    b.set_xlabel("parameters (billions)")
    b.legend(fontsize=7)
    b.set_title("host RAM and disk vs model size")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--png", default="results/scale_run.png")
    args = ap.parse_args(argv)
    runs = load(args.results)
    print(table(runs))
    plot(runs, Path(args.png))
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
