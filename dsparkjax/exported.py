"""Exported programs on disk, so that a warm start neither traces nor lowers its programs.

JAX's persistent compilation cache (`runtime.enable_compilation_cache`) is keyed by the lowered module, so a
process that finds every executable there still traces and lowers every program first: seconds per unrolled
DS4 step program (docs/bench.md, "Start-up"). `call` instead looks a traced call up in a directory of
`jax.export` programs (StableHLO bytecode), keyed by everything the module depends on, and calls the one it
finds; on a miss it traces the function, exports it and writes the entry. Either way the caller's jit lowers a
call to the same deserialized module, so cold and warm starts compile the same program and the compilation
cache hits from the second start on.

The directory is `exported/` inside the persistent compilation cache's, and the cache is on exactly when that
one is (`directory`). An entry that cannot be read back is reported and exported again; one that is gone (another
process evicted it, `dsparkjax.cache_bound`) is a plain miss. Every entry this process reads or writes is
marked used, so no eviction of this process removes it and others see it as recently used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
from jax import export

from dsparkjax import cache_bound

SUBDIR = "exported"
SUFFIX = ".jaxexp"
_MAGIC = b"dsjaxexp1"  # the entry layout: magic, SHA-256 of the payload, payload (pickle of out treedef, bytes)
# jax options that change what a trace produces beyond the argument types (the types are in the key)
_TRACE_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                 "jax_default_prng_impl")


def directory() -> str | None:
    """The exported-program directory: `exported/` in JAX's persistent compilation cache, None while that is off."""
    cache = jax.config.jax_compilation_cache_dir
    return os.path.join(cache, SUBDIR) if cache else None


def call(fn: Callable[..., Any], cache_name: str, compiler_options: dict[str, Any] | None, folder: str,
         args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`fn(*args, **kwargs)` while a jit traces it, through the exported program of `folder` for this call.

    Array leaves of `args`/`kwargs` are the jit's tracers; every other leaf is a static value (its repr is part of
    the key). `cache_name` names what `fn` computes, stably across processes. A miss traces `fn`, exports it and
    writes the entry (one that cannot be written is still used in this process); a program jax.export refuses is
    traced as plain jit would (`_export`).
    """
    leaves, in_tree = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    avals = [jax.typeof(leaves[i]) for i in dynamic]
    statics = [repr(leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.Array)]
    key = entry_key(cache_name, str(in_tree), statics, [str(a) for a in avals], compiler_options)
    path = Path(folder) / (key + SUFFIX)
    entry = _read(path)
    if entry is None:
        made = _export(fn, leaves, in_tree, dynamic, avals)
        if made is None:
            return fn(*args, **kwargs)
        out_tree, blob = made
        _write(path, out_tree, blob)
        cache_bound.use(path)
        cache_bound.sweep()  # the new entry may have taken the cache over its bound
        entry = out_tree, export.deserialize(blob)  # what a warm start loads: both compile the same module
    else:
        cache_bound.use(path)
    out_tree, program = entry
    return jax.tree.unflatten(out_tree, program.call(*(leaves[i] for i in dynamic)))


def entry_key(cache_name: str, in_tree: str, statics: list[str], avals: list[str],
              compiler_options: dict[str, Any] | None) -> str:
    """The file name (SHA-256 hex) of a call's entry: what it computes and on what, and everything of this process
    that the exported module depends on (`_process_fingerprint`)."""
    text = repr((cache_name, in_tree, statics, avals, sorted((compiler_options or {}).items()),
                 _process_fingerprint()))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _process_fingerprint() -> tuple[Any, ...]:
    """What a trace depends on besides its arguments, fixed for the process: jax and jaxlib, the backend and its
    device, the loaded FFI plugins' build, the dsparkjax sources and the trace-relevant jax options."""
    import jaxlib.version

    from dsparkjax.runtime import plugin_build_id

    device = jax.devices()[0]
    return (_MAGIC, jax.__version__, jaxlib.version.__version__, device.platform, device.device_kind,
            plugin_build_id(), _sources_digest(), tuple(str(getattr(jax.config, k)) for k in _TRACE_CONFIG))


def _sources_digest() -> str:
    """SHA-256 of the dsparkjax package's Python sources (their paths and bytes)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for source in sorted(root.rglob("*.py")):
        digest.update(str(source.relative_to(root)).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _export(fn: Callable[..., Any], leaves: list[Any], in_tree: Any, dynamic: list[int],
            avals: list[Any]) -> tuple[Any, bytes] | None:
    """Trace `fn` on the dynamic leaves' types (static leaves as given) and export it: (out treedef, bytes).

    An error of `fn` itself propagates; one of the export after `fn` was traced (a construct jax.export refuses)
    is logged and gives None: the caller then traces `fn` as plain jit would, uncached."""
    out_trees = []

    def flat(*arrays: jax.Array) -> list[jax.Array]:
        full = list(leaves)
        for i, array in zip(dynamic, arrays):
            full[i] = array
        call_args, call_kwargs = jax.tree.unflatten(in_tree, full)
        out_leaves, out_tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
        out_trees.append(out_tree)
        return out_leaves

    from dsparkjax.kernels import ffi

    # Our FFI targets carry no compatibility guarantee; an entry is only read by the same plugin build (the key).
    checks = [export.DisabledSafetyCheck.custom_call(target) for target in sorted(ffi.TARGETS)]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    try:
        blob = bytes(export.export(jax.jit(flat), disabled_checks=checks)(*shapes).serialize())
    except Exception as e:
        if not out_trees:
            raise
        logging.warning("dsparkjax.exported: cannot export %s (%s: %s); it is traced and lowered at every start",
                        getattr(fn, "__qualname__", fn), type(e).__name__, e)
        return None
    return out_trees[-1], blob


def _read(path: Path) -> tuple[Any, export.Exported] | None:
    """The entry at `path` (out treedef, program), None when there is none; one that cannot be read back is
    logged and ignored."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logging.warning("dsparkjax.exported: cannot read %s (%s); exporting the program again", path, e)
        return None
    head, digest, payload = data[:len(_MAGIC)], data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    if head != _MAGIC or hashlib.sha256(payload).digest() != digest:
        logging.warning("dsparkjax.exported: %s is truncated or corrupt; exporting the program again", path)
        return None
    try:
        out_tree, blob = pickle.loads(payload)
        return out_tree, export.deserialize(blob)
    except Exception as e:  # a whole entry this jax cannot load (the key should prevent it): export it again
        logging.warning("dsparkjax.exported: cannot load %s (%s: %s); exporting the program again", path,
                        type(e).__name__, e)
        return None


def _write(path: Path, out_tree: Any, blob: bytes) -> None:
    """Write the entry at `path` atomically (a temporary file renamed), logging instead of raising on failure."""
    payload = pickle.dumps((out_tree, blob), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
            os.chmod(tmp, 0o644)  # as the compilation cache's entries (mkstemp makes it private)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logging.warning("dsparkjax.exported: cannot write %s (%s); the next start exports it again", path, e)
