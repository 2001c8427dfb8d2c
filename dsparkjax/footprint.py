"""Device memory accounting: what weights and decode states hold, what a decode step reads, and whether a
model fits the device before anything is allocated.

Sizes come from shapes alone (a loader run on a `ShapeSource`, `jax.eval_shape` of a state), so a model that
cannot fit is refused with the numbers before its first byte is copied, rather than by XLA's
RESOURCE_EXHAUSTED halfway through a load.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dsparkjax.config import DRAFTER_ARCH, TARGET_ARCH, DrafterConfig, TargetConfig
from dsparkjax.errors import DeviceMemoryError, MemoryBudgetError
from dsparkjax.ggufio.reader import TensorInfo
from dsparkjax.model.params import layer_blocks
from dsparkjax.model.state import init_state
from dsparkjax.runtime import MEM_FRACTION

GB = 1e9
JAX_DEFAULT_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION when unset (JAX's GPU memory docs)
# Left free after weights and states for what a step allocates while it runs (activations, dense copies of
# packed matrices at many rows, logits); a step at batch 32 of DS4 needs a few hundred MB of it.
WORKSPACE_BYTES = 2 << 30


def tree_bytes(tree: Any) -> int:
    """Bytes held by the arrays (or ShapeDtypeStructs) of a pytree: packed bytes for packed weights."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes(cfg: TargetConfig, batch: int, max_len: int, max_step: int, dtype: Any) -> int:
    """Bytes of `init_state(cfg, batch, max_len, max_step, dtype)`, from shapes alone."""
    return tree_bytes(jax.eval_shape(lambda: init_state(cfg, batch, max_len, max_step, dtype)))


def host_available_bytes() -> int:
    """Memory this process can still get from the host: MemAvailable of /proc/meminfo (else the physical
    memory), and no more than its address-space limit (RLIMIT_AS) leaves beside what it has mapped."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            available = min(available, max(limit - mapped, 0))
    except OSError:
        pass
    return available


def available_bytes() -> tuple[int, str]:
    """(bytes, where): free memory of the default device's JAX pool, or of the host where JAX reports none."""
    mem = device_memory()
    if mem is not None:
        return mem.free, f"are free on the {mem.device}"
    return host_available_bytes(), "are available on the host"


def check_state_budget(cfg: TargetConfig, batch: int, max_len: int, max_step: int, dtype: Any, source: str) -> None:
    """MemoryBudgetError unless `init_state(cfg, batch, max_len, max_step, dtype)` fits the free memory, naming
    what makes it large: the window ring (`attention.sliding_window` of `source`) or the context (`max_len`
    compressed entries per sequence). Sized from shapes alone, so a state of terabytes is refused at once."""
    needed = state_bytes(cfg, batch, max_len, max_step, dtype)
    available, where = available_bytes()
    if needed <= available:
        return
    rings = state_bytes(cfg, batch, 1, max_step, dtype)  # max_len 1: the rings and one compressed entry
    if 2 * rings >= needed:
        key = (f"{TARGET_ARCH}.attention.sliding_window = {cfg.sliding_window} (the window ring of "
               f"{cfg.num_layers} layers, batch {batch})")
    else:
        key = f"max_len = {max_len} (the compressed context of {cfg.num_layers} layers, batch {batch})"
    raise MemoryBudgetError(source, key, needed, available, where)


def check_drafter_budget(cfg: DrafterConfig, source: str) -> None:
    """MemoryBudgetError unless the drafter's smallest state (one sequence, one-token steps, float32: its context
    rings of `attention.sliding_window` rows per stage) fits the free memory."""
    from dsparkjax.model.drafter import init_drafter_state  # the drafter model imports the loaders

    needed = tree_bytes(jax.eval_shape(lambda: init_drafter_state(cfg, 1, 1, jnp.float32)))
    available, where = available_bytes()
    if needed > available:
        key = (f"{DRAFTER_ARCH}.attention.sliding_window = {cfg.sliding_window} (the context ring of "
               f"{cfg.num_stages} stages)")
        raise MemoryBudgetError(source, key, needed, available, where)


def step_weight_bytes(params: Any, cfg: TargetConfig) -> int:
    """Weight bytes one decode step of one token reads (batch 1, width 1): every weight of the target but
    the embedding table (one row of it) and the routed experts the token did not select (`n_active_experts`
    of `n_routed_experts` per layer: all three of an expert's matrices). `params` is a TargetParams of arrays
    or of ShapeDtypeStructs. The decode state's reads (≤ 0.4% of this up to 64k tokens, perf_anchors.md
    §2.4) are not counted."""
    experts = sum(tree_bytes((b.moe.gate_up, b.moe.down)) for b in layer_blocks(params))
    embed = tree_bytes(params.embed)
    selected = experts * cfg.n_active_experts // cfg.n_routed_experts
    return tree_bytes(params) - embed + embed // cfg.vocab_size - experts + selected


def stored_step_weight_bytes(tensors: Mapping[str, TensorInfo], cfg: TargetConfig) -> int:
    """`step_weight_bytes` counted on a target file's tensors as stored (their GGUF bytes): what a step would read
    if every weight stayed in its file format (the loader holds the HC, router and compressor weights, F16 in
    the published files, as float32)."""
    total = sum(info.nbytes for info in tensors.values())
    experts = sum(info.nbytes for name, info in tensors.items() if "_exps." in name)
    embed = tensors["token_embd.weight"].nbytes
    return total - embed + embed // cfg.vocab_size - experts + experts * cfg.n_active_experts // cfg.n_routed_experts


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as JAX's allocator sees it, in bytes."""

    device: str
    limit: int  # what JAX may use (its pool: XLA_PYTHON_CLIENT_MEM_FRACTION of the device)
    in_use: int
    peak: int

    @property
    def free(self) -> int:
        return self.limit - self.in_use


def device_memory(device: jax.Device | None = None) -> DeviceMemory | None:
    """The default (or given) device's memory, or None where JAX does not report it (the CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return DeviceMemory(device.device_kind, int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)),
                        int(stats.get("peak_bytes_in_use", 0)))


def mem_fraction() -> float:
    """The fraction of each GPU JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION, or JAX's default)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION))
    except ValueError:
        return JAX_DEFAULT_MEM_FRACTION


def check_fits(nbytes: int, what: str, *, reserve: int = WORKSPACE_BYTES) -> None:
    """DeviceMemoryError unless `nbytes` more fit the default device beside what it holds, with `reserve`
    left for running steps. Devices that report no memory limit (the CPU) are not checked.

    The message names what did not fit, the bytes it needs, the device's free and total JAX memory and,
    when JAX was given less than dsparkjax.runtime's fraction of the device, how to give it more.
    """
    mem = device_memory()
    if mem is None or nbytes + reserve <= mem.free:
        return
    fraction = mem_fraction()
    message = (f"{what} needs {nbytes / GB:.1f} GB of device memory (and {reserve / GB:.1f} GB to run steps), but "
               f"the {mem.device} has {mem.free / GB:.1f} GB free of the {mem.limit / GB:.1f} GB JAX may use")
    if fraction < MEM_FRACTION:
        larger = mem.limit / fraction * MEM_FRACTION
        message += (f". JAX took {fraction:.0%} of the device when it started (XLA_PYTHON_CLIENT_MEM_FRACTION); "
                    f"with {MEM_FRACTION:.0%} it may use about {larger / GB:.1f} GB: call "
                    f"dsparkjax.runtime.configure() before JAX first touches the device, or set "
                    f"XLA_PYTHON_CLIENT_MEM_FRACTION={MEM_FRACTION} in the environment")
    raise DeviceMemoryError(message)
