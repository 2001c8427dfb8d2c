"""The measurement scripts (`scripts/bench.py`, `scripts/bench_kernels.py`, `scripts/profile_kernel.py`,
`scripts/bench_generate.py`, `scripts/profile_generate.py`,
`scripts/bench_step.py`, `scripts/bench_hc.py`) on CPU.

They produce the numbers in docs/PERFORMANCE.md, so their arithmetic is checked here: the benchmark runs
end to end at tiny sizes, and the duration table is computed from a hand-made Nsight Compute CSV.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=600,
                          check=False)


def test_bench_kernels_rows(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_script("bench_kernels.py", "--formats=Q8_0", "--shapes=attn_a,grouped_o", "--t_max=2",
                      "--calls=2", "--reps=1", "--copy_mib=8", "--rotate_mib=1", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["T"]) for r in rows] == [(s, t) for s in ("attn_a", "grouped_o") for t in (1, 2)]
    by_shape = {r["shape"]: r for r in rows if r["T"] == 1}
    assert by_shape["attn_a"]["bytes"] == 1024 * 4096 // 32 * 34  # Q8_0: 34 bytes per 32 weights
    assert by_shape["grouped_o"]["bytes"] == 8 * by_shape["attn_a"]["bytes"]  # all eight groups in one call
    assert all({"us", "gbps", "frac_copy", "ratio_vs_first"} <= r.keys() for r in rows)  # timings: not checked on CPU


def test_bench_kernels_dense_copy_at_given_rows(tmp_path):
    """--dense_copy times the model's many-row route on the dense and grouped shapes (MoE shapes keep the
    kernel), at the --t_rows given. The MoE shape is the benchmark model's (32 small experts): DS4's would make
    2 GB of packed experts on the CPU for a routing check."""
    out = tmp_path / "bench.json"
    proc = run_script("bench_kernels.py", "--formats=Q8_0", "--shapes=grouped_o,bench_up4", "--t_rows=3,5",
                      "--dense_copy", "--calls=2", "--reps=1", "--copy_mib=8", "--rotate_mib=1", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["T"], r["dense_copy"]) for r in rows] == [
        ("grouped_o", 3, True), ("grouped_o", 5, True), ("bench_up4", 3, False), ("bench_up4", 5, False)]


def test_bench_kernels_expert_count_per_shape(tmp_path):
    """The generation benchmark model's expert shapes draw 4 of their 32 experts: at 16 tokens the call reads
    at most those 32 experts once each (with DS4's 256 it would read about 60)."""
    out = tmp_path / "bench.json"
    proc = run_script("bench_kernels.py", "--formats=Q2_K", "--shapes=bench_down4", "--t_rows=1,16", "--calls=2",
                      "--reps=1", "--copy_mib=8", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    row_bytes = 84  # Q2_K: one 256-weight block per row of K = 256
    bytes_at = {r["T"]: r["bytes"] for r in json.loads(out.read_text())["rows"]}
    assert bytes_at[1] == 4 * 512 * row_bytes
    assert 4 * 512 * row_bytes < bytes_at[16] <= 32 * 512 * row_bytes


def test_profile_kernel_records_its_calls_and_copies(tmp_path):
    out = tmp_path / "c.json"
    proc = run_script("profile_kernel.py", "--formats=Q8_0", "--shapes=attn_a", "--t_rows=1,2", "--copy_mib=1",
                      "--copy_sizes_mb=0.5", f"--configs_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    configs = json.loads(out.read_text())
    assert [(c["shape"], c["T"], c["bytes"]) for c in configs["calls"]] == [("attn_a", t, 1024 * 4096 // 32 * 34)
                                                                          for t in (1, 2)]
    assert configs["copy_bytes"] == 2 << 20 and configs["copy_sizes"] == [500_000]


def write_ncu_csv(path: Path, launches: list[tuple[str, str, str]]) -> None:
    """An ncu `--csv --metrics gpu__time_duration.sum` log: tool lines, a header, one row per launch
    (kernel name, unit, value)."""
    lines = ['==PROF== Connected to process 1', '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    lines += [f'"{i}","{name}","gpu__time_duration.sum","{unit}","{value}"'
              for i, (name, unit, value) in enumerate(launches)]
    path.write_text("\n".join(lines) + "\n")


def profile_table(tmp_path: Path, configs: dict, launches: list[tuple[str, str, str]], *flags: str):
    """profile_kernel.py --table_from on a hand-made configs file and ncu log: the process."""
    (tmp_path / "c.json").write_text(json.dumps(configs))
    write_ncu_csv(tmp_path / "d.csv", launches)
    return run_script("profile_kernel.py", f"--table_from={tmp_path / 'd.csv'}",
                      f"--configs_in={tmp_path / 'c.json'}", *flags)


CALLS = [{"format": "Q8_0", "shape": "attn_a", "T": 1, "bytes": 4_000_000},
         {"format": "Q8_0", "shape": "attn_a", "T": 4, "bytes": 4_000_000}]
# two launches per call, the second is the measured one: 2 us (as ns, with a thousands separator), then 5 us
CALL_LAUNCHES = [("qmatmul_kernel", "usecond", "9.0"), ("qmatmul_kernel", "nsecond", "2,000"),
                 ("qmatmul_kernel", "usecond", "9.0"), ("qmatmul_kernel", "usecond", "5.0")]
TABLE = [["Q8_0", "attn_a", "1", "2.0", "2000", "50%", "1.00"], ["Q8_0", "attn_a", "4", "5.0", "800", "20%", "2.50"]]


def test_profile_kernel_table_with_a_given_copy_bandwidth(tmp_path):
    proc = profile_table(tmp_path, {"calls": CALLS, "copy_bytes": 0}, CALL_LAUNCHES, "--copy_gbps=4000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split() for line in proc.stdout.splitlines() if line.startswith("Q8_0")] == TABLE


def test_profile_kernel_table_takes_the_faster_profiled_copies(tmp_path):
    # an unrelated kernel first (ignored), the two bandwidth-copy launches of 8 MB: 2.5 us and 2.0 us -> 4000
    # GB/s, then the two launches of a 4 MB size probe: 3.5 and 3.2 us -> 1250 GB/s, 31% of 4000
    launches = [("loop_add_fusion", "usecond", "1.0")] + CALL_LAUNCHES + [
        ("loop_add_fusion", "usecond", "2.5"), ("loop_add_fusion", "usecond", "2.0"),
        ("loop_add_fusion", "usecond", "3.5"), ("loop_add_fusion", "usecond", "3.2")]
    configs = {"calls": CALLS, "copy_bytes": 8_000_000, "copy_sizes": [4_000_000]}
    proc = profile_table(tmp_path, configs, launches)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "4000 GB/s" in proc.stdout
    assert "copy of 4.0 MB (read + write): 3.2 us, 1250 GB/s (31% of the copy bandwidth)" in proc.stdout
    assert [line.split() for line in proc.stdout.splitlines() if line.startswith("Q8_0")] == TABLE


def test_profile_kernel_table_rejects_missing_probe_copies(tmp_path):
    configs = {"calls": CALLS, "copy_bytes": 8_000_000, "copy_sizes": [4_000_000]}
    launches = CALL_LAUNCHES + [("loop_add_fusion", "usecond", "2.5"), ("loop_add_fusion", "usecond", "2.0")]
    proc = profile_table(tmp_path, configs, launches, "--copy_gbps=4000")
    assert proc.returncode != 0 and "2 copy launches profiled, expected 4" in proc.stderr + proc.stdout


def test_profile_kernel_table_rejects_a_short_log(tmp_path):
    proc = profile_table(tmp_path, {"calls": CALLS[:1], "copy_bytes": 0}, CALL_LAUNCHES[:1], "--copy_gbps=1")
    assert proc.returncode != 0 and "1 profiled launches, expected 2 per call" in proc.stderr + proc.stdout


def test_profile_kernel_table_needs_a_copy_bandwidth(tmp_path):
    proc = profile_table(tmp_path, {"calls": CALLS, "copy_bytes": 0}, CALL_LAUNCHES)
    assert proc.returncode != 0 and "no copy launches profiled" in proc.stderr + proc.stdout
    # a copy the profiler left out (a kernel filter without it) needs --copy_gbps too
    proc = profile_table(tmp_path, {"calls": CALLS, "copy_bytes": 8_000_000}, CALL_LAUNCHES)
    assert proc.returncode != 0 and "0 copy launches profiled, expected 2" in proc.stderr + proc.stdout
    proc = profile_table(tmp_path, {"calls": CALLS, "copy_bytes": 8_000_000}, CALL_LAUNCHES, "--copy_gbps=4000")
    assert proc.returncode == 0 and [line.split() for line in proc.stdout.splitlines()
                                     if line.startswith("Q8_0")] == TABLE



@pytest.mark.parametrize("mode, steps", [("plain_fast", "2"), ("dspark_exact", "[12]")])
def test_profile_generate_summarises_its_trace(mode, steps):
    """The trace of plain or speculative decoding is read back and summarised per plane (on CPU: the host
    plane)."""
    proc = run_script("profile_generate.py", "--config=tiny", "--dtype=float32", "--prompts=2",
                      "--max_new_tokens=3", "--top=2", f"--mode={mode}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(rf"{mode}, 2 prompts x 3 tokens, {steps} decode steps", proc.stdout), proc.stdout
    planes = re.findall(r"^== (\S+): (\d+) events", proc.stdout, re.M)
    assert planes and all(int(n) > 0 for _, n in planes), proc.stdout
    assert re.search(r"^   line .+: \d+ events, [\d.]+ ms busy, gaps median [\d.]+ us", proc.stdout, re.M), proc.stdout


def test_bench_step_times_each_width_and_traces_it():
    """Each width's step is timed on its own, and --trace summarises a traced run of it."""
    proc = run_script("bench_step.py", "--config=tiny", "--dtype=float32", "--prompts=2", "--widths=1,3",
                      "--steps=2", "--reps=1", "--context=64", "--trace", "--top=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    timed = re.findall(r"^width (\d): (\d+) rows per matmul, ([\d.]+) ms per step", proc.stdout, re.M)
    assert [(q, rows) for q, rows, _ in timed] == [("1", "2"), ("3", "6")], proc.stdout
    assert all(float(ms) > 0 for _, _, ms in timed)
    assert len(re.findall(r"^trace of 2 steps of width \d:\n== ", proc.stdout, re.M)) == 2, proc.stdout


def test_bench_step_times_the_invariant_and_the_fast_program():
    """--programs invariant,fast times exact decoding's batch-invariant step, then XLA's, on the same model."""
    proc = run_script("bench_step.py", "--config=tiny", "--dtype=float32", "--prompts=2", "--widths=1",
                      "--steps=1", "--reps=1", "--context=64", "--programs=invariant,fast")
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = re.findall(r"^device: .*, batch 2, (batch-invariant|fast \(XLA contractions\)) step$", proc.stdout, re.M)
    assert kinds == ["batch-invariant", "fast (XLA contractions)"], proc.stdout
    assert len(re.findall(r"^width 1: 2 rows per matmul, [\d.]+ ms per step", proc.stdout, re.M)) == 2, proc.stdout
    bad = run_script("bench_step.py", "--config=tiny", "--programs=exact")
    assert bad.returncode != 0 and "are not invariant or fast" in bad.stderr


def test_bench_step_cases_time_a_context_in_each_capacity():
    """--cases times each width per (context, capacity) and compares capacities of one context."""
    proc = run_script("bench_step.py", "--config=tiny", "--dtype=float32", "--prompts=1", "--widths=2",
                      "--steps=2", "--reps=1", "--cases=40:64,40:256")
    assert proc.returncode == 0, proc.stderr[-2000:]
    timed = re.findall(r"^width 2, context 40 in capacity (\d+): 2 rows per matmul, [\d.]+ ms per step(, [\d.]+x "
                       r"capacity 64)?", proc.stdout, re.M)
    assert [(cap, bool(versus)) for cap, versus in timed] == [("64", False), ("256", True)], proc.stdout
    bad = run_script("bench_step.py", "--config=tiny", "--cases=1k")
    assert bad.returncode != 0 and "is not CONTEXT:CAPACITY" in bad.stderr


def test_bench_hc_times_saves_and_compares_outputs(tmp_path):
    """Every shape is timed; the saved outputs of one build compare equal to themselves and unequal to others."""
    saved = tmp_path / "a.npz"
    proc = run_script("bench_hc.py", "--shapes=2x64,3x128", "--calls=2", "--reps=1", f"--save={saved}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    timed = re.findall(r"^T = +(\d+), D = +(\d+): hc_pre +([\d.]+|nan) us, hc_post +([\d.]+|nan) us", proc.stdout,
                       re.M)  # nan: a slope below the timer's resolution (seconds_per_call), at these toy sizes
    assert [(t, d) for t, d, _, _ in timed] == [("2", "64"), ("3", "128")], proc.stdout
    arrays = dict(np.load(saved))
    assert sorted(arrays) == sorted(f"{s}.{k}" for s in ("2x64", "3x128") for k in ("u", "post", "comb", "out"))
    same = run_script("bench_hc.py", f"--compare={saved},{saved}")
    assert same.returncode == 0 and same.stdout.count("bits equal") == 8, same.stdout
    arrays["3x128.comb"] = np.nextafter(arrays["3x128.comb"], np.float32(2))  # one ulp off
    other = tmp_path / "b.npz"
    np.savez(other, **arrays)
    differ = run_script("bench_hc.py", f"--compare={saved},{other}")
    assert differ.returncode == 1 and "3x128.comb: differs" in differ.stdout, differ.stdout


def test_bench_generate_runs_the_chosen_kernels(tmp_path):
    """`--kernels` reaches load_target (the packed kernels' A/B; not "reference", whose jnp matrices cannot give
    exact speculative decoding's invariant step), the summary says which ran, and each configuration keeps the
    time of each of its `--reps` runs."""
    out = tmp_path / "bench.json"
    proc = run_script("bench_generate.py", "--config=tiny", "--dtype=float32", "--prompts=2", "--max_new_tokens=3",
                      "--kernels=dequantize", "--reps=2", f"--output={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(dequantize matrices)" in proc.stdout, proc.stdout
    summary = json.loads(out.read_text())
    assert summary["kernels"] == "dequantize"
    assert summary["exact_spec_equals_plain"] and summary["dspark_exact_equals_plain"]
    assert all(len(seconds) == 2 for seconds in summary["decode_seconds"].values()), summary["decode_seconds"]


def _matches(pattern: str, path: tuple[str, ...]) -> bool:
    """Whether a field's keys are the documented `pattern` (`a.*.c`), whose `*` stands for any one key (keys such
    as acceptance rates hold dots themselves)."""
    parts = pattern.split(".")
    return len(path) == len(parts) and all(p in ("*", k) for p, k in zip(parts, path))


def _leaf_paths(node, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if not isinstance(node, dict) or prefix == ("fields",):
        return [prefix]
    return [p for key, value in node.items() for p in _leaf_paths(value, (*prefix, key))]


def test_bench_tiny_writes_every_documented_field(tmp_path):
    """The CPU smoke run of the headline benchmark: every measurement succeeds, every field of the JSON is
    documented (in the JSON and in docs/bench.md) and every documented field is there; exact speculative
    decoding reproduces plain decoding at every acceptance rate, and the warm start wrote no compiled program."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_results import FIELDS, OPTIONAL_FIELDS, errors

    out = tmp_path / "bench.json"
    env = {**os.environ, "DSPARKJAX_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # every program cached: the warm start compiles none
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--config=tiny", "--layers=2",
                           f"--json_out={out}"], capture_output=True, text=True, timeout=900, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert not errors(results), errors(results)
    leaves = _leaf_paths(results)
    assert [p for p in leaves if not any(_matches(f, p) for f in FIELDS)] == []
    assert [f for f in FIELDS if f not in OPTIONAL_FIELDS and not any(_matches(f, p) for p in leaves)] == []
    assert results["fields"] == FIELDS
    docs = (SCRIPTS.parent / "docs" / "bench.md").read_text()
    assert [f for f in FIELDS if f"`{f}`" not in docs] == []
    assert results["meta"]["config"] == "tiny" and results["meta"]["layers"] == 2
    assert list(results["steps"]) == ["1", "2", "3", "4", "5", "6"]
    spec = results["speculative"]
    assert all(spec[p]["equals_plain_exact"] for p in ("0.6", "0.8", "0.9"))
    assert spec["0.6"]["tokens_per_step"] <= spec["0.9"]["tokens_per_step"]
    assert results["startup"]["warm"]["cache_entries_written"] == 0
    assert "warm start to first token" in proc.stdout


def test_bench_load_tiny_loads_the_sparse_pair_and_generates(tmp_path):
    """bench_load.py writes a sparse pair (no disk), loads it with the public API and generates zeros; its JSON
    has exactly its documented fields, all in docs/bench.md."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_results import errors

    out = tmp_path / "load.json"
    env = {**os.environ, "DSPARKJAX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_load.py"), "--config=tiny", "--layers=2",
                           "--load_workers=1,2", f"--dir={tmp_path / 'sparse'}", f"--json_out={out}"], capture_output=True, text=True,
                          timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert not errors(results), errors(results)
    fields = results["fields"]
    leaves = _leaf_paths(results)
    assert [p for p in leaves if not any(_matches(f, p) for f in fields)] == []
    assert [f for f in fields if not any(_matches(f, p) for p in leaves)] == []
    docs = (SCRIPTS.parent / "docs" / "bench.md").read_text()
    assert [f for f in fields if f"`{f}`" not in docs] == []
    assert results["files"]["target_disk_bytes"] < results["files"]["target_bytes"]
    assert results["generate"]["token_ids"] == [0] * 8
    assert results["load"]["host_peak_rss_bytes"] >= results["load"]["host_rss_before_bytes"] > 0
    assert results["load"]["workers"] == [1, 2] and len(results["load"]["target_runs_gb_s"]) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_performance_md_opens_with_the_perf_table_scripts_output(tmp_path):
    """docs/PERFORMANCE.md's table is scripts/perf_table.py's output from docs/bench/*.json (regenerate it with
    `python scripts/perf_table.py --write`); a results file of another schema is refused by name."""
    sys.path.insert(0, str(SCRIPTS))
    import perf_table

    text = perf_table.PERFORMANCE.read_text()
    assert perf_table.current_block(text) == perf_table.block(), "run: python scripts/perf_table.py --write"
    assert len(perf_table.table().splitlines()) == 2 + len(list(perf_table.BENCH_DIR.glob("*.json")))
    (tmp_path / "old.json").write_text(json.dumps({"schema": "dsparkjax.bench/0", "meta": {}}))
    with pytest.raises(SystemExit, match="old.json: schema"):
        perf_table.table(tmp_path)
