"""One test per file-side class of issue 41: each hostile GGUF is refused at once with a dsparkjax error naming
the file and the key or tensor (docs/RELIABILITY.md lists the guarantees)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dsparkjax import footprint, formats
from dsparkjax.config import tiny_drafter, tiny_target
from dsparkjax.errors import GGUFContractError, MemoryBudgetError, UnsupportedTypeError
from dsparkjax.formats import GGMLType
from dsparkjax.ggufio import open_target
from dsparkjax.ggufio import finite
from dsparkjax.ggufio.finite import F16_SCALE_OFFSETS, find_nonfinite
from dsparkjax.ggufio.reader import TensorInfo
from dsparkjax.inspect import describe
from dsparkjax.model.params import _TensorReader
from dsparkjax.model.sources import ShapeSource
from dsparkjax.target_api import load_target
from gguf_layout import Layout, Mutation, layout_of, u32, u64, write_tiny_target


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, bytes, Layout]:
    path = write_tiny_target(str(tmp_path_factory.mktemp("hostile") / "target.gguf"))
    return path, Path(path).read_bytes(), layout_of(path)


def refused(base, tmp_path, mutation: Mutation, *parts: str, opener=open_target, cls=GGUFContractError) -> str:
    """The error opening the mutated file raises, within a second, naming the file and every part."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutation.apply(base[1]))
    start = time.perf_counter()
    with pytest.raises(cls) as excinfo:
        opener(str(bad))
    assert time.perf_counter() - start < 5, "refused, but not at once"
    message = str(excinfo.value)
    assert message.startswith(f"{bad}: "), message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


@pytest.mark.parametrize("count", [2**62, 2**64 - 1, 10**9])
def test_huge_metadata_array_count_fails_fast_naming_the_key(base, tmp_path, count):
    key = "deepseek4.attention.compress_ratios"
    refused(base, tmp_path, Mutation("", ((base[2].keys[key][2] + 4, u64(count)),)), f"metadata key {key}",
            f"{count} entries")


@pytest.mark.parametrize("field", ["tensor_count", "kv_count"])
def test_huge_header_counts_fail_fast(base, tmp_path, field):
    refused(base, tmp_path, Mutation("", ((base[2].counts[field], u64(2**62)),)), "GGUF header", field)


def test_huge_string_length_names_the_key(base, tmp_path):
    refused(base, tmp_path, Mutation("", ((base[2].keys["general.architecture"][2], u64(2**40)),)),
            "metadata key general.architecture", "truncated or corrupt")


def test_tensor_offset_wrapping_past_2_64_names_the_tensor(base, tmp_path):
    name = "blk.0.attn_norm.weight"
    refused(base, tmp_path, Mutation("", ((base[2].tensors[name]["offset"], u64(2**64 - 64)),)), f"tensor {name}")


def test_overlapping_tensors_are_refused(base, tmp_path):
    layout = base[2]
    first = min(layout.data.values())[0]
    name, other = "blk.0.attn_norm.weight", "blk.0.attn_q_a_norm.weight"
    relative = layout.data[other][0] - first
    refused(base, tmp_path, Mutation("", ((layout.tensors[name]["offset"], u64(relative)),)), "overlapping tensors",
            "tensor ")


def test_misaligned_tensor_offset_is_refused(base, tmp_path):
    name = "output_norm.weight"
    offset = base[2].data[name][0] - min(base[2].data.values())[0]
    refused(base, tmp_path, Mutation("", ((base[2].tensors[name]["offset"], u64(offset + 4)),)), f"tensor {name}",
            "aligned")


def test_too_many_dimensions_name_the_tensor(base, tmp_path):
    name = "output.weight"
    refused(base, tmp_path, Mutation("", ((base[2].tensors[name]["n_dims"], u32(9)),)), f"tensor {name}",
            "1 to 4 dimensions")


def test_float_where_an_integer_is_required_names_the_key(base, tmp_path):
    key = "deepseek4.block_count"
    _, type_offset, value_offset = base[2].keys[key]
    mutation = Mutation("", ((type_offset, u32(6)), (value_offset, np.float32(4.0).tobytes())))  # 6: FLOAT32
    refused(base, tmp_path, mutation, f"metadata key {key}", "an integer")


@pytest.mark.parametrize("key,value,expected", [
    ("deepseek4.hyper_connection.sinkhorn_iterations", u32(2_000_000_000), "at most 1000"),
    ("deepseek4.rope.freq_base", np.float32(np.inf).tobytes(), "a finite number"),
    ("deepseek4.rope.freq_base", np.float32(np.nan).tobytes(), "a finite number"),
    ("deepseek4.embedding_length", u32(2**30), "at most 65536"),
])
def test_insane_metadata_values_name_the_key_and_limit(base, tmp_path, key, value, expected):
    refused(base, tmp_path, Mutation("", ((base[2].keys[key][2], value),)), f"metadata key {key}", expected)


def test_window_beyond_memory_is_a_budget_error_naming_the_key(base, tmp_path, monkeypatch):
    # A fixed 1 GiB budget: the machine's free memory must not decide whether this window's state fits.
    monkeypatch.setattr(footprint, "available_bytes", lambda: (1 << 30, "are available on the host"))
    key = "deepseek4.attention.sliding_window"
    refused(base, tmp_path, Mutation("", ((base[2].keys[key][2], u32(2**24)),)), key, "GB",
            cls=MemoryBudgetError)


def test_drafter_window_beyond_memory_is_a_budget_error_naming_the_key():
    cfg = dataclasses.replace(tiny_drafter(tiny_target()), sliding_window=2**24, head_dim=2**14, rope_dim=64)
    key = r"deepseek4-dflash-draft\.attention\.sliding_window = 16777216"
    with pytest.raises(MemoryBudgetError, match=rf"d\.gguf: {key}"):
        footprint.check_drafter_budget(cfg, "d.gguf")


def test_context_beyond_memory_is_a_budget_error_naming_max_len():
    with pytest.raises(MemoryBudgetError, match=r"x\.gguf: max_len = 16777216 .* needs .* GB, but .* GB"):
        footprint.check_state_budget(tiny_target(), 4096, 2**24, 16, jnp.float32, "x.gguf")


def _poke(layout: Layout, name: str, within: int, payload: bytes) -> Mutation:
    return Mutation("", ((layout.data[name][0] + within, payload),))


@pytest.mark.parametrize("name,within,payload,expected", [
    ("output_norm.weight", 8, np.float32(np.nan).tobytes(), "finite F32 values"),
    ("blk.0.attn_sinks.weight", 0, np.float32(-np.inf).tobytes(), "finite F32 values"),
    ("output.weight", 34 * 3, np.float16(np.nan).tobytes(), "finite Q8_0 block scales"),  # block 3's scale
    ("blk.0.ffn_down_exps.weight", 84 + 80, np.float16(np.inf).tobytes(), "finite Q2_K block scales"),
    ("blk.0.ffn_gate_exps.weight", 66, np.float16(np.nan).tobytes(), "finite IQ2_XXS block scales"),
])
def test_nonfinite_weights_and_scales_refused_at_load_and_by_check_bytes(base, tmp_path, name, within, payload,
                                                                         expected):
    mutation = _poke(base[2], name, within, payload)
    refused(base, tmp_path, mutation, f"tensor {name}", expected, opener=load_target)
    refused(base, tmp_path, mutation, f"tensor {name}", expected,
            opener=lambda path: describe(path, check_bytes=True))


def test_find_nonfinite_reads_every_block_scale_field():
    for ggml_type, offsets in F16_SCALE_OFFSETS.items():
        size = {GGMLType.Q8_0: 34, GGMLType.Q2_K: 84, GGMLType.Q4_K: 144, GGMLType.IQ2_XXS: 66}[ggml_type]
        for offset in offsets:
            blocks = np.zeros((5, size), np.uint8)
            blocks[2, offset : offset + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
            found = find_nonfinite(blocks, ggml_type)
            assert found is not None and (found.count, found.first, found.unit) == (1, 2, "block scale"), ggml_type
        assert find_nonfinite(np.zeros((5, size), np.uint8), ggml_type) is None
    halves = np.array([1.0, np.inf, 2.0], np.float32).astype(jnp.bfloat16).view(np.uint16)
    assert find_nonfinite(halves.view(np.uint8), GGMLType.BF16).first == 1


@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.F16, GGMLType.BF16, *F16_SCALE_OFFSETS])
def test_find_nonfinite_counts_as_decoding_would_across_chunks(monkeypatch, ggml_type):
    """The bit test (an all-ones exponent, chunk by chunk) finds the count and first index that decoding every
    value (or block scale) with numpy finds, for hits in several chunks and none in others."""
    monkeypatch.setattr(finite, "_CHUNK_UNITS", 7)
    rng = np.random.default_rng(int(ggml_type))
    size = formats.type_size(ggml_type)
    units = 50
    raw = rng.integers(0, 64, units * size, dtype=np.uint8)  # bytes <= 0x3F: every float finite
    assert finite.find_nonfinite(raw, ggml_type) is None
    for index in (9, 10, 33, 49):  # chunks 1, 4 and 7 hold hits
        offset = index * size + (rng.choice(F16_SCALE_OFFSETS[ggml_type]) if ggml_type in F16_SCALE_OFFSETS else 0)
        width = 4 if ggml_type == GGMLType.F32 else 2
        value = rng.choice([np.nan, np.inf, -np.inf])
        raw[offset : offset + width] = np.frombuffer(
            (np.float32(value) if width == 4 else np.float16(value) if ggml_type != GGMLType.BF16
             else np.array([value], jnp.bfloat16)).tobytes(), np.uint8)
    if ggml_type in F16_SCALE_OFFSETS:
        blocks = raw.reshape(units, size)
        decoded = np.stack([np.ascontiguousarray(blocks[:, o : o + 2]).view(np.float16)[:, 0]
                            for o in F16_SCALE_OFFSETS[ggml_type]], axis=1)
        bad = ~np.isfinite(decoded).all(axis=1)
    else:
        bad = ~np.isfinite(raw.view({GGMLType.F32: np.float32, GGMLType.F16: np.float16,
                                     GGMLType.BF16: jnp.bfloat16}[ggml_type]).astype(np.float32))
    found = finite.find_nonfinite(raw, ggml_type)
    assert found is not None and (found.count, found.first) == (int(bad.sum()), int(np.flatnonzero(bad)[0]))


def test_format_without_a_kernel_is_refused_with_its_dense_size():
    source = ShapeSource("f.gguf", {"w": TensorInfo("w", GGMLType.Q5_0, (8, 256, 4096), 0, 8 * 256 * 4096 * 22 // 32)})
    with pytest.raises(UnsupportedTypeError, match=r"f\.gguf: tensor w: Q5_0 has no packed kernel.*0\.0168 GB"):
        _TensorReader(source, jnp.bfloat16, "reference").get("w", "matrix")
