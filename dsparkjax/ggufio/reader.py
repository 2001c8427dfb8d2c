"""Memory-mapped GGUF reading through gguf-py, extended for the lucebox type ids 100–107.

gguf-py's `GGUFReader` parses the header and metadata; its tensor table builder rejects type ids it does
not know and reads every tensor eagerly, so `_LazyReader` replaces that one step: it records each tensor's
name, type, shape and byte range, checks the range lies inside the file (a truncated file is caught at
open, naming the tensor) and leaves the bytes on disk until asked (`quant_hc.md` §5.2).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.gguf_reader import ReaderField

from dsparkjax import formats
from dsparkjax.errors import DsparkError, FormatError, GGUFContractError


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a GGUF file.

    `shape` is the numpy (PyTorch) order, the reverse of ggml's `ne`: a 2-D weight `ne=[in, out]` is
    `(out, in)`, a 3-D expert stack `ne=[in, out, E]` is `(E, out, in)`. Blocks run along the last axis.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return formats.type_name(self.ggml_type)


class _LazyReader(GGUFReader):
    """GGUFReader that indexes tensors instead of reading them, and knows the lucebox ids."""

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        path = str(self.data.filename)
        size = int(self.data.shape[0])
        infos: dict[str, TensorInfo] = {}
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            if name in infos:
                raise GGUFContractError(path, f"tensor {name}", "a unique name", "a duplicate")
            ggml_type = int(raw_dtype[0])
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            try:
                nbytes = formats.row_bytes(ggml_type, shape[-1]) * int(np.prod(shape[:-1], dtype=np.int64))
            except (FormatError, DsparkError, KeyError, ValueError) as err:
                raise GGUFContractError(path, f"tensor {name}", "a known ggml type with whole blocks per row",
                                        f"type id {ggml_type}, shape {shape} ({err})") from None
            offset = int(start_offs + offset_tensor[0])
            if offset + nbytes > size:
                raise GGUFContractError(path, f"tensor {name}", f"{nbytes} bytes at offset {offset}",
                                        f"a file of {size} bytes (truncated or corrupt)")
            infos[name] = TensorInfo(name, ggml_type, shape, offset, nbytes)
        self.tensors = []
        self.tensor_infos = infos


class GGUFFile:
    """An open GGUF file: plain-Python metadata, a tensor index, and lazy access to each tensor's bytes."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise GGUFContractError(self.path, "file", "an existing GGUF file", "no such file")
        try:
            reader = _LazyReader(self.path)
        except GGUFContractError:
            raise
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as err:
            raise GGUFContractError(self.path, "GGUF header", "a valid GGUF v2/v3 header and metadata",
                                    f"{type(err).__name__}: {err} (truncated or corrupt)") from None
        # Tensors are read through a map of our own, whose pages `release` can give back (gguf-py's memmap, which
        # parsed the header, is dropped with the reader).
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, np.uint8)
        self.metadata: dict[str, Any] = {
            key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
        }
        self.tensors: dict[str, TensorInfo] = reader.tensor_infos

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: uint8 `[rows, row_bytes]` (rows = product of the leading axes)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        flat = self._map[info.offset : info.offset + info.nbytes]
        return np.asarray(flat).reshape(rows, info.nbytes // max(rows, 1))

    def release(self, name: str) -> None:
        """Give back the map's pages that hold only this tensor's bytes (`madvise(MADV_DONTNEED)`): after a
        tensor was copied elsewhere, its pages need not count in this process's memory. The bytes stay
        readable: a later access reads them from the file again."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # not on every OS
            return
        info = self.tensors[name]
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.nbytes) // page * page
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def array(self, name: str) -> np.ndarray:
        """The tensor decoded: float32 in its numpy shape (int32 for I32 tensors such as `tid2eid`)."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.ggml_type == formats.GGMLType.I32:
            return raw.view(np.int32).reshape(info.shape).copy()
        return formats.dequantize(raw, info.ggml_type, info.shape)

    def bytes_by_type(self) -> dict[str, int]:
        """Total tensor bytes per ggml type name."""
        totals: dict[str, int] = {}
        for info in self.tensors.values():
            totals[info.type_name] = totals.get(info.type_name, 0) + info.nbytes
        return totals


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file without reading tensor data; raises GGUFContractError for unreadable files."""
    return GGUFFile(path)
