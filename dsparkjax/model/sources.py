"""Where the parameter loaders' tensors come from: a GGUF file streamed to the device, or shapes alone.

A source hands out each tensor *as stored*, already on the device: the packed bytes uint8
`[..., out, row_bytes]` of a type the packed kernels read, else the values in the tensor's numpy shape
(float16, bfloat16 or float32 for float types, int32 for I32). The loaders (`params.py`) turn those into
parameters on the device, so that no host copy of the weights is ever made: the file's bytes go from the
memory map to the device tensor by tensor (a few at once, ahead of the loader, on worker threads), and the
map's pages are given back once a tensor is there.

`ShapeSource` hands out `jax.ShapeDtypeStruct`s instead, so that running a loader on it sizes the parameters
it would build (for the device memory check before a load). `dsparkjax.tiny.DeviceRandomSource` generates
random valid tensors on the device (the benchmarks' full-size models without a file).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax import formats, validation
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


# Threads that check and copy tensors ahead of the loader (`FileSource`): the checks run at about 8 GB/s per core
# and the copies at the host-to-device rate, both without the GIL. 4 is an estimate for a PCIe Gen5 host until
# a GPU run compares (docs/bench.md, bench_load.py --load_workers).
LOAD_WORKERS = 4
# Bytes of tensors fetched ahead and not yet handed to the loader: at least two of DS4's largest expert stacks
# (0.7 GB each) with the small tensors between them, so one stack's copy overlaps the next one's checks. The host
# holds at most this much of the file beyond the page cache, and the device this much beyond the weights (within
# what the fit check leaves free: `load_streamed`).
INFLIGHT_BYTES = 2 << 30


class FileSource:
    """A GGUF file's tensors, each copied from the memory map to the device.

    Each tensor's bytes are checked (`check_tensor_bytes`), viewed in place in the map (no host copy), put
    on the device and waited for; then the map's pages of the tensor are released (a real file's pages stay in
    the page cache, from which the kernel reclaims them as it needs). Quantized types the kernels do not read
    are the exception: they are decoded on the host, one tensor at a time per worker. `progress` shows a bar of
    bytes loaded.

    Given the `order` the loader will fetch tensors in (`ShapeSource.fetched` of the same loader) and `workers`
    > 1, that work runs ahead of the loader on a pool of threads, in that order, with at most `inflight_bytes`
    (and at least one tensor) fetched ahead and not yet handed out; a fetch then waits for its tensor. A tensor's
    error (a corrupt one: GGUFContractError naming the file and tensor) is raised by the fetch of that tensor,
    as without workers. A fetch out of that order stops the prefetching and loads the rest one at a time. Close
    the source (`close`) when done, also after an error: it cancels the work not started and waits for the rest.
    """

    def __init__(self, file: GGUFFile, *, progress: bool = False, desc: str = "loading", order: Sequence[str] = (),
                 workers: int = 1, inflight_bytes: int = INFLIGHT_BYTES):
        self.file, self.path, self.tensors = file, file.path, file.tensors
        self._bar = None
        if progress:
            from tqdm import tqdm

            total = sum(info.nbytes for info in file.tensors.values())
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"{desc} {file.path}")
        self._ahead: collections.deque[tuple[str, Future]] = collections.deque()  # submitted, in order
        self._ahead_bytes, self._inflight_bytes = 0, inflight_bytes
        self._todo = collections.deque(order)  # not yet submitted
        self._pool = None
        if workers > 1 and order:
            self._device = jax.config.jax_default_device  # a thread-local default does not reach the workers
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"dsparkjax-load-{file.path}")
            self._submit()

    def fetch(self, name: str) -> jax.Array:
        if self._pool is not None and self._ahead and self._ahead[0][0] == name:
            _, future = self._ahead.popleft()
            array = future.result()  # the worker's exception, if any
            self._ahead_bytes -= self.tensors[name].nbytes
            self._submit()
        else:
            self._stop()  # off the recorded order (or none): one tensor at a time from here
            array = self._load(name)
        if self._bar is not None:
            self._bar.update(self.tensors[name].nbytes)
        return array

    def close(self) -> None:
        """Stop the workers (the tensors not started are dropped) and end the progress bar."""
        self._stop()
        if self._bar is not None:
            self._bar.close()

    def _load(self, name: str) -> jax.Array:
        """The tensor checked, on the device, and its pages of the map given back."""
        info = self.tensors[name]
        raw = self.file.raw(name)
        check_tensor_bytes(self.path, info, raw)
        shape, dtype = stored_form(info)
        if dtype == np.uint8 or info.ggml_type in _FLOAT_DTYPES or info.ggml_type == GGMLType.I32:
            host = raw.view(dtype).reshape(shape)  # a view of the map
        else:
            host = self.file.array(name)
        array = jax.device_put(host)
        if _aliases(array, host):
            # the CPU client wraps a 64-byte-aligned host buffer in place: such an array would read the map's pages
            # (given back below, read again from the file on use) and change with the file
            array = jnp.array(array, copy=True)
        array.block_until_ready()
        self.file.release(name)
        return array

    def _load_on_device(self, name: str) -> jax.Array:
        with jax.default_device(self._device):
            return self._load(name)

    def _submit(self) -> None:
        """Hand the workers the next tensors of the order while the bytes ahead stay within the bound."""
        while self._todo and (not self._ahead or
                              self._ahead_bytes + self.tensors[self._todo[0]].nbytes <= self._inflight_bytes):
            name = self._todo.popleft()
            self._ahead.append((name, self._pool.submit(self._load_on_device, name)))
            self._ahead_bytes += self.tensors[name].nbytes

    def _stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._ahead.clear()
            self._todo.clear()


def _aliases(array: jax.Array, host: np.ndarray) -> bool:
    """Whether `array` is `host`'s memory itself rather than a copy of it."""
    return array.unsafe_buffer_pointer() == host.ctypes.data


class ShapeSource:
    """The stored forms of a file's (or a contract's) tensors as ShapeDtypeStructs: a loader run on it
    returns the parameters' shapes and dtypes without reading or allocating anything."""

    def __init__(self, path: str, tensors: Mapping[str, TensorInfo]):
        self.path, self.tensors = path, tensors
        self.fetched: list[str] = []  # the names fetched, in order: the order the loader reads a file in

    def fetch(self, name: str) -> jax.ShapeDtypeStruct:
        self.fetched.append(name)
        return jax.ShapeDtypeStruct(*stored_form(self.tensors[name]))


def load_streamed(file: GGUFFile, load: Callable[[TensorSource], T], *, progress: bool = False,
                  desc: str = "loading", workers: int = LOAD_WORKERS) -> T:
    """`load(source)` (a params loader bound to its config, dtype and packing) on `file`: first on its shapes,
    to check the result fits the device (`footprint.check_fits`) and to record the order it fetches tensors in,
    then on the file itself, streamed, with `workers` threads fetching ahead in that order (1: one tensor at a
    time). The bytes fetched ahead are bounded by `INFLIGHT_BYTES` and by the device memory the weights and the
    steps' workspace leave free."""
    from dsparkjax import footprint

    validation.positive_int(workers, "load_workers")
    shapes = ShapeSource(file.path, file.tensors)
    need = footprint.tree_bytes(load(shapes))
    footprint.check_fits(need, f"the weights of {file.path}")
    mem = footprint.device_memory()
    spare = INFLIGHT_BYTES if mem is None else mem.free - need - footprint.WORKSPACE_BYTES
    source = FileSource(file, progress=progress, desc=desc, order=shapes.fetched, workers=workers,
                        inflight_bytes=min(INFLIGHT_BYTES, spare))
    try:
        return load(source)
    finally:
        source.close()
