"""Byte positions of a GGUF file's fields, and byte edits of them: the tools of the GGUF fuzzer and of the
hostile-input tests."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from gguf import GGUFReader, GGUFValueType

from dsparkjax.config import tiny_target
from dsparkjax.ggufio.contract import target_tensor_specs
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.ggufio.writer import write_model_gguf
from dsparkjax.tiny import random_params
from dsparkjax.tokenizer import build_tiny_tokenizer


def write_tiny_target(path: str) -> str:
    """A 2-layer tiny target (SWA and CSA layers, hash routing) in the published recipe: F32, F16, Q8_0,
    Q2_K, IQ2_XXS and I32 tensors, and a tokenizer. Returns `path`."""
    cfg = tiny_target(hidden_size=256, moe_intermediate_size=256, layers=2)
    params = random_params(target_tensor_specs(cfg), 0, cfg.hc_mult, cfg.n_routed_experts)
    write_model_gguf(path, cfg, params, recipe="published", tokenizer=build_tiny_tokenizer(cfg.vocab_size))
    return path


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte positions of the base file's fields, found by gguf-py's parser."""

    size: int
    counts: dict[str, int]  # "tensor_count"/"kv_count" -> offset of the u64
    keys: dict[str, tuple[int, int, int]]  # key -> (key length offset, value type offset, value offset)
    key_types: dict[str, GGUFValueType]
    tensors: dict[str, dict[str, int]]  # name -> offsets of name_len, n_dims, dims, type, offset
    data: dict[str, tuple[int, int, int]]  # name -> (absolute data offset, nbytes, ggml type)


class _IndexOnly(GGUFReader):
    def _build_tensors(self, start_offs, fields):
        self.tensor_fields = fields


def layout_of(path: str) -> Layout:
    reader = _IndexOnly(path)
    keys, key_types = {}, {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        type_offset = field.offset + 8 + len(field.parts[1])
        keys[name] = (field.offset, type_offset, type_offset + 4)
        key_types[name] = GGUFValueType(int(field.parts[2][0]))
    tensors = {}
    for field in reader.tensor_fields:
        ends = np.cumsum([0] + [int(p.nbytes) for p in field.parts])
        tensors[field.name] = {"name_len": field.offset, "n_dims": field.offset + int(ends[2]),
                               "dims": field.offset + int(ends[3]), "type": field.offset + int(ends[4]),
                               "offset": field.offset + int(ends[5])}
    infos = GGUFFile(path).tensors
    data = {n: (i.offset, i.nbytes, int(i.ggml_type)) for n, i in infos.items()}
    return Layout(os.path.getsize(path), {"tensor_count": 8, "kv_count": 16}, keys, key_types, tensors, data)


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A description (shown when an example fails) and the edit: bytes written at offsets, or a cut."""

    what: str
    writes: tuple[tuple[int, bytes], ...] = ()
    cut: int | None = None

    def apply(self, base: bytes) -> bytes:
        data = bytearray(base)
        for offset, payload in self.writes:
            data[offset : offset + len(payload)] = payload
        return bytes(data[: self.cut] if self.cut is not None else data)


def u64(v: int) -> bytes:
    return np.array([v], np.uint64).tobytes()


def u32(v: int) -> bytes:
    return np.array([v], np.uint32).tobytes()
