"""Where the parameter loaders' tensors come from: a GGUF file streamed to the device, or shapes alone.

A source hands out each tensor *as stored*, already on the device: the packed bytes uint8
`[..., out, row_bytes]` of a type the packed kernels read, else the values in the tensor's numpy shape
(float16, bfloat16 or float32 for float types, int32 for I32). The loaders (`params.py`) turn those into
parameters on the device, so that no host copy of the weights is ever made: the file's bytes go from the
memory map to the device tensor by tensor, and the map's pages are given back once a tensor is there.

`ShapeSource` hands out `jax.ShapeDtypeStruct`s instead, so that running a loader on it sizes the parameters
it would build (for the device memory check before a load). `dsparkjax.tiny.DeviceRandomSource` generates
random valid tensors on the device (the benchmarks' full-size models without a file).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax import formats
from dsparkjax.formats import FLOAT_TYPES, GGMLType
from dsparkjax.ggufio.contract import check_tensor_bytes
from dsparkjax.ggufio.reader import GGUFFile, TensorInfo
from dsparkjax.kernels.packed import KERNEL_TYPES

T = TypeVar("T")
_FLOAT_DTYPES = {GGMLType.F32: np.dtype(np.float32), GGMLType.F16: np.dtype(np.float16),
                 GGMLType.BF16: np.dtype(jnp.bfloat16)}


class TensorSource(Protocol):
    """Tensors by GGUF name, as stored (`stored_form`), on the device."""

    path: str  # named in errors
    tensors: Mapping[str, TensorInfo]

    def fetch(self, name: str) -> Any:
        """The tensor `name` (present in `tensors`) in its stored form: a jax.Array (or a ShapeDtypeStruct)."""


def packs(ggml_type: int) -> bool:
    """Whether tensors of this type are handed out as packed bytes: quantized types the kernels read."""
    return ggml_type in KERNEL_TYPES and ggml_type not in FLOAT_TYPES


def stored_form(info: TensorInfo) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) a source hands `info`'s tensor out in: packed bytes `[..., out, row_bytes]` (uint8) for
    `packs` types, the float or int32 values of its numpy shape otherwise (float32 for quantized types only
    the host decodes)."""
    if packs(info.ggml_type):
        return (*info.shape[:-1], formats.row_bytes(info.ggml_type, info.shape[-1])), np.dtype(np.uint8)
    if info.ggml_type == GGMLType.I32:
        return info.shape, np.dtype(np.int32)
    return info.shape, _FLOAT_DTYPES.get(info.ggml_type, np.dtype(np.float32))


class FileSource:
    """A GGUF file's tensors, each copied from the memory map to the device when fetched.

    Each tensor's bytes are checked (`check_tensor_bytes`), viewed in place in the map (no host copy), put
    on the device and waited for; then the map's pages of the tensor are released, so the host holds at
    most about one tensor of the file at a time (a real file's pages stay in the page cache, from which the
    kernel reclaims them as it needs). Quantized types the kernels do not read are the exception: they are
    decoded on the host, one tensor at a time. `progress` shows a bar of bytes loaded.
    """

    def __init__(self, file: GGUFFile, *, progress: bool = False, desc: str = "loading"):
        self.file, self.path, self.tensors = file, file.path, file.tensors
        self._bar = None
        if progress:
            from tqdm import tqdm

            total = sum(info.nbytes for info in file.tensors.values())
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"{desc} {file.path}")

    def fetch(self, name: str) -> jax.Array:
        info = self.tensors[name]
        raw = self.file.raw(name)
        check_tensor_bytes(self.path, info, raw)
        shape, dtype = stored_form(info)
        if dtype == np.uint8 or info.ggml_type in _FLOAT_DTYPES or info.ggml_type == GGMLType.I32:
            host = raw.view(dtype).reshape(shape)  # a view of the map
        else:
            host = self.file.array(name)
        array = jax.device_put(host)
        array.block_until_ready()
        self.file.release(name)
        if self._bar is not None:
            self._bar.update(info.nbytes)
        return array

    def close(self) -> None:
        """End the progress bar."""
        if self._bar is not None:
            self._bar.close()


class ShapeSource:
    """The stored forms of a file's (or a contract's) tensors as ShapeDtypeStructs: a loader run on it
    returns the parameters' shapes and dtypes without reading or allocating anything."""

    def __init__(self, path: str, tensors: Mapping[str, TensorInfo]):
        self.path, self.tensors = path, tensors

    def fetch(self, name: str) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(*stored_form(self.tensors[name]))


def load_streamed(file: GGUFFile, load: Callable[[TensorSource], T], *, progress: bool = False,
                  desc: str = "loading") -> T:
    """`load(source)` (a params loader bound to its config, dtype and packing) on `file`: first on its shapes,
    to check the result fits the device (`footprint.check_fits`), then on the file itself, streamed."""
    from dsparkjax import footprint

    shapes = load(ShapeSource(file.path, file.tensors))
    footprint.check_fits(footprint.tree_bytes(shapes), f"the weights of {file.path}")
    source = FileSource(file, progress=progress, desc=desc)
    try:
        return load(source)
    finally:
        source.close()
