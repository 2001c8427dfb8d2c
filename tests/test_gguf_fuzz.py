"""GGUF mutation fuzzer: every mutation of a tiny model file either loads and runs a finite forward, or is
refused with a dsparkjax error that names the file and the field; never a hang, a crash or NaN logits.

Mutations cover the header counts, metadata value types, values, array counts and string lengths, tensor
offsets, types and dimensions, the data bytes (random bytes in packed blocks, NaN/inf values and block
scales, random finite floats) and truncation. Each file runs in a worker process (`gguf_fuzz_worker.py`)
under a memory limit, with a time limit per file: a hang is a timeout, a crash a dead worker.
The number of examples is FUZZ_EXAMPLES (default 100; hypothesis derandomized, so CI runs the same ones).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsparkjax import formats
from gguf_layout import Layout, Mutation, layout_of, u32, u64, write_tiny_target

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
SECONDS_PER_FILE = 90  # a new config compiles its step (tens of seconds on a loaded 2-core machine)
WORKER_MEMORY_GIB = 6
# A run or refusal must name one of these: the part of the file at fault.
FIELD_MARKERS = ("metadata key ", "tensor ", "GGUF header", "general.architecture", "deepseek4.", "tokenizer.")

U64_EDGES = (0, 1, 2, 3, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 32, 2**64 - 1)
U32_EDGES = (0, 1, 2, 3, 4, 5, 8, 16, 127, 128, 1000, 1001, 2**16, 2**24, 2**31, 2**32 - 1)
F32_EDGES = (float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e-30, 1e30, 3.4e38)


def _mutations(layout: Layout) -> st.SearchStrategy[Mutation]:
    any_u64 = st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))
    any_u32 = st.one_of(st.sampled_from(U32_EDGES), st.integers(0, 2**32 - 1))
    any_f32 = st.one_of(st.sampled_from(F32_EDGES), st.floats(width=32))
    key = st.sampled_from(sorted(layout.keys))
    tensor = st.sampled_from(sorted(layout.tensors))
    scalar_keys = sorted(k for k, t in layout.key_types.items() if t in (GGUFValueType.UINT32, GGUFValueType.FLOAT32))
    array_keys = sorted(k for k, t in layout.key_types.items() if t == GGUFValueType.ARRAY)
    string_keys = sorted(k for k, t in layout.key_types.items() if t == GGUFValueType.STRING)

    def header_count(name: str, v: int) -> Mutation:
        return Mutation(f"{name} = {v}", ((layout.counts[name], u64(v)),))

    def value_type(k: str, t: int) -> Mutation:
        return Mutation(f"type of {k} = {t}", ((layout.keys[k][1], u32(t)),))

    def scalar_value(k: str, i: int, f: float) -> Mutation:
        if layout.key_types[k] == GGUFValueType.FLOAT32:
            return Mutation(f"{k} = {f!r} (float32)", ((layout.keys[k][2], np.array([f], np.float32).tobytes()),))
        return Mutation(f"{k} = {i} (uint32)", ((layout.keys[k][2], u32(i)),))

    def as_float(k: str, f: float) -> Mutation:
        v = layout.keys[k][2]
        return Mutation(f"{k} retyped FLOAT32 = {f!r}", ((layout.keys[k][1], u32(GGUFValueType.FLOAT32)),
                                                        (v, np.array([f], np.float32).tobytes())))

    def array_count(k: str, v: int) -> Mutation:
        return Mutation(f"array count of {k} = {v}", ((layout.keys[k][2] + 4, u64(v)),))

    def string_length(k: str, v: int, of_key: bool) -> Mutation:
        where = layout.keys[k][0] if of_key else layout.keys[k][2]
        return Mutation(f"{'key' if of_key else 'value'} length of {k} = {v}", ((where, u64(v)),))

    def tensor_field(name: str, field: str, v: int) -> Mutation:
        pack = u64 if field in ("name_len", "offset", "dims") else u32
        return Mutation(f"{field} of tensor {name} = {v}", ((layout.tensors[name][field], pack(v)),))

    def tensor_offset_of_other(name: str, other: str) -> Mutation:
        rel = layout.data[other][0] - min(d[0] for d in layout.data.values())
        return Mutation(f"offset of tensor {name} = that of {other}", ((layout.tensors[name]["offset"], u64(rel)),))

    def data_bytes(name: str, at: float, payload: bytes) -> Mutation:
        start, nbytes, t = layout.data[name]
        if formats.block_size(t) == 1:  # float or int values: a random finite value of the tensor's type
            return _float_value(name, at)
        offset = start + int(at * max(nbytes - len(payload), 0))
        return Mutation(f"{len(payload)} random byte(s) in the blocks of {name} at {offset}", ((offset, payload),))

    def _float_value(name: str, at: float) -> Mutation:
        start, nbytes, t = layout.data[name]
        dtype = {formats.GGMLType.F32: np.float32, formats.GGMLType.F16: np.float16}.get(t)
        if dtype is None:  # I32 hash table: an expert id
            return Mutation(f"an id of {name} = 3", ((start + 4 * int(at * (nbytes // 4 - 1)), u32(3)),))
        index = int(at * (nbytes // np.dtype(dtype).itemsize - 1))
        value = np.array([4 * at - 2], dtype)
        return Mutation(f"value {index} of {name} = {float(value[0])}",
                        ((start + index * value.itemsize, value.tobytes()),))

    def nonfinite(name: str, at: float, v: float) -> Mutation:
        start, nbytes, t = layout.data[name]
        gt = formats.GGMLType(t)
        if gt == formats.GGMLType.F32:
            index = int(at * (nbytes // 4 - 1))
            return Mutation(f"value {index} of {name} = {v}",
                            ((start + 4 * index, np.array([v], np.float32).tobytes()),))
        if gt == formats.GGMLType.I32:
            return Mutation(f"id 0 of {name} = -1", ((start, np.array([-1], np.int32).tobytes()),))
        from dsparkjax.ggufio.finite import F16_SCALE_OFFSETS

        if gt == formats.GGMLType.F16:
            index = int(at * (nbytes // 2 - 1))
            offset = start + 2 * index
        else:
            block = int(at * (nbytes // formats.type_size(gt) - 1))
            offset = start + block * formats.type_size(gt) + F16_SCALE_OFFSETS[gt][0]
        return Mutation(f"f16 at byte {offset} of {name} = {v}", ((offset, np.array([v], np.float16).tobytes()),))

    at = st.floats(0, 1)
    return st.one_of(
        st.builds(header_count, st.sampled_from(sorted(layout.counts)), any_u64),
        st.builds(value_type, key, st.one_of(st.integers(0, 13), st.sampled_from((14, 255, 2**32 - 1)))),
        st.builds(scalar_value, st.sampled_from(scalar_keys), any_u32, any_f32),
        st.builds(as_float, st.sampled_from(scalar_keys), any_f32),
        st.builds(array_count, st.sampled_from(array_keys), any_u64),
        st.builds(string_length, st.sampled_from(string_keys), any_u64, st.booleans()),
        st.builds(tensor_field, tensor, st.sampled_from(("name_len", "dims", "offset")), any_u64),
        st.builds(tensor_field, tensor, st.sampled_from(("n_dims", "type")), any_u32),  # the u32 fields
        st.builds(tensor_field, tensor, st.just("type"), st.one_of(st.integers(0, 41), st.integers(100, 107))),
        st.builds(tensor_offset_of_other, tensor, tensor),
        st.builds(data_bytes, tensor, at, st.binary(min_size=1, max_size=8)),
        st.builds(nonfinite, tensor, at, st.sampled_from((float("nan"), float("inf"), -float("inf")))),
        st.builds(lambda n: Mutation(f"cut at {n} bytes", cut=n), st.integers(0, layout.size - 1)),
    )


class Worker:
    """The worker process (`gguf_fuzz_worker.py`), started again after it dies or times out."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), JAX_PLATFORMS="cpu")
        return subprocess.Popen([sys.executable, str(Path(__file__).with_name("gguf_fuzz_worker.py")),
                                 str(WORKER_MEMORY_GIB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)

    def run(self, path: str, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            status = "hung" if self.proc.poll() is None else f"died (exit {self.proc.returncode})"
            self.close()
            return {"status": status}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, Layout]:
    path = write_tiny_target(str(tmp_path_factory.mktemp("fuzz") / "target.gguf"))
    return path, layout_of(path)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def check_outcome(path: str, result: dict, vocab: int) -> None:
    """The fuzzer's contract: a finite forward of the right shape, or a dsparkjax error naming file and field."""
    status = result["status"]
    if status == "ran":
        assert result["finite"], "the mutated file loaded but its forward gave NaN or inf logits"
        assert result["shape"] == [1, 10, vocab], result
        return
    assert status == "refused", f"{status}: {result.get('error')}: {result.get('message')}"
    message = result["message"]
    assert message.startswith(f"{path}: "), f"{result['error']} does not name the file first: {message}"
    assert any(m in message for m in FIELD_MARKERS), f"{result['error']} names no field: {message}"


def test_unmutated_file_runs(base, worker, tmp_path):
    path, _ = base
    result = worker.run(path, SECONDS_PER_FILE * 2)  # the first forward compiles the step
    assert result == {"status": "ran", "finite": True, "shape": [1, 10, 512]}, result


def test_mutations_run_or_are_refused_by_name(base, worker, tmp_path_factory):
    path, layout = base
    original = Path(path).read_bytes()
    out = tmp_path_factory.mktemp("mutated") / "target.gguf"

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_mutations(layout))
    def one(mutation: Mutation) -> None:
        out.write_bytes(mutation.apply(original))
        result = worker.run(str(out), SECONDS_PER_FILE)
        check_outcome(str(out), result, 512)

    one()
