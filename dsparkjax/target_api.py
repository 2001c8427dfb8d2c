"""The loaded target: `load_target` opens and checks a target GGUF and loads its weights into a `Target`.

Running it is decoding's job (`dsparkjax/decoding/`: `forward`, `generate`, the step programs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from dsparkjax.config import TargetConfig
from dsparkjax.errors import ArgumentError, TokenIdError
from dsparkjax import formats, validation
from dsparkjax.ggufio.contract import open_target
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.kernels.policy import KernelPolicy
from dsparkjax.model.layer_plan import LayerPlan
from dsparkjax.model.params import TargetParams, load_target_params, plan_of
from dsparkjax.model.sources import LOAD_WORKERS, load_streamed
from dsparkjax.model.target import StepOptions

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
KERNEL_CHOICES = ("auto", "dequantize", "ffi", "reference")  # load_target's `kernels`


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target model: its file, config, weights and numeric switches."""

    path: str
    config: TargetConfig
    params: TargetParams
    dtype: Any
    simulate_qat: bool
    tokenizer: Any  # dsparkjax.tokenizer.Tokenizer, or None when the file has no tokenizer
    kernels: str = "dequantize"  # how matrices run: "dequantize" (dense), "ffi" or "reference" (packed)
    policy: KernelPolicy = KernelPolicy()  # kernel routing; its HC backend follows `kernels` (options())

    @property
    def plan(self) -> LayerPlan:
        """The layer plan of the weights' layout (`load_target`'s scan_layers); decode states follow it."""
        return plan_of(self.params)

    @property
    def invariant(self) -> bool:
        """Whether this target's steps can be batch invariant: the FFI plugin is loaded and the matrices do not
        run on the kernels' jnp reference (`KernelPolicy.invariant`)."""
        from dsparkjax.kernels import ffi

        return self.kernels != "reference" and ffi.available()

    def options(self, capture_layers: tuple[int, ...] = (), invariant: bool = True) -> StepOptions:
        """The static step options. `invariant` (where the target can be, `self.invariant`) computes every row in
        an order of its own: what exact decoding runs. Otherwise the HC mixes and the indexer run on the FFI
        kernels exactly when the matrices do, and XLA picks the order of the other contractions."""
        if invariant and self.invariant:
            policy = dataclasses.replace(self.policy, hc_backend="ffi", indexer_backend="ffi", invariant=True)
        else:
            ffi = self.kernels == "ffi"
            policy = dataclasses.replace(self.policy, hc_backend="ffi" if ffi else None,
                                         indexer_backend="ffi" if ffi else "reference", invariant=False)
        return StepOptions(simulate_qat=self.simulate_qat, capture_layers=capture_layers, policy=policy)

    def check_tokens(self, tokens: np.ndarray, what: str = "token ids") -> None:
        """Reject ids outside the vocabulary (and so outside the hash-routing tables) before anything runs."""
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)]
            raise TokenIdError(f"{what}: id {int(bad.flat[0])} is outside the vocabulary and hash tables "
                               f"[0, {self.config.vocab_size}) of {self.path}")


def load_target(path: str, *, dtype: str = "float32", simulate_qat: bool = True, progress: bool = False,
                kernels: str = "auto", policy: KernelPolicy = KernelPolicy(), scan_layers: bool = False,
                load_workers: int = LOAD_WORKERS) -> Target:
    """Open a `deepseek4` GGUF, check its contract, and load its weights in `dtype` ("float32" or "bfloat16").

    The weights go from the file's memory map to the device tensor by tensor, with no host copy
    (`model/sources.py`; `progress`: a bar of bytes), once their size is checked against the device's free
    memory (DeviceMemoryError otherwise, saying how to make room).

    kernels: "dequantize" turns every weight into a dense array at load; "ffi" keeps quantized weights packed
    and multiplies them with the XLA FFI kernels (and runs the HC mixes there too); "reference" keeps them
    packed for the kernels' pure-jnp reference; "auto" is "ffi" when the plugin is loaded, else "reference",
    for files with quantized weights, and "dequantize" for float files.
    policy: the kernel routing every step of this target traces under (dense-copy thresholds, the GPU's
    tensor-core mode; `dsparkjax.kernels.policy`).
    scan_layers: layers of one structure share one scanned body (`model/layer_plan.py`): their weights are
    stacked and the step runs them under `lax.scan`, which compiles in a fraction of the unrolled step's time
    (issue 38) and gives the same bits.
    load_workers: threads that check and copy tensors ahead of the loader (`model/sources.py`); 1 loads one
    tensor at a time.
    """
    validation.choice(dtype, "dtype", tuple(DTYPES))
    validation.choice(kernels, "kernels", KERNEL_CHOICES)
    if not isinstance(policy, KernelPolicy):
        raise ArgumentError(f"policy must be a KernelPolicy (dsparkjax.kernels.policy), got {type(policy).__name__}")
    for name, flag in (("simulate_qat", simulate_qat), ("progress", progress), ("scan_layers", scan_layers)):
        validation.boolean(flag, name)
    file, cfg = open_target(path)
    kernels = _kernel_choice(kernels, file)
    pack = None if kernels == "dequantize" else kernels
    params = load_streamed(file, lambda source: load_target_params(source, cfg, DTYPES[dtype], pack,
                                                                   scan_layers=scan_layers),
                           progress=progress, workers=load_workers)
    tokenizer = None
    if "tokenizer.ggml.model" in file.metadata:
        from dsparkjax.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_metadata(file.metadata, file.path)
    return Target(file.path, cfg, params, DTYPES[dtype], simulate_qat, tokenizer, kernels, policy)


def _kernel_choice(kernels: str, file: GGUFFile) -> str:
    """Resolve "auto": packed kernels for files with quantized weights, dense weights otherwise."""
    from dsparkjax import kernels as kernel_ops

    if kernels == "ffi":
        kernel_ops.ffi.require()
    if kernels != "auto":
        return kernels
    quantized = any(formats.block_size(t.ggml_type) > 1 for t in file.tensors.values())
    return kernel_ops.default_backend() if quantized else "dequantize"
