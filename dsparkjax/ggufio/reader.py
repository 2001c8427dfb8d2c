"""Memory-mapped GGUF reading through gguf-py, extended for the lucebox type ids 100–107.

gguf-py's `GGUFReader` parses the header and metadata; its tensor table builder rejects type ids it does
not know and reads every tensor eagerly, so `_LazyReader` replaces that one step: it records each tensor's
name, type, shape and byte range and leaves the bytes on disk until asked (`quant_hc.md` §5.2).

gguf-py trusts every count in the header: a metadata array that claims 2^62 entries makes it loop for
minutes, and a tensor offset near 2^64 wraps. `_LazyReader` therefore bounds each read by the bytes the file
holds (a count, string length or dimension list that cannot fit is refused at once, naming the key or
tensor), and checks each tensor's byte range: inside the data section, aligned, not wrapping, not
overlapping another tensor.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
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


MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes one entry can take in the file, which bounds each count by the bytes left after it.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dim count, one dim, type, offset
_VALUE_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8}


def _shown(name: bytes) -> str:
    """A key or tensor name for an error message: as is when printable, else its repr (a corrupt name)."""
    text = name.decode("utf-8", errors="replace")
    return text if text.isprintable() else repr(text)


class _LazyReader(GGUFReader):
    """GGUFReader that indexes tensors instead of reading them, knows the lucebox ids, and bounds every count
    of the header by the bytes of the file. `where` names the part being parsed (a key, a tensor), for the
    error a malformed header raises."""

    def __init__(self, path: str):
        self.where = "GGUF header"
        self.path = path
        try:
            super().__init__(path)
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as err:
            raise self._refuse("a valid GGUF v2/v3 header and metadata",
                               f"{type(err).__name__}: {err} (truncated or corrupt)") from None

    def _refuse(self, expected: str, found: str) -> GGUFContractError:
        return GGUFContractError(self.path, self.where, expected, found)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if end > self.data.shape[0]:
            raise self._refuse(f"{count} value(s) of {np.dtype(dtype).name} at byte {offset}",
                               f"a file of {self.data.shape[0]} bytes "
                               "(truncated or corrupt: a count or length past the end)")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        try:
            gtype = GGUFValueType(int(raw_type))
        except ValueError:
            raise self._refuse("a GGUF value type", f"type id {int(raw_type)}") from None
        if gtype == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            try:
                item = GGUFValueType(item_type)
            except ValueError:
                raise self._refuse("an array of a GGUF value type", f"item type id {item_type}") from None
            if item == GGUFValueType.ARRAY:
                raise self._refuse("an array of scalars or strings", "an array of arrays")
            item_bytes = _VALUE_BYTES.get(item) or np.dtype(self.gguf_scalar_to_np[item]).itemsize
            left = self.data.shape[0] - orig_offs - 12
            if count * item_bytes > left:
                raise self._refuse(f"an array count that fits the {left} bytes left in the file",
                                   f"{count} entries of {item.name}, at least {count * item_bytes} bytes "
                                   "(truncated or corrupt)")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs: int, count: int) -> int:
        count = int(count)
        if count * _MIN_KV_BYTES > self.data.shape[0] - offs:
            raise self._refuse(f"a metadata key count that fits the {self.data.shape[0] - offs} bytes left in the file",
                               f"kv_count {count} (truncated or corrupt)")
        for index in range(count):
            self.where = f"metadata key #{index}"
            length = int(self._get(offs, np.uint64)[0])
            self.where = f"metadata key {_shown(bytes(self._get(offs + 8, np.uint8, length)))}"
            offs = super()._build_fields(offs, 1)
        self.where = "GGUF header"
        return offs

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[ReaderField]]:
        count = int(count)
        if count * _MIN_TENSOR_INFO_BYTES > self.data.shape[0] - offs:
            raise self._refuse(f"a tensor count that fits the {self.data.shape[0] - offs} bytes left in the file",
                               f"tensor_count {count} (truncated or corrupt)")
        fields = []
        for index in range(count):
            self.where = f"tensor info #{index}"
            length = int(self._get(offs, np.uint64)[0])
            self.where = "tensor " + _shown(bytes(self._get(offs + 8, np.uint8, length)))
            n_dims = int(self._get(offs + 8 + length, np.uint32)[0])
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._refuse(f"1 to {MAX_DIMS} dimensions", str(n_dims))
            offs, (field,) = super()._build_tensor_info(offs, 1)
            fields.append(field)
        self.where = "GGUF header"
        return offs, fields

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        infos: dict[str, TensorInfo] = {}
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            self.where = f"tensor {_shown(bytes(name_data))}"
            if name in infos:
                raise self._refuse("a unique name", "a duplicate")
            infos[name] = self._tensor_info(name, int(raw_dtype[0]), [int(d) for d in dims.tolist()],
                                            int(start_offs), int(offset_tensor[0]))
        self._check_no_overlap(infos)
        self.where = "GGUF header"
        self.tensors = []
        self.tensor_infos = infos

    def _tensor_info(self, name: str, ggml_type: int, ne: list[int], data_start: int, rel_offset: int) -> TensorInfo:
        """One tensor's index entry, its byte range checked to lie in the data section, aligned (Python ints:
        an offset near 2^64 cannot wrap)."""
        shape = tuple(reversed(ne))
        size = int(self.data.shape[0])
        if any(d <= 0 for d in shape):
            raise self._refuse("dimensions > 0", f"shape {shape}")
        try:
            nbytes = formats.row_bytes(ggml_type, shape[-1]) * math.prod(shape[:-1])
        except (FormatError, DsparkError, KeyError, ValueError) as err:
            raise self._refuse("a known ggml type with whole blocks per row",
                               f"type id {ggml_type}, shape {shape} ({err})") from None
        if rel_offset % self.alignment:
            raise self._refuse(f"an offset aligned to {self.alignment} bytes", f"offset {rel_offset}")
        offset = data_start + rel_offset
        if offset + nbytes > size:
            raise self._refuse(f"{nbytes} bytes at offset {offset}", f"a file of {size} bytes (truncated or corrupt)")
        return TensorInfo(name, ggml_type, shape, offset, nbytes)

    def _check_no_overlap(self, infos: dict[str, TensorInfo]) -> None:
        ordered = sorted(infos.values(), key=lambda info: info.offset)
        for before, after in zip(ordered, ordered[1:]):
            if before.offset + before.nbytes > after.offset:
                self.where = f"tensor {after.name}"
                raise self._refuse(f"bytes after those of {before.name} (ending at {before.offset + before.nbytes})",
                                   f"offset {after.offset} (overlapping tensors)")


def _contents(path: str, key: str, field: ReaderField) -> Any:
    """A metadata value as plain Python; GGUFContractError naming the key for a string that is not UTF-8."""
    try:
        return field.contents()
    except UnicodeDecodeError as err:
        raise GGUFContractError(path, f"metadata key {key}", "UTF-8 strings", f"undecodable bytes ({err})") from None


class GGUFFile:
    """An open GGUF file: plain-Python metadata, a tensor index, and lazy access to each tensor's bytes."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        if not os.path.isfile(self.path):
            found = "a directory" if os.path.isdir(self.path) else "no such file"
            raise GGUFContractError(self.path, "file", "an existing GGUF file", found)
        reader = _LazyReader(self.path)
        # Tensors are read through a map of our own, whose pages `release` can give back (gguf-py's memmap, which
        # parsed the header, is dropped with the reader).
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, np.uint8)
        self.metadata: dict[str, Any] = {
            key: _contents(self.path, key, field) for key, field in reader.fields.items() if not key.startswith("GGUF.")
        }
        # Each key's value type (an array's item type), so that a copy of the file can keep them.
        self.value_types: dict[str, GGUFValueType] = {key: reader.fields[key].types[-1] for key in self.metadata}
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
