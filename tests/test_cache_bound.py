"""The compilation cache's size bound (`dsparkjax.cache_bound`): the knob's values, least-recently-used eviction of
old builds and exported programs that never touches the running build's compiled programs or what this process
uses, and JAX's own eviction of its executables in our layout."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from dsparkjax import cache_bound, exported, runtime
from dsparkjax.errors import DsparkError

MiB = 1 << 20
SLACK = 4096  # the 8-byte last-use files install writes for JAX's entries


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No cache configured and no bound installed before the test; JAX's cache options restored after it."""
    previous = (jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size,
                jax.config.jax_persistent_cache_min_compile_time_secs)
    monkeypatch.setattr(cache_bound, "_bound", None)
    monkeypatch.setattr(cache_bound, "_in_use", set())
    for name in (cache_bound.MAX_SIZE_ENV, runtime.CACHE_ENV):
        monkeypatch.delenv(name, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_compilation_cache_max_size", previous[1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[2])
        compilation_cache.reset_cache()


def put(path: Path, size: int, age_s: float) -> Path:
    """A file of `size` bytes at `path` last modified `age_s` seconds ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return age(path, age_s)


def age(path: Path, age_s: float) -> Path:
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def tree_bytes(root: Path) -> int:
    """What the bound counts: files under the build directories of `root`."""
    return sum(p.stat().st_size for build in root.iterdir() if build.name != "notes" for p in build.rglob("*")
               if p.is_file())


@pytest.mark.parametrize("text, expected", [
    (None, cache_bound.DEFAULT_MAX_BYTES), ("", cache_bound.DEFAULT_MAX_BYTES), ("123", 123), ("20G", 20 << 30),
    ("500m", 500 << 20), ("1.5GiB", 3 << 29), ("2 TB", 2 << 40), ("0", None), ("0G", None), ("off", None),
    ("Unlimited", None), ("none", None)])
def test_the_knob_reads_sizes_and_off(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv(cache_bound.MAX_SIZE_ENV, raising=False)
    else:
        monkeypatch.setenv(cache_bound.MAX_SIZE_ENV, text)
    assert cache_bound.max_bytes() == expected


@pytest.mark.parametrize("text", ["lots", "-5G", "20X", "1e9", "0.1"])
def test_a_bad_knob_value_stops_start_up_naming_the_variable(monkeypatch, tmp_path, isolated, text):
    monkeypatch.setenv(cache_bound.MAX_SIZE_ENV, text)
    monkeypatch.setenv("DSPARKJAX_CACHE", str(tmp_path))
    with pytest.raises(DsparkError, match=f"{cache_bound.MAX_SIZE_ENV}={text!r}"):
        runtime.enable_compilation_cache()
    assert not any(tmp_path.iterdir()) and jax.config.jax_compilation_cache_dir is None


def test_eviction_holds_the_bound_oldest_first_and_keeps_what_is_in_use(tmp_path, caplog, isolated):
    root, hour = tmp_path / "xla", 3600.0
    old_build = age(put(root / "0000000000000001" / "k-cache", 3 * MiB, 0).parent, 3 * hour)
    new_build = age(put(root / "0000000000000002" / "k-cache", 3 * MiB, 0).parent, hour)
    notes = put(root / "notes" / "mine.txt", 5 * MiB, 10 * hour)  # not a build: never counted nor touched
    current = root / "00000000000000cc"
    compiled = put(current / "k-cache", 2 * MiB, 5 * hour)  # JAX's to evict, not ours, however old
    loose = current / exported.SUBDIR
    stale = put(loose / ("stale" + exported.SUFFIX), MiB, 4 * hour)
    used = put(loose / ("used" + exported.SUFFIX), MiB, 0)
    cache_bound.use(used)
    age(used, 6 * hour)  # the oldest of all, but this process uses it
    fresh = put(loose / ("fresh" + exported.SUFFIX), MiB, 600)
    jax.config.update("jax_compilation_cache_dir", str(current))
    caplog.set_level(logging.INFO)
    cache_bound.install(cache_bound.Bound(root, current, loose, exported.SUFFIX, 7 * MiB + SLACK))

    assert not stale.exists() and not old_build.exists()
    assert all(p.exists() for p in (new_build, fresh, used, compiled, notes))
    assert tree_bytes(root) <= 7 * MiB + SLACK
    evicted = [r.getMessage().split()[2] for r in caplog.records if "cache_bound: evicted" in r.getMessage()]
    assert evicted == [str(stale), str(old_build)]  # least recently used first
    assert jax.config.jax_compilation_cache_max_size == 7 * MiB + SLACK  # JAX bounds its own entries

    cache_bound.install(cache_bound.Bound(root, current, loose, exported.SUFFIX, 1))
    assert not new_build.exists() and not fresh.exists()
    assert compiled.exists() and used.exists() and notes.exists()  # over the bound, but not ours to evict


def test_a_file_another_process_deletes_first_is_skipped(tmp_path, isolated, monkeypatch):
    root = tmp_path / "xla"
    builds = [age(put(root / f"000000000000000{i}" / "k-cache", MiB, 0).parent, 3600.0 - i) for i in range(3)]
    current = root / "00000000000000cc"
    current.mkdir()
    remove = cache_bound._remove

    def raced(path: Path) -> bool:
        shutil.rmtree(path)  # another process's sweep got there between this one's listing and its removal
        return remove(path)

    monkeypatch.setattr(cache_bound, "_remove", raced)
    jax.config.update("jax_compilation_cache_dir", str(current))
    cache_bound.install(cache_bound.Bound(root, current, current / exported.SUBDIR, exported.SUFFIX, MiB))
    assert [b.exists() for b in builds] == [False, False, True]


def test_start_up_evicts_old_builds_and_jax_evicts_its_own_entries(tmp_path, monkeypatch, isolated):
    """configure's bound reaches JAX: an entry written while unbounded is evicted, least recently used first, when
    a later start writes past the bound (JAX's LRU needs the last-use stamp install gives such entries)."""
    monkeypatch.setenv("DSPARKJAX_CACHE", str(tmp_path))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # configure keeps JAX's own setting:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every program is written
    old_build = put(tmp_path / "xla" / "0000000000000001" / "k-cache", 4 * MiB, 0).parent
    monkeypatch.setenv(cache_bound.MAX_SIZE_ENV, "off")
    current = Path(runtime.enable_compilation_cache())
    assert old_build.exists() and jax.config.jax_compilation_cache_max_size == -1
    jax.jit(lambda x: x * 2.0 + 1.0)(np.arange(5.0)).block_until_ready()
    (first,) = current.glob("*-cache")
    assert not list(current.glob("*-atime"))  # JAX's unbounded layout: no last-use stamps

    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(cache_bound.MAX_SIZE_ENV, str(first.stat().st_size * 3 // 2))
    assert runtime.enable_compilation_cache() == str(current)
    assert not old_build.exists()
    jax.jit(lambda x: x * 3.0 - 1.0)(np.arange(5.0)).block_until_ready()
    assert not first.exists() and len(list(current.glob("*-cache"))) == 1
