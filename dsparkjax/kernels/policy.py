"""Kernel routing as configuration: which kernel a traced matmul or HC mix takes.

A `KernelPolicy` is frozen and hashable and lives in the target's static step options (`StepOptions.policy`)
and in the drafter's compiled programs' key, so two policies give two programs and no environment variable
changes a traced one. The model's methods trace under their policy (`routed`); `dsparkjax.model.weights`
reads it (`active`) where it picks the dense-copy route and the GPU's tensor-core mode. Which backend a packed
matmul runs on ("ffi" or "reference") is the weight's own static field (`PackedWeight.backend`, fixed at
load), so it is in the jit key too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, Literal

from dsparkjax.errors import DsparkError

MmaMode = Literal["off", "auto", "force"]
# The `mma` attribute's values, custom_calls/ffi_common.h's MmaMode.
MMA_CODES: dict[str, int] = {"off": 0, "auto": 1, "force": 2}


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """How a step routes its packed matmuls and HC mixes (thresholds' measurements: docs/kernels.md#tuning-tables).

    hc_backend: None computes the HC mixes with the jnp reference (`model/hc.py`), "ffi" with the mHC custom call.
    indexer_backend: the CSA indexer's top-k: "reference" scores every entry the state holds (jnp), "ffi" only
      each row's visible entries (the indexer_topk custom call: cost grows with length, not capacity).
    gemm_min_rows: from this many rows per call, a packed non-expert weight on the "ffi" backend is multiplied
      through a dense copy on XLA's GEMM instead of the matvec kernels; 0 keeps the kernels always.
    gemm_min_rows_large: the same threshold for weights of at least `large_weight_bytes` packed bytes.
    mma: the GPU's tensor-core kernel for calls of several tokens: "auto" where it is faster (custom_calls/
      tuning.h), "off" never (the matvec), "force" every call it can take (the tests' route onto small shapes).
      The results are the same bits in every mode.
    invariant: every row of a step is computed in an order that does not depend on the other rows or on their
      number (issue 42): dense matrices, norms, long sums and attention products go through the row-invariant
      custom calls and short sums are fixed add trees (`kernels/rowwise.py`, `model/reduce.py`), packed
      weights never take the dense copy, and the HC mixes and
      the indexer run on their custom calls. Needs the FFI plugin; not differentiable.
    """

    hc_backend: Literal["ffi"] | None = None
    indexer_backend: Literal["reference", "ffi"] = "reference"
    gemm_min_rows: int = 128  # below the crossover the benchmark model's matrices put near 150 rows
    gemm_min_rows_large: int = 32  # DS4's large projections and head: the copy wins from 32 rows in its step
    large_weight_bytes: int = 16 << 20
    mma: MmaMode = "auto"
    invariant: bool = False

    def __post_init__(self) -> None:
        if self.hc_backend not in (None, "ffi"):
            raise DsparkError(f"KernelPolicy.hc_backend must be None or 'ffi', got {self.hc_backend!r}")
        if self.indexer_backend not in ("reference", "ffi"):
            raise DsparkError(f"KernelPolicy.indexer_backend must be 'reference' or 'ffi', got {self.indexer_backend!r}")
        if self.invariant and (self.hc_backend != "ffi" or self.indexer_backend != "ffi"):
            raise DsparkError("KernelPolicy.invariant needs hc_backend='ffi' and indexer_backend='ffi'")
        if self.mma not in MMA_CODES:
            raise DsparkError(f"KernelPolicy.mma must be one of {sorted(MMA_CODES)}, got {self.mma!r}")
        for name in ("gemm_min_rows", "gemm_min_rows_large", "large_weight_bytes"):
            if getattr(self, name) < 0:
                raise DsparkError(f"KernelPolicy.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def compiler_options(self) -> dict[str, str] | None:
        """XLA options of the programs traced under this policy: an invariant one turns off the CPU's library
        fusions (YNNPACK, XNNPACK, oneDNN), which take elementwise and reduction fusions from a size on and
        compute exp & co. with their own kernels, so a row's bits would change with the row count."""
        if not self.invariant:
            return None
        return {f"xla_cpu_experimental_{lib}_fusion_type": "" for lib in ("ynn", "xnn", "onednn")}

    @property
    def mma_code(self) -> int:
        """The `mma` FFI attribute's value for this policy."""
        return MMA_CODES[self.mma]


_ACTIVE: contextvars.ContextVar[KernelPolicy] = contextvars.ContextVar("dsparkjax_kernel_policy",
                                                                      default=KernelPolicy())


def active() -> KernelPolicy:
    """The policy the current trace runs under (the default policy outside `use`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def use(policy: KernelPolicy) -> Iterator[None]:
    """Trace the body under `policy`."""
    token = _ACTIVE.set(policy)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def routed(method: Callable[..., Any]) -> Callable[..., Any]:
    """A model method traced under its model's `policy` attribute (which the program's cache key holds)."""

    @functools.wraps(method)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        with use(self.policy):
            return method(self, *args, **kwargs)

    return traced
