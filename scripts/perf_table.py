"""The table of current numbers that opens docs/PERFORMANCE.md, made from the benchmark JSON in docs/bench/.

Every `*.json` there (schema `dsparkjax.bench/1`: what scripts/bench.py writes, or a result transcribed from
docs/perf_log/ with `meta.source` naming its run) gives one row: commit and date, GPU, configuration, ms per
width-1 step, tok/s, the weight-streaming roofline's fraction of the step, and exact speculative decoding
against plain decoding. CI checks that PERFORMANCE.md holds this script's output (tests/test_scripts.py).

  python scripts/perf_table.py            # print the table
  python scripts/perf_table.py --write    # put it into docs/PERFORMANCE.md between its markers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "docs" / "bench"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
BEGIN, END = "<!-- perf_table: begin (scripts/perf_table.py --write) -->", "<!-- perf_table: end -->"
SCHEMA = "dsparkjax.bench/1"  # scripts/bench_results.py's
HEADER = ("commit (date)", "GPU", "configuration", "ms per step", "tok/s", "roofline", "speculative vs plain",
          "source")


def _dicts(section: Any) -> dict[str, dict]:
    """A section's keyed entries (width, batch, acceptance...), without failed or skipped measurements."""
    if not isinstance(section, dict) or "error" in section or "skipped" in section:
        return {}
    return {k: v for k, v in section.items() if isinstance(v, dict) and "error" not in v}


def _num(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}" if value < 10 ** digits else f"{value:.0f}"


def _configuration(meta: dict) -> str:
    layers = f", {meta['layers']} layers" if meta.get("layers") else ""
    return f"{meta.get('config')}{layers}, {meta.get('recipe')}, {meta.get('dtype')}, batch {meta.get('batch')}"


def _step(r: dict) -> str:
    steps = _dicts(r.get("steps"))
    if "1" in steps and "ms" in steps["1"]:
        return f"{_num(steps['1']['ms'])} (q=1)"
    batched = _dicts(r.get("batched"))
    return "; ".join(f"{_num(v['ms_per_step'])} ({b} seqs)" for b, v in batched.items() if "ms_per_step" in v) or "-"


def _tok_s(r: dict) -> str:
    plain = _dicts(r.get("plain_decode"))
    if plain:
        position, first = next(iter(plain.items()))
        return f"{_num(first['tok_s'])} (plain, at {position})"
    batched = _dicts(r.get("batched"))
    return "; ".join(f"{_num(v['tok_s'])} ({b} seqs)" for b, v in batched.items() if "tok_s" in v) or "-"


def _roofline(r: dict) -> str:
    held = _dicts(r.get("roofline")).get("held", {})
    for key, of in (("fraction_of_q1_step", "q=1 step"), ("fraction_of_plain_decode", "plain decoding")):
        if key in held:
            return f"{held[key]:.0%} of the {of}"
    return "-"


def _speculative(r: dict) -> str:
    rates = {p: v for p, v in _dicts(r.get("speculative")).items() if p != "plain_exact"}
    parts = []
    for p, v in rates.items():
        ratios = [f"{v[key]:.2f}x {label}" for key, label in (("over_plain_decode", "plain"),
                                                               ("over_plain_exact", "plain exact")) if key in v]
        if ratios:
            parts.append(f"p={p}: " + ", ".join(ratios))
    return "; ".join(parts) or "-"


def row(r: dict, name: str) -> tuple[str, ...]:
    """One results file's row (HEADER's columns)."""
    if r.get("schema") != SCHEMA:
        raise SystemExit(f"{name}: schema {r.get('schema')!r}, expected {SCHEMA!r}")
    meta = r.get("meta", {})
    date = str(meta.get("date_utc") or "")[:10]
    source = meta.get("source", "bench.py")
    return (f"{meta.get('commit')} ({date})", str(meta.get("device")), _configuration(meta), _step(r), _tok_s(r),
            _roofline(r), _speculative(r), f"{source} ({name})")


def table(bench_dir: Path = BENCH_DIR) -> str:
    """The markdown table of every results file in bench_dir, newest first."""
    results = []
    for path in sorted(bench_dir.glob("*.json")):
        r = json.loads(path.read_text())
        results.append((str(r.get("meta", {}).get("date_utc") or ""), path.name, r))
    results.sort(key=lambda item: item[:2], reverse=True)
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(r, name)) + " |" for _, name, r in results]
    return "\n".join(lines)


def block(bench_dir: Path = BENCH_DIR) -> str:
    """The table with its markers, as PERFORMANCE.md holds it."""
    return f"{BEGIN}\n{table(bench_dir)}\n{END}"


def current_block(text: str) -> str:
    """The marked block of a PERFORMANCE.md text."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{PERFORMANCE} has no {BEGIN} ... {END} block")
    return text[start : end + len(END)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/PERFORMANCE.md")
    args = parser.parse_args()
    if not args.write:
        print(table())
        return
    text = PERFORMANCE.read_text()
    PERFORMANCE.write_text(text.replace(current_block(text), block()))
    print(f"wrote the table into {PERFORMANCE}", file=sys.stderr)


if __name__ == "__main__":
    main()
