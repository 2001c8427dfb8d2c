"""Loading, version-checking and calling the compiled XLA FFI plugins (`custom_calls/`).

Plugins are shared libraries loaded with ctypes; their handlers are wrapped with `jax.ffi.pycapsule` and
registered under one target name per op for each platform they serve ("cpu", and "CUDA" exactly, see
jax_anchors.md §1.2). They are looked up in `$DSPARKJAX_LIB_DIR` if set, else in `dsparkjax/_lib/` next to this package or
in site-packages (where `pip install .` and the redirecting `pip install -e .` put them). A plugin built against a newer FFI API than the running jaxlib is refused with a
clear message instead of XLA's late "No FFI handler registered" (jax_anchors.md §1.8), and so is one whose
handlers take other arguments or attributes than this module passes (its exported `DsparkPluginAbi`, bumped with
every binding change, differs from PLUGIN_ABI).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.errors import DsparkError

BUILD_HINT = (
    "build it with `pip install -e .` (CMake; `DSPARKJAX_CUDA=ON pip install -e .` adds the CUDA plugin) or "
    "`bazel build //custom_calls:all` and point DSPARKJAX_LIB_DIR at $(bazel info bazel-bin)/custom_calls"
)

# The handlers' calling convention this module speaks: custom_calls/ffi_common.h's kPluginAbi.
PLUGIN_ABI = 4

# op name -> exported handler symbol stem; the symbol is stem + the plugin's suffix.
_OPS = {
    "dspark_qmatmul": "DsparkQMatmul",
    "dspark_qmatmul_id": "DsparkQMatmulId",
    "dspark_hc_pre": "DsparkHcPre",
    "dspark_hc_post": "DsparkHcPost",
    "dspark_indexer_topk": "DsparkIndexerTopk",
    "dspark_rms_norm": "DsparkRmsNorm",
    "dspark_grouped_matmul": "DsparkGroupedMatmul",
}
# ops of the CPU plugin alone: the model of the GPU integer path (`qmatmul_i8_model`)
_CPU_OPS = {"dspark_qmatmul_i8_model": "DsparkQMatmulI8Model"}


class PluginError(DsparkError):
    """An FFI plugin is missing, cannot be loaded, or was built for a newer FFI API than the runtime."""


@dataclasses.dataclass(frozen=True)
class _PluginSpec:
    library: str  # file name
    platform: str  # jax.ffi.register_ffi_target platform string
    suffix: str  # handler symbol suffix
    ops: dict[str, str]  # op name -> handler symbol stem


_PLUGINS = {
    "cpu": _PluginSpec("libdspark_cpu_ffi.so", "cpu", "Cpu", {**_OPS, **_CPU_OPS}),
    "gpu": _PluginSpec("libdspark_cuda_ffi.so", "CUDA", "Cuda", _OPS),
}
TARGETS = frozenset(target for spec in _PLUGINS.values() for target in spec.ops)  # every custom-call name we register


def lib_dirs() -> list[Path]:
    """Directories searched for the plugin libraries, in order."""
    env = os.environ.get("DSPARKJAX_LIB_DIR")
    if env:
        return [Path(env)]
    site = [Path(sysconfig.get_paths()[k]) / "dsparkjax" / "_lib" for k in ("platlib", "purelib")]
    return list(dict.fromkeys([Path(__file__).resolve().parent.parent / "_lib", *site]))


def runtime_ffi_api_version() -> tuple[int, int]:
    """(major, minor) XLA FFI API version of the running jaxlib, read from the headers it ships."""
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    text = header.read_text()
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    if not (major and minor):
        raise PluginError(f"cannot read the XLA FFI API version from {header}")
    return int(major.group(1)), int(minor.group(1))


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """What a loaded plugin was built with, read from its exported functions."""

    ffi_api: tuple[int, int]  # (major, minor) of the XLA FFI headers
    hc_mix_chunk: int  # HC-pre's GPU mix sums each token's n·D stream values in chunks of this many (kHcMixChunk)
    path: str  # the library loaded


def check_plugin_abi(path: Path, abi: int | None) -> None:
    """Refuse a plugin whose handlers' calling convention (`abi`, None when it exports none) is not PLUGIN_ABI."""
    if abi is None:
        raise PluginError(f"{path} exports no DsparkPluginAbi: not a dsparkjax plugin, or one built from sources "
                          f"older than its matmuls' `mma` attribute; rebuild it: {BUILD_HINT}")
    if abi != PLUGIN_ABI:
        raise PluginError(f"{path} speaks plugin ABI {abi} but this dsparkjax speaks {PLUGIN_ABI}; rebuild the "
                          f"plugin from this checkout's custom_calls/: {BUILD_HINT}")


def _load(kind: str) -> PluginInfo:
    """Load and register one plugin; returns what it was built with, raises PluginError."""
    spec = _PLUGINS[kind]
    found = [d / spec.library for d in lib_dirs() if (d / spec.library).exists()]
    if not found:
        where = ", ".join(str(d) for d in lib_dirs())
        raise PluginError(f"dsparkjax FFI plugin {spec.library} was not built (looked in {where}); {BUILD_HINT}")
    path = found[0]
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise PluginError(f"cannot load {path}: {e}") from e

    def symbol(name: str):
        try:
            return getattr(lib, name)
        except AttributeError as e:
            raise PluginError(f"{path} has no symbol {name} (not a dsparkjax plugin, or built from older sources); "
                              f"{BUILD_HINT}") from e

    check_plugin_abi(path, getattr(lib, "DsparkPluginAbi", None) and lib.DsparkPluginAbi())
    built = (symbol("DsparkFfiApiMajor")(), symbol("DsparkFfiApiMinor")())
    runtime = runtime_ffi_api_version()
    if built[0] != runtime[0] or built[1] > runtime[1]:
        raise PluginError(
            f"{path} was built against XLA FFI API {built[0]}.{built[1]} but this jaxlib ({jax.__version__}) "
            f"provides {runtime[0]}.{runtime[1]}; rebuild it against the oldest supported jaxlib (0.10.2)"
        )
    mix_chunk = symbol("DsparkHcMixChunk")
    mix_chunk.restype = ctypes.c_int64
    handlers = {target: symbol(stem + spec.suffix) for target, stem in spec.ops.items()}  # all, before registering
    for target, fn in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform=spec.platform)
    return PluginInfo(built, mix_chunk(), str(path))


_STATUS: dict[str, PluginError | None] = {}  # plugin kind -> None when loaded, else why not
PLUGINS: dict[str, PluginInfo] = {}  # plugin kind -> what the loaded plugin was built with
for _kind in _PLUGINS:
    try:
        PLUGINS[_kind] = _load(_kind)
        _STATUS[_kind] = None
    except PluginError as _e:
        _STATUS[_kind] = _e


def platform_kind() -> str:
    """'cpu' or 'gpu': which plugin serves the default JAX backend."""
    return "cpu" if jax.default_backend() == "cpu" else "gpu"


def available(kind: str | None = None) -> bool:
    """True if the plugin for `kind` (default: the current platform) is loaded and registered."""
    return _STATUS.get(kind or platform_kind()) is None


def require(kind: str | None = None) -> None:
    """Raise the PluginError explaining why the plugin for `kind` (default: current platform) is unusable."""
    err = _STATUS.get(kind or platform_kind(), PluginError(f"no dsparkjax FFI plugin for platform {kind}"))
    if err is not None:
        raise err


def _call(target: str, out: object, *args: jax.Array, **attrs: np.generic):
    return jax.ffi.ffi_call(target, out, vmap_method="broadcast_all")(*args, **attrs)


def qmatmul(x: jax.Array, w_packed: jax.Array, ggml_type: int, mma: int) -> jax.Array:
    """FFI packed matmul: x `[T, K]` (f32|bf16), w_packed uint8 `[N, row_bytes]` -> float32 `[T, N]`; `mma` the
    tensor-core mode's code (`policy.MMA_CODES`)."""
    out = jax.ShapeDtypeStruct((x.shape[0], w_packed.shape[0]), jnp.float32)
    return _call("dspark_qmatmul", out, x, w_packed, ggml_type=np.int32(ggml_type), mma=np.int32(mma))


def qmatmul_id(x: jax.Array, w_packed: jax.Array, ids: jax.Array, ggml_type: int, groups: int, mma: int
               ) -> jax.Array:
    """FFI MoE matmul: x `[T, K]`, w_packed uint8 `[E, N, row_bytes]`, ids int32 `[T, k]` -> f32 `[T, k, N]`.

    `groups` = G > 0 declares a grouped projection: E = G, k = 1 and ids[p] = p mod G (as `qmatmul_grouped`
    builds them), which the GPU may run on its tensor-core kernel for several tokens per group (same bits), as
    `mma` (the tensor-core mode's code) allows.
    """
    out = jax.ShapeDtypeStruct((x.shape[0], ids.shape[1], w_packed.shape[1]), jnp.float32)
    return _call("dspark_qmatmul_id", out, x, w_packed, ids, ggml_type=np.int32(ggml_type), groups=np.int32(groups),
                 mma=np.int32(mma))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """FFI RMSNorm of each row alone: x `[T, K]` (f32|bf16), w float32 `[K]` -> float32 `[T, K]`,
    `(x · r) · w` with `r = 1/sqrt(Σx²/K + eps)`, Σ in an order fixed by K (batch invariant)."""
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return _call("dspark_rms_norm", out, x, w, eps=np.float32(eps))


def grouped_matmul(x: jax.Array, w: jax.Array, transposed: bool, layer: jax.Array | None = None) -> jax.Array:
    """FFI grouped float products: x float32 `[G, M, K]`, w float `[G, N, K]` (or `[G, K, N]` when `transposed`)
    -> float32 `[G, M, N]`, `y[g, m, n] = Σ_k x[g, m, k]·w[g][n, k]`, each output one multiply-add chain over k in
    order: its bits depend on K alone (batch invariant). With `layer` (int32 `[]`), w is a stack `[L, G, ...]` whose
    layer `layer` the kernel reads in place (a scanned body's cache, not sliced out of the stack for the call)."""
    n = w.shape[-1] if transposed else w.shape[-2]
    out = jax.ShapeDtypeStruct((*x.shape[:2], n), jnp.float32)
    return _call("dspark_grouped_matmul", out, x, w, jnp.asarray(0 if layer is None else layer, jnp.int32),
                 transposed=np.int32(transposed))


def qmatmul_i8_model(x: jax.Array, w_packed: jax.Array, ggml_type: int) -> jax.Array:
    """The GPU integer path's result computed on the CPU, bit for bit (custom_calls/cpu_i8_model.h): x `[T, K]`
    (f32|bf16) and w_packed uint8 `[N, row_bytes]` (Q8_0, Q2_K or IQ2_XXS, rows a multiple of 4 bytes) on the
    CPU -> float32 `[T, N]`. What the GPU's `qmatmul` (dense, MoE and grouped alike) returns for each row and
    token; the CPU tests check it against numpy and the GPU tests check the device against it."""
    out = jax.ShapeDtypeStruct((x.shape[0], w_packed.shape[0]), jnp.float32)
    return _call("dspark_qmatmul_i8_model", out, x, w_packed, ggml_type=np.int32(ggml_type))


def hc_mix_chunk() -> int:
    """HC-pre's mix chunk (values per chunk), as the loaded plugins were built with it (all from ffi_common.h's
    kHcMixChunk, so any of them tells; a call on another platform's device needs no plugin of the default one)."""
    if not PLUGINS:
        require()
    return next(iter(PLUGINS.values())).hc_mix_chunk


def hc_mix_chunks(n: int, d: int) -> int:
    """How many chunks the GPU's HC-pre mix splits a token's n·D stream values into (the workspace's C)."""
    return -(-n * d // hc_mix_chunk())


def hc_pre(
    streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, iters: int, hc_eps: float,
    norm_eps: float, layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FFI HC-pre: streams `[T, n, D]` -> (u `[T, D]`, post `[T, n]`, comb `[T, n, n]`), all float32.

    fn is `[(2+n)·n, n·D]`, or with `layer` (int32 `[]`) a stack `[L, (2+n)·n, n·D]` whose layer `layer` the kernel
    reads in place (a scanned body's, not sliced out of the stack for the call).

    The kernel's fourth output is its workspace, dropped here: `[T, C, (2+n)·n + 1]` float32 with
    C = ceil(n·D / hc_mix_chunk()), the GPU's per-chunk sums of each mix row and of the squares.
    """
    t, n, d = streams.shape
    f32 = jnp.float32
    outs = (
        jax.ShapeDtypeStruct((t, d), f32),
        jax.ShapeDtypeStruct((t, n), f32),
        jax.ShapeDtypeStruct((t, n, n), f32),
        jax.ShapeDtypeStruct((t, hc_mix_chunks(n, d), fn.shape[-2] + 1), f32),
    )
    u, post, comb, _ = _call(
        "dspark_hc_pre", outs, streams, fn, jnp.asarray(0 if layer is None else layer, jnp.int32), base.astype(f32),
        scale.astype(f32),
        iters=np.int32(iters), hc_eps=np.float32(hc_eps), norm_eps=np.float32(norm_eps),
    )
    return u, post, comb


def hc_post(block_out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """FFI HC-post: `X'[t, k] = post[t, k]·F[t] + Σ_j comb[t, j, k]·X[t, j]` -> float32 `[T, n, D]`."""
    out = jax.ShapeDtypeStruct(streams.shape, jnp.float32)
    return _call("dspark_hc_post", out, block_out, streams, post.astype(jnp.float32), comb.astype(jnp.float32))


def indexer_topk(queries: jax.Array, keys: jax.Array, head_weights: jax.Array, lengths: jax.Array, k: int,
                 layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """FFI Lightning Indexer selection (custom_calls/indexer_common.h): reads only the entries below each row's
    length. Same arguments and results as `reference.indexer_topk`, but for `layer` (int32 `[]`): with it, keys is
    a stack `[L, B, N, d]` whose layer `layer` the kernel reads in place (a scanned body's). The kernel's second
    output, its scores workspace float32 `[B, Q, N]` (written below each row's length only), is dropped here.
    """
    b, q = lengths.shape
    outs = (jax.ShapeDtypeStruct((b, q, k), jnp.int32), jax.ShapeDtypeStruct((b, q, keys.shape[-2]), jnp.float32))
    picks, _ = _call("dspark_indexer_topk", outs, queries, keys, jnp.asarray(0 if layer is None else layer, jnp.int32),
                     head_weights, lengths)
    return picks, jnp.arange(k, dtype=jnp.int32) < lengths[..., None]
