"""What the speculative loop needs from a drafter, and the DSpark drafter loaded from its GGUF.

The loop talks to a `Proposer`: it absorbs the target's captured features of verified rows, and proposes
`block_size` candidates after each seed, greedily (`propose`) or, when the loop samples, drawn with the
sequence's keyed noise from a distribution it reports (`propose_sampled`, decoding/sampling.py). `Drafter` is the DSpark implementation; tests plug in others (an
oracle that knows the target's greedy continuation) through the same protocol.

Every call names its kernel policy (`invariant`, static): batch invariant where the drafts decide the output
(lossless mode samples against their distribution), XLA's order where they only decide how many candidates are
accepted (exact and fast modes), which is cheaper (docs/decoding.md#the-drafters-policy).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from dsparkjax import validation
from dsparkjax.aot import AotFunction
from dsparkjax.config import DrafterConfig
from dsparkjax.decoding.sampling import RowSampling
from dsparkjax.decoding.width import thresholds_from_metadata
from dsparkjax.ggufio.contract import open_drafter
from dsparkjax.kernels.policy import KernelPolicy
from dsparkjax.model.drafter import DrafterModel, DrafterState, init_drafter_state
from dsparkjax.model.params import DrafterParams, load_drafter_params
from dsparkjax.model.sources import LOAD_WORKERS, load_streamed
from dsparkjax.target_api import Target


class Proposer(Protocol):
    """A source of draft candidates for the speculative loop."""

    block_size: int  # candidates per proposal
    capture_layers: tuple[int, ...]  # target layers whose features it reads
    has_confidence: bool  # whether confidences are meaningful (else the width policy uses the EWMA)
    width_thresholds: tuple[float, ...] | None  # survival thresholds fitted for it (width.py), or None

    def init_state(self, batch: int, max_step: int) -> Any:
        """Empty proposer state for `batch` sequences and absorbed steps of up to `max_step` rows."""

    def precompile(self, state: Any, widths: tuple[int, ...],
                   sampled: tuple[RowSampling, int, bool] | None = None, *, invariant: bool) -> None:
        """Compile ahead of time whatever `absorb` (for these row counts) and `propose` will run under the
        `invariant` or XLA's policy; with `sampled` (rows, purpose, with_logits) `propose_sampled` instead of
        `propose`."""

    def absorb(self, state: Any, features: jax.Array, positions: jax.Array, *, invariant: bool) -> Any:
        """Take the target features `[B, C, n_capture, D]` of rows at positions `[B, C]`; `invariant`: each row
        computed in an order of its own (`KernelPolicy.invariant`), else in XLA's."""

    def propose(self, state: Any, seeds: jax.Array, seed_pos: jax.Array, *, invariant: bool
                ) -> tuple[jax.Array, jax.Array]:
        """Candidates int32 `[B, block_size]` and confidences float32 `[B, block_size]` after seeds `[B]`."""

    def propose_sampled(self, state: Any, seeds: jax.Array, seed_pos: jax.Array, rows: RowSampling, purpose: int,
                        with_logits: bool, *, invariant: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Sampled candidates, their confidences, and with `with_logits` (static; the lossless rule's) the
        logits float32 `[B, block_size, V]` each candidate was drawn from (softmax of them is exactly the
        distribution sampled: the lossless rule's q), else None. Candidate i predicts position
        seed_pos + i + 1 and uses the keyed noise of that position and `purpose`."""


@functools.lru_cache(maxsize=None)
def _compiled(cfg: DrafterConfig, simulate_qat: bool, policy: KernelPolicy
              ) -> tuple[AotFunction, AotFunction, AotFunction]:
    model = DrafterModel(cfg, simulate_qat, policy)
    xla = policy.compiler_options
    name = f"{cfg!r} {simulate_qat!r} {policy!r}"  # what the drafter's programs compute, for the exported cache
    return (AotFunction(model.absorb, donate_argnums=(1,), compiler_options=xla, cache_name=f"absorb {name}"),
            AotFunction(model.propose, compiler_options=xla, cache_name=f"propose {name}"),
            AotFunction(model.propose_sampled, static_argnums=(7, 8), compiler_options=xla,
                        cache_name=f"propose_sampled {name}"))


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A loaded DSpark drafter, bound to the target whose embedding and LM head it shares."""

    path: str
    config: DrafterConfig
    params: DrafterParams
    target: Target
    width_thresholds: tuple[float, ...] | None = None  # fitted on its pair (`SURVIVAL_THRESHOLDS_KEY`), if any

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layer_ids

    @property
    def has_confidence(self) -> bool:
        return self.params.confidence_w is not None

    def init_state(self, batch: int, max_step: int) -> DrafterState:
        return init_drafter_state(self.config, batch, max_step, self.target.dtype)

    def precompile(self, state: DrafterState, widths: tuple[int, ...],
                   sampled: tuple[RowSampling, int, bool] | None = None, *, invariant: bool) -> None:
        absorb, propose, propose_sampled = self._programs(invariant)
        batch, dim = state.last_position.shape[0], self.config.hidden_size
        n_cap = len(self.capture_layers)
        for width in widths:
            absorb.compile(self.params, state, jax.ShapeDtypeStruct((batch, width, n_cap, dim), jnp.float32),
                           jax.ShapeDtypeStruct((batch, width), jnp.int32))
        vector = jax.ShapeDtypeStruct((batch,), jnp.int32)
        args = (self.params, self.target.params.embed, self.target.params.head, state, vector, vector)
        if sampled is None:
            propose.compile(*args)
        else:
            propose_sampled.compile(*args, *sampled)

    def absorb(self, state: DrafterState, features: jax.Array, positions: jax.Array, *, invariant: bool
               ) -> DrafterState:
        return self._programs(invariant)[0](self.params, state, features, positions)

    def propose(self, state: DrafterState, seeds: jax.Array, seed_pos: jax.Array, *, invariant: bool
                ) -> tuple[jax.Array, jax.Array]:
        return self._programs(invariant)[1](self.params, self.target.params.embed, self.target.params.head, state,
                                            seeds, seed_pos)

    def propose_sampled(self, state: DrafterState, seeds: jax.Array, seed_pos: jax.Array, rows: RowSampling,
                        purpose: int, with_logits: bool, *, invariant: bool
                        ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        return self._programs(invariant)[2](self.params, self.target.params.embed, self.target.params.head, state,
                                            seeds, seed_pos, rows, purpose, with_logits)

    def policy(self, invariant: bool) -> KernelPolicy:
        """The kernel routing of the drafter's programs: the target's batch-invariant policy (where it can be,
        `Target.invariant`) or its XLA-ordered one, the routing of the target's own steps in those modes."""
        return self.target.options(invariant=invariant).policy

    def _programs(self, invariant: bool) -> tuple[AotFunction, AotFunction, AotFunction]:
        return _compiled(self.config, self.target.simulate_qat, self.policy(invariant))


def load_drafter(path: str, target: Target, *, progress: bool = False, load_workers: int = LOAD_WORKERS) -> Drafter:
    """Open a `deepseek4-dflash-draft` GGUF, check its contract and its fit to `target`, load its weights
    (streamed to the device as the target's, `load_target`, `load_workers` threads ahead of the loader) and the
    width thresholds fitted for it, if any."""
    validation.target(target)
    file, cfg = open_drafter(path, target.config)
    thresholds = thresholds_from_metadata(file.metadata, cfg.block_size, file.path)
    pack = None if target.kernels == "dequantize" else target.kernels
    params = load_streamed(file, lambda source: load_drafter_params(source, cfg, jnp.dtype(target.dtype), pack),
                           progress=progress, workers=load_workers)
    return Drafter(file.path, cfg, params, target, thresholds)
