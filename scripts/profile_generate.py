"""Where generation's time goes: a profiler trace of `generate` on the benchmark model, summarised.

    python scripts/profile_generate.py --config wide --dtype bfloat16 --prompts 64 --max_new_tokens 8

Runs one decoding mode (`--mode`: plain width-1 decoding by default, or plain exact decoding, or exact
speculative decoding with the benchmark's random DSpark drafter) once to compile, then again under
`jax.profiler.trace`, and prints for each device plane of the trace (read back with
`jax.profiler.ProfileData`) the events, the time they were busy against the span they cover, and the
most expensive kernels by total time with their counts. A step that launches many small kernels shows as
a device busy for a small fraction of its span. The model flags are
bench_generate.py's (`--config`, `--dtype`, `--recipe`, `--prompts`, `--max_new_tokens`).
"""

from __future__ import annotations

import collections
import glob
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging
from bench_generate import bench_model  # scripts/ is on sys.path

from dsparkjax.decoding.generate import generate

FLAGS = flags.FLAGS
flags.DEFINE_integer("top", 20, "kernels listed per plane")
# generate's arguments for each mode
MODES = {"plain_fast": dict(mode="ar", verify="fast"), "plain_exact": dict(mode="ar", verify="exact"),
         "dspark_exact": dict(mode="spec", verify="exact")}
flags.DEFINE_enum("mode", "plain_fast", list(MODES), "decoding mode to trace")


def line_gaps(line) -> str:
    """Events of one trace line (a GPU stream, or a host thread) and the idle time between consecutive ones:
    many events with gaps longer than the events themselves mark a launch-bound stream."""
    events = sorted(line.events, key=lambda ev: ev.start_ns)
    gaps = np.array([max(0.0, b.start_ns - (a.start_ns + a.duration_ns)) for a, b in zip(events, events[1:])])
    busy = sum(ev.duration_ns for ev in events)
    return (f"{len(events)} events, {busy / 1e6:.2f} ms busy, gaps median {np.median(gaps) / 1e3:.1f} us, "
            f"total {gaps.sum() / 1e6:.2f} ms")


def summarise(path: str, top: int) -> list[str]:
    """Lines describing the planes of the XSpace file at `path` that hold events."""
    lines = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        start, end, busy = float("inf"), 0.0, 0.0
        for line in plane.lines:
            for ev in line.events:
                by_name[ev.name][0] += 1
                by_name[ev.name][1] += ev.duration_ns
                start, end = min(start, ev.start_ns), max(end, ev.start_ns + ev.duration_ns)
                busy += ev.duration_ns
        if not by_name:
            continue
        count = sum(c for c, _ in by_name.values())
        lines.append(f"== {plane.name}: {count} events, {busy / 1e6:.1f} ms of event time over a {(end - start) / 1e6:.1f} ms "
                     f"span")
        lines.extend(f"   line {line.name}: {line_gaps(line)}" for line in plane.lines if len(list(line.events)) > 1)
        for name, (c, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"   {d / 1e6:9.2f} ms {c:7d}x  {name[:100]}")
    return lines


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    target, drafter, prompts = bench_model()

    def run() -> list:
        return generate(target, prompts, drafter=drafter, max_new_tokens=FLAGS.max_new_tokens, stop_tokens=(),
                        **MODES[FLAGS.mode])

    run()
    folder = tempfile.mkdtemp(prefix="dsparkjax-trace-")
    start = time.perf_counter()
    with jax.profiler.trace(folder):
        results = run()
    wall = time.perf_counter() - start
    print(f"device: {jax.devices()[0].device_kind}, {FLAGS.mode}, {len(prompts)} prompts x {FLAGS.max_new_tokens} tokens, "
          f"{max(r.steps for r in results)} decode steps, {wall * 1e3:.1f} ms under the profiler (prefill included)")
    (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    print("\n".join(summarise(path, FLAGS.top)))


if __name__ == "__main__":
    app.run(main)
