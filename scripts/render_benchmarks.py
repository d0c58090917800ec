"""Renders docs/benchmarks.md from the result records in benchmarks/*.json.

    python scripts/render_benchmarks.py           # writes docs/benchmarks.md
    python scripts/render_benchmarks.py --check   # exit 1 if docs/benchmarks.md is not what it would write

One record per measured figure, one row per record. A record holds:

  figure     what was measured (model, tiers, mesh)
  value      the figure
  reference  what a ratio is taken against, measured in the same run
  date       when it was measured (YYYY-MM-DD)
  commit     the commit whose code was measured
  command    the command that reproduces it
  machine    where it ran
  source     where the record comes from (a result file, or the commit that recorded the figure)
  order      (optional) position on the page

To add or replace a figure, write its record (a benchmark script's JSON output may be copied in whole,
with these keys added) and run this script. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks"
PAGE = REPO / "docs" / "benchmarks.md"
KEYS = ("figure", "value", "reference", "date", "commit", "command", "machine", "source")

HEADER = """# Benchmarks

Current measured figures of zinf_jax, one row per figure. Each row is rendered by
`scripts/render_benchmarks.py` from a record in the repository's `benchmarks/` folder, which also says
where the figure comes from. Ratios are taken against a reference measured in the same run, because the
machine they ran on is shared and noisy; compare ratios, not absolute times. Re-run a figure with its
command (benchmark scripts need `bash scripts/setup_bench.sh` first where noted) and replace its record.

"""


def load(folder: pathlib.Path = RECORDS) -> list[dict]:
    """Every record, checked for the keys a row needs, in page order."""
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        missing = [k for k in KEYS if not str(record.get(k, "")).strip()]
        if missing:
            raise SystemExit(f"{path}: missing {', '.join(missing)}")
        records.append({**record, "file": path.name})
    return sorted(records, key=lambda r: (r.get("order", 1000), r["file"]))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render(records: list[dict]) -> str:
    machines = sorted({r["machine"] for r in records})
    lines = [HEADER.rstrip() + "\n"]
    lines.append("| figure | value | against | date | commit | command |")
    lines.append("|---|---|---|---|---|---|")
    for r in records:
        lines.append(f"| {_cell(r['figure'])} | **{_cell(r['value'])}** | {_cell(r['reference'])} | {r['date']} "
                     f"| `{r['commit']}` | `{_cell(r['command'])}` |")
    lines.append("")
    lines.append("## Machines\n")
    lines += [f"- {m}" for m in machines]
    lines.append("")
    lines.append("## Sources\n")
    lines += [f"- `benchmarks/{r['file']}`: {_cell(r['source'])}" for r in records]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/benchmarks.md instead of writing it")
    args = ap.parse_args(argv)
    text = render(load())
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is out of date: run python scripts/render_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)} ({len(load())} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
