"""Process setup for running DeepSeek-V4-Flash on JAX: the device memory JAX takes, and the persistent
compilation cache.

Two JAX defaults get in the way of a model that fills a GPU:
- When its GPU backend starts, JAX reserves XLA_PYTHON_CLIENT_MEM_FRACTION of each device for its allocator,
  0.75 by default (JAX's GPU memory allocation docs): the 86.7 GB published file plus the drafter, the decode
  states and a step's workspace come close to that on a 141 GB H200, and a 30-layer slice failed on an
  80 GB H100 with RESOURCE_EXHAUSTED. `configure` makes the default 0.95 (the user's own setting wins). It
  must run before JAX first touches a device; afterwards the fraction cannot change, and `configure` says so.
- Every process compiles its programs again, about a minute per step program at full size. `configure` turns
  on JAX's persistent compilation cache so that the next start of the same model and widths loads them
  instead. The XLA FFI custom calls keep it usable (JAX declines to cache only programs with host
  callbacks); since a cached executable names its custom calls but does not contain them, each build of the
  plugins gets its own cache directory. That cache is keyed by the lowered module, so the programs' exported
  modules are kept beside it (`dsparkjax.exported`): a warm start neither traces nor lowers them either. The
  whole tree is held to a size bound, evicting what was used least recently (`dsparkjax.cache_bound`).

The scripts call `configure()` first thing; library users call it before their first JAX computation. Either
way `load_target` checks the weights fit the device (`dsparkjax.footprint`) and says how to make room.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import jax

from dsparkjax import cache_bound, exported

MEM_FRACTION = 0.95  # of each GPU, for JAX's allocator; the rest is the CUDA context's and libraries'
CACHE_ENV = "DSPARKJAX_XLA_CACHE"  # the cache directory; "off" (or "0", "") turns the cache off
# Programs that compile faster than this are not written (JAX's own default, explicit here): every model
# step and drafter program takes longer, the many small eager ops do not.
MIN_COMPILE_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `configure` left in effect."""

    mem_fraction: float | None  # XLA_PYTHON_CLIENT_MEM_FRACTION (None: JAX's default, 0.75)
    backend_was_running: bool  # JAX's backends had started before `configure`: the fraction could not change
    cache_dir: str | None  # the persistent compilation cache (None: off)


def configure(*, cache_dir: str | None = None) -> Settings:
    """Give JAX MEM_FRACTION of each GPU (unless XLA_PYTHON_CLIENT_MEM_FRACTION is set) and turn on the
    persistent compilation cache (`enable_compilation_cache`). Call it before JAX first touches a device."""
    running = _backends_running()
    if running and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        logging.warning("dsparkjax.runtime.configure: JAX's backends have already started, so they keep JAX's "
                        "default share of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.75); call configure() "
                        "before the first JAX computation to give them %s", MEM_FRACTION)
    elif not running:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(MEM_FRACTION))
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return Settings(float(fraction) if fraction else None, running, enable_compilation_cache(cache_dir))


def enable_compilation_cache(cache_dir: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache; returns its directory, or None when it is off.

    The directory is `cache_dir`, else $DSPARKJAX_XLA_CACHE, else `$DSPARKJAX_CACHE/xla` (default
    `~/.cache/dsparkjax/xla`), each under a subdirectory named for the loaded plugins' build
    (`plugin_build_id`). $DSPARKJAX_XLA_CACHE=off turns it off; a cache the user already configured for JAX
    (JAX_COMPILATION_CACHE_DIR) is kept as it is. Its `exported/` subdirectory holds the exported programs
    (`dsparkjax.exported`), on exactly when this cache is. The whole tree is held to $DSPARKJAX_CACHE_MAX_SIZE
    (`dsparkjax.cache_bound`, 10 GiB by default; a bad value raises DsparkError), least recently used first.
    """
    env = os.environ.get(CACHE_ENV)
    if cache_dir is None and env is not None and env.strip().lower() in ("", "0", "off", "false", "no"):
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    limit = cache_bound.max_bytes()  # before anything is written: a bad value stops here
    root = cache_dir or env or os.path.join(
        os.environ.get("DSPARKJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsparkjax")), "xla")
    path = os.path.join(root, plugin_build_id())
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    cache_bound.install(None if limit is None else cache_bound.Bound(
        Path(root), Path(path), Path(path) / exported.SUBDIR, exported.SUFFIX, limit))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor, no filesystem override
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX's own variable wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # a cache JAX checked before (and found off) is looked at again
    return path


def plugin_build_id() -> str:
    """A name for the loaded FFI plugins' build: the SHA-256 of their files (16 hex digits), "no-plugin"."""
    from dsparkjax.kernels import ffi

    paths = sorted(info.path for info in ffi.PLUGINS.values())
    if not paths:
        return "no-plugin"
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _backends_running() -> bool:
    """Whether JAX's backends have started (after which the memory fraction no longer applies)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without it: assume started, so nothing is promised
        return True
