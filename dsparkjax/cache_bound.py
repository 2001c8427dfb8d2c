"""A size bound on the persistent compilation cache's directory, evicting what was used least recently first.

`runtime.enable_compilation_cache` lays the cache out as `<root>/<build>/`, one directory per build of the FFI
plugins (`runtime.plugin_build_id`), each holding JAX's compiled executables and, in `exported/`, our exported
programs (`dsparkjax.exported`). Three things grow it, and each is bounded where it can be:
- JAX's executables of the running build: JAX's own LRU eviction (`jax_compilation_cache_max_size`) keeps them
  within the bound as it writes.
- Other builds' directories (every rebuilt plugin leaves one): no process of this build can use them, so
  `sweep` evicts them whole, by their directory's last use (stamped when a process installs the bound).
- Exported programs of the running build (their key holds a digest of the package sources, so every source edit
  leaves old ones): `sweep` evicts them one by one in the same order, by their file's mtime (`use` touches an
  entry on every hit, since atime is often off), except those this process used.
`sweep` runs when the bound is installed (start-up) and after each exported program written. A directory or
file another process deletes meanwhile is skipped; a reader that loses an entry so reads a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import time
from pathlib import Path

import jax

from dsparkjax.errors import DsparkError

MAX_SIZE_ENV = "DSPARKJAX_CACHE_MAX_SIZE"  # the bound: "20G", "500M", bytes; "0"/"off" for none
# Meant to hold one build's programs (prefill, step, drafter at the widths served) and a previous build's; about a
# ninth of the 86.7 GB weights file a user keeps on this disk anyway. Full-size entries: docs/bench.md.
DEFAULT_MAX_BYTES = 10 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?")
_NO_BOUND = ("OFF", "NONE", "UNLIMITED")
_BUILD_NAME = re.compile(r"[0-9a-f]{16}|no-plugin")  # `runtime.plugin_build_id`; nothing else is ever deleted
_JAX_ENTRY, _JAX_ATIME = "-cache", "-atime"  # JAX's LRU layout: `<key>-cache` and its last use `<key>-atime`


@dataclasses.dataclass(frozen=True)
class Bound:
    """The cache tree under `root` held to `max_bytes`; `current` is the running build's directory, and the files
    ending in `suffix` in `loose` (its exported programs) may be evicted one by one."""

    root: Path
    current: Path
    loose: Path
    suffix: str
    max_bytes: int


_bound: Bound | None = None
_in_use: set[Path] = set()  # exported entries this process read or wrote: never evicted by it


def max_bytes() -> int | None:
    """The bound from $DSPARKJAX_CACHE_MAX_SIZE (binary units: 20G is 20 GiB), DEFAULT_MAX_BYTES when unset,
    None for no bound ("0", "off", "none", "unlimited"). A value it cannot read raises DsparkError naming it."""
    text = os.environ.get(MAX_SIZE_ENV)
    if text is None or not text.strip():
        return DEFAULT_MAX_BYTES
    value = text.strip().upper()
    if value in _NO_BOUND:
        return None
    size = _SIZE.fullmatch(value)
    if size is None:
        raise DsparkError(f"{MAX_SIZE_ENV}={text!r} is not a size: give bytes or a number with K, M, G or T "
                         f"(binary units, e.g. 20G), or 0/off for no bound")
    number = float(size.group(1))
    if number == 0:
        return None
    bytes_ = int(number * _UNITS[size.group(2)])
    if bytes_ < 1:
        raise DsparkError(f"{MAX_SIZE_ENV}={text!r} is under one byte; use 0 or off for no bound")
    return bytes_


def install(bound: Bound | None) -> None:
    """Hold the cache to `bound` from now on (None: leave it unbounded): give JAX the bound for its executables,
    stamp the running build as used now, and `sweep`."""
    global _bound
    _bound = bound
    jax.config.update("jax_compilation_cache_max_size", -1 if bound is None else bound.max_bytes)
    if bound is None:
        return
    os.utime(bound.current)  # the build's last use: the order in which builds are evicted
    _stamp_jax_entries(bound.current)
    sweep()


def use(path: Path) -> None:
    """Mark the exported entry at `path` used by this process: never evicted by it, and newest for the others."""
    _in_use.add(path)
    try:
        os.utime(path)
    except OSError:  # gone (another process evicted it) or read-only: its use here is unaffected
        pass


def sweep() -> None:
    """Evict other builds' directories and the running build's unused exported entries, least recently used
    first, until the tree fits the installed bound (no-op without one). Logs each eviction at INFO."""
    bound = _bound
    if bound is None or Path(jax.config.jax_compilation_cache_dir or "") != bound.current:
        return  # unbounded, or JAX's cache has moved since (the bound belongs to the tree it was installed for)
    total, candidates = 0, []  # candidates: (last use ns, path, bytes)
    for build in _listing(bound.root):
        if not (build.is_dir(follow_symlinks=False) and _BUILD_NAME.fullmatch(build.name)):
            continue
        size = _tree_bytes(Path(build.path))
        total += size
        if Path(build.path) != bound.current:
            candidates.append((_mtime_ns(build), Path(build.path), size))
    for entry in _listing(bound.loose):
        path = Path(entry.path)
        if entry.name.endswith(bound.suffix) and path not in _in_use and entry.is_file(follow_symlinks=False):
            candidates.append((_mtime_ns(entry), path, _size(entry)))
    for last_use, path, size in sorted(candidates):
        if total <= bound.max_bytes:
            break
        if _remove(path):
            total -= size
            logging.info("dsparkjax.cache_bound: evicted %s (%.1f MB, last used %s) to hold %s to %s=%d bytes",
                         path, size / 1e6, time.strftime("%Y-%m-%d %H:%M", time.localtime(last_use / 1e9)),
                         bound.root, MAX_SIZE_ENV, bound.max_bytes)


def _stamp_jax_entries(build: Path) -> None:
    """Give each JAX entry written while eviction was off (no `<key>-atime`) its mtime as last use: JAX's LRU
    reads one per entry and otherwise fails every eviction, and with it every later write, in this directory."""
    for entry in _listing(build):
        if entry.name.endswith(_JAX_ENTRY):
            atime = build / (entry.name.removesuffix(_JAX_ENTRY) + _JAX_ATIME)
            try:
                if not atime.exists():
                    atime.write_bytes(_mtime_ns(entry).to_bytes(8, "little"))
            except OSError as e:
                logging.warning("dsparkjax.cache_bound: cannot write %s (%s); JAX may fail to evict there", atime, e)


def _listing(folder: Path) -> list[os.DirEntry]:
    """The entries of `folder`, none when it does not exist (yet, or any more)."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _mtime_ns(entry: os.DirEntry) -> int:
    """`entry`'s mtime in ns; 0 (evicted first) when it has vanished."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except FileNotFoundError:
        return 0


def _size(entry: os.DirEntry) -> int:
    """`entry`'s size in bytes; 0 when it has vanished."""
    try:
        return entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0


def _tree_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (apparent sizes, as JAX counts them); vanished files count 0."""
    return sum(_size(entry) if not entry.is_dir(follow_symlinks=False) else _tree_bytes(Path(entry.path))
               for entry in _listing(folder))


def _remove(path: Path) -> bool:
    """Delete the file or directory tree at `path`: whether it is gone (another process may have been first)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)  # files another process removes meanwhile are no error
    else:
        with contextlib.suppress(OSError):  # a failure shows as the file still there
            path.unlink(missing_ok=True)
    if path.exists():
        logging.warning("dsparkjax.cache_bound: cannot evict %s", path)
        return False
    return True
