"""Export parameters to the target and drafter GGUF contracts, with a quant recipe per tensor family.

Parameters are given as `{gguf tensor name: float32 array in numpy (PyTorch) shape}` (int32 for
`tid2eid`). A recipe maps each tensor family of `contract.FAMILY_TYPES` to a ggml type:
- `f32`: everything float32 (tests, exact references);
- `f16`: every matrix F16, norms, sinks and biases F32, tid2eid I32 (small trained models: half of f32);
- `published`: the antirez/ds4 IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8 layout (routed gate/up IQ2_XXS, down Q2_K;
  attention, shared experts, output Q8_0; embeddings, HC, compressor, indexer, router F16; norms, sinks,
  biases F32; tid2eid I32), applied to the drafter likewise;
- `q4k_experts`: the antirez/ds4 Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out layout: routed
  gate, up and down Q4_K, the rest as `published`, drafter likewise;
- `rocmfpx`: lucebox-style — target routed gate/up ROCmFP2, down ROCmFP3, dense as `published`; drafter
  routed experts ROCmFP4_FAST with dense F16 ("Q4RMFP4-denseF16").
Unknown ids such as the lucebox types are written as raw bytes with an explicit type id, which gguf-py
supports through `raw_shape`/`raw_dtype` (`quant_hc.md` §5.2).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from dsparkjax import formats
from dsparkjax.config import DRAFTER_ARCH, TARGET_ARCH, DrafterConfig, TargetConfig, metadata_items
from dsparkjax.errors import DsparkError, FormatError
from dsparkjax.formats import GGMLType as T
from dsparkjax.ggufio.contract import TensorSpec, drafter_tensor_specs, target_tensor_specs
from dsparkjax.ggufio.reader import GGUFFile

_PUBLISHED: dict[str, int] = {
    "embedding": T.F16, "output": T.Q8_0, "attention": T.Q8_0, "shared_expert": T.Q8_0,
    "draft_fc": T.Q8_0, "hc": T.F16, "compressor": T.F16, "indexer": T.F16, "router": T.F16,
    "markov": T.F16, "confidence": T.F16, "vector": T.F32, "hash_table": T.I32,
}
_ROCMFPX_DRAFTER_DENSE = {**_PUBLISHED, "attention": T.F16, "shared_expert": T.F16, "draft_fc": T.F16}

RECIPES = ("f32", "f16", "published", "q4k_experts", "rocmfpx")
QUANT_RECIPE_KEY = "dsparkjax.quant_recipe"  # informational; the types per family are the truth


def recipe_type(recipe: str, spec: TensorSpec, *, drafter: bool) -> int:
    """The ggml type `recipe` gives to the tensor of `spec`."""
    if recipe in ("f32", "f16"):
        if spec.family in ("hash_table", "vector"):
            return T.I32 if spec.family == "hash_table" else T.F32
        return T.F32 if recipe == "f32" else T.F16
    if recipe == "published":
        if spec.family == "routed_expert":
            return T.Q2_K if "ffn_down" in spec.name else T.IQ2_XXS
        return _PUBLISHED[spec.family]
    if recipe == "q4k_experts":
        return T.Q4_K if spec.family == "routed_expert" else _PUBLISHED[spec.family]
    if recipe == "rocmfpx":
        if spec.family == "routed_expert":
            if drafter:
                return T.Q4_0_ROCMFP4_FAST
            return T.Q3_0_ROCMFPX if "ffn_down" in spec.name else T.Q2_0_ROCMFP2
        return (_ROCMFPX_DRAFTER_DENSE if drafter else _PUBLISHED)[spec.family]
    raise DsparkError(f"unknown quant recipe {recipe!r}; expected one of {', '.join(RECIPES)}")


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """A tensor ready to be written: its ggml type, numpy shape and encoded bytes (or int32 values)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 bytes for float/quantized types, int32 values for I32


def encode(name: str, values: np.ndarray, ggml_type: int) -> RawTensor:
    """Encode one tensor into `ggml_type`, naming the tensor in any error."""
    values = np.asarray(values)
    if ggml_type == T.I32:
        return RawTensor(name, ggml_type, values.shape, values.astype(np.int32))
    try:
        data = formats.quantize(values.astype(np.float32), ggml_type)
    except DsparkError as err:
        raise FormatError(f"tensor {name} {values.shape} as {formats.type_name(ggml_type)}: {err}") from None
    return RawTensor(name, ggml_type, values.shape, data)


def _start(path: str | os.PathLike[str], arch: str, metadata: Iterable[tuple[str, Any, GGUFValueType]],
           extra: Any = None) -> GGUFWriter:
    """A GGUFWriter for `path` holding the metadata triples (and what `extra(writer)` adds)."""
    writer = GGUFWriter(os.fspath(path), arch)
    for key, value, gtype in metadata:
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=gtype)
        else:
            writer.add_key_value(key, value, gtype)
    if extra is not None:
        extra(writer)
    return writer


def write_raw_gguf(path: str | os.PathLike[str], arch: str, metadata: Iterable[tuple[str, Any, GGUFValueType]],
                   tensors: Sequence[RawTensor], *, extra: Any = None) -> None:
    """Write a GGUF file from metadata triples and encoded tensors, as they are (no contract checks).

    `extra`, if given, is called with the open GGUFWriter to add more metadata (the tokenizer).
    """
    writer = _start(path, arch, metadata, extra)
    for t in tensors:
        if t.ggml_type in (T.F32, T.I32):
            writer.add_tensor(t.name, t.data.view(np.float32 if t.ggml_type == T.F32 else np.int32)
                              .reshape(t.shape))
        else:
            writer.add_tensor(t.name, t.data.view(np.int8), raw_shape=t.shape, raw_dtype=t.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_with_metadata(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                       metadata: Mapping[str, tuple[Any, GGUFValueType]]) -> None:
    """Copy the GGUF `src` to `dst` (they may be one path) with its tensors' bytes as they are and its metadata
    updated by `metadata` ({key: (value, value type; an array's item type)}): how a fitted calibration is
    added to a drafter file without re-encoding its weights."""
    file = GGUFFile(src)
    items = {key: (value, file.value_types[key]) for key, value in file.metadata.items()}
    items.update(metadata)
    tensors = [RawTensor(name, info.ggml_type, info.shape, file.raw(name).reshape(-1)) for name, info in
               file.tensors.items()]
    temporary = f"{os.fspath(dst)}.partial"
    write_raw_gguf(temporary, file.architecture, [(k, v, t) for k, (v, t) in items.items()], tensors)
    os.replace(temporary, dst)


def write_model_gguf(path: str | os.PathLike[str], cfg: TargetConfig | DrafterConfig,
                     params: Mapping[str, np.ndarray | RawTensor], *, recipe: str = "f32", tokenizer: Any = None,
                     name: str | None = None) -> None:
    """Write a target or drafter GGUF that satisfies its contract.

    Args:
      cfg: the config; its type picks the contract.
      params: `{gguf name: array}` for every required tensor of the contract (optional ones may be absent);
        a value may also be a RawTensor already encoded in the recipe's type (random packed blocks for models
        too large to quantize on the host: `tiny.random_params(packed_recipe=...)`).
      recipe: one of RECIPES.
      tokenizer: an object with `write_to(GGUFWriter)` (dsparkjax.tokenizer.Tokenizer), or None.
    """
    drafter = isinstance(cfg, DrafterConfig)
    specs = drafter_tensor_specs(cfg) if drafter else target_tensor_specs(cfg)
    known = {s.name for s in specs}
    unknown = sorted(set(params) - known)
    if unknown:
        raise DsparkError(f"{path}: parameters not in the {'drafter' if drafter else 'target'} contract: "
                          f"{', '.join(unknown[:5])}")
    tensors = []
    for spec in specs:
        if spec.name not in params:
            if spec.required:
                raise DsparkError(f"{path}: missing parameter {spec.name} {spec.shape}")
            continue
        value, ggml_type = params[spec.name], recipe_type(recipe, spec, drafter=drafter)
        shape = value.shape if isinstance(value, RawTensor) else np.shape(value)
        if tuple(shape) != spec.shape:
            raise DsparkError(f"{path}: parameter {spec.name} has shape {tuple(shape)}, expected {spec.shape}")
        if isinstance(value, RawTensor):
            if value.ggml_type != ggml_type or value.name != spec.name:
                raise DsparkError(f"{path}: parameter {spec.name} is encoded as {value.name} in "
                                  f"{formats.type_name(value.ggml_type)}; recipe {recipe!r} stores it as "
                                  f"{formats.type_name(ggml_type)}")
            tensors.append(value)
        else:
            tensors.append(encode(spec.name, np.asarray(value), ggml_type))
    write_raw_gguf(path, DRAFTER_ARCH if drafter else TARGET_ARCH, _model_metadata(cfg, recipe, name), tensors,
                   extra=tokenizer.write_to if tokenizer is not None else None)


def _model_metadata(cfg: TargetConfig | DrafterConfig, recipe: str, name: str | None
                    ) -> list[tuple[str, Any, GGUFValueType]]:
    drafter = isinstance(cfg, DrafterConfig)
    meta = list(metadata_items(cfg))
    meta.append(("general.name", name or ("dsparkjax drafter" if drafter else "dsparkjax target"),
                 GGUFValueType.STRING))
    meta.append((QUANT_RECIPE_KEY, recipe, GGUFValueType.STRING))
    return meta


def write_sparse_gguf(path: str | os.PathLike[str], cfg: TargetConfig | DrafterConfig, specs: Iterable[TensorSpec],
                      *, recipe: str = "published", name: str | None = None) -> int:
    """Write a GGUF for `cfg` holding the tensors `specs` (typed by `recipe`) with all-zero data, as a sparse
    file; returns its size.

    The header, metadata and tensor table are written; the data region is left a hole (the file is extended
    with `truncate`), so a file of any size takes a moment and no disk. Zero bytes are valid data in every
    type (zero scales, expert id 0): the file loads and runs like a real one of the same layout, the load
    path's benchmark at full size.
    """
    drafter = isinstance(cfg, DrafterConfig)
    writer = _start(path, DRAFTER_ARCH if drafter else TARGET_ARCH, _model_metadata(cfg, recipe, name))
    for spec in specs:
        ggml_type = recipe_type(recipe, spec, drafter=drafter)
        nbytes = formats.row_bytes(ggml_type, spec.shape[-1]) * int(np.prod(spec.shape[:-1], dtype=np.int64))
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    (fout,) = writer.fout
    data_start = GGUFWriter.ggml_pad(fout.tell(), writer.data_alignment)
    size = data_start + sum(GGUFWriter.ggml_pad(ti.nbytes, writer.data_alignment) for ti in writer.tensors[0].values())
    fout.truncate(size)
    writer.close()
    return size
