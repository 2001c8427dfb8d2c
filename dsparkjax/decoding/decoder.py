"""The Decoder: one decoding configuration, its compiled programs, its prefill and its step.

A frozen description of a run (target, proposer, batch, state capacity, widths, verification), in the
spirit of gemma's `SamplerLoop`: it builds the initial `LoopState`, compiles every program the run can
dispatch ahead of time (`compile`), prefills prompts into rows (`prefill`, shared by `forward` and
`generate`) and runs one decode step (`step`). It holds no mutable state: the loop's values travel in the
`LoopState` it is given and returns. `Engine` (engine.py) drives it step by step.

Every verification mode runs plain decoding at width 1 and a speculative step at the widest width its
sequences' policy chose (one program per width, reading each step's widths back; `exactness.md`,
`spec_sampling.md`):
- "exact": the programs are batch invariant (`KernelPolicy.invariant`, issue 42): every row of a step is
  computed in an order of its own, whatever the width and the batch, so speculative output equals plain
  greedy output bit for bit; when sampling, a candidate is accepted iff it equals the target's keyed sample,
  so speculative output equals plain sampled output with the same seeds. Speculative decoding needs the FFI
  plugin (`Target.invariant`); plain decoding runs invariant steps where the target has them.
- "fast": XLA picks the order of the dense contractions and may take the dense-copy GEMM for packed weights
  at many rows per call (batched generation), which is faster there; output may differ on near-tied logits.
- "lossless": exact mode's batch-invariant programs, with the lossless rejection-sampling rule when sampling
  (the target's distribution, not plain sampling's tokens; more candidates accepted). Greedy rows are decoded
  as in exact mode.
The proposer runs batch invariant only where its drafts decide the output, the lossless rule's sampling rows
(`drafts_invariant`); elsewhere they decide only how many candidates are accepted, and it runs in XLA's order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax import footprint, validation
from dsparkjax.aot import AotFunction
from dsparkjax.decoding import sampling
from dsparkjax.decoding.program import LoopState, RowsOut, StepOutcome, decode_program, prefill_program
from dsparkjax.decoding.proposer import Proposer
from dsparkjax.decoding.sampling import RowSampling
from dsparkjax.decoding.width import WidthPolicy, policy_for
from dsparkjax.errors import DsparkError
from dsparkjax.kernels.ffi import BUILD_HINT
from dsparkjax.model.state import init_state
from dsparkjax.model.target import StepOptions
from dsparkjax.target_api import Target

DEFAULT_BLOCK = 5  # DSpark proposes 5 candidates: the state's rings are sized for 1 + block rows


@functools.lru_cache(maxsize=None)
def _width_fn(policy: WidthPolicy) -> AotFunction:
    return AotFunction(policy.choose)


@functools.partial(AotFunction, static_argnums=(1,))
def plain_proposal(seeds: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Plain decoding's stand-in for a proposal: seeds int32 `[B]` repeated to `[B, block]`, never verified
    (widths int32 `[B]` of 1; the width-1 program reads none of them). Programs wider than their verified rows
    (a benchmark's fixed width) get rows routed like real tokens: one constant token would send them all to the
    same experts."""
    return jnp.broadcast_to(seeds[:, None], (seeds.shape[0], block)), jnp.ones_like(seeds)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoding run's static configuration and its programs (see the module docstring)."""

    target: Target
    proposer: Proposer | None  # None: plain decoding
    batch: int  # rows
    max_len: int  # positions per row the decode state holds
    max_step: int  # the widest step (prefill chunk or decode width) the state's rings hold
    prefill_chunk: int
    block: int = DEFAULT_BLOCK  # candidates per proposal; a step verifies at most block + 1 rows
    verify: Literal["exact", "fast", "lossless"] = "exact"
    policy: WidthPolicy = WidthPolicy("fixed", fixed_q=1, max_q=1)
    sample: bool = False  # rows may sample (their RowSampling parameters); else every row is greedy
    capture_layers: tuple[int, ...] = ()  # target layers whose features the proposer reads

    @classmethod
    def for_prompts(cls, target: Target, drafter: Proposer | None, *, speculative: bool, lengths: list[int],
                    max_new_tokens: int, verify: Literal["exact", "fast", "lossless"],
                    width: int | str | WidthPolicy,
                    prefill_chunk: int, sample: bool) -> Decoder:
        """The decoder `generate` runs for prompts of `lengths` tokens, one row each. A plain run given a
        drafter still captures its features, so plain and speculative runs share the target programs."""
        proposer = drafter if speculative else None
        block = drafter.block_size if drafter is not None else DEFAULT_BLOCK
        max_step = max(prefill_chunk, block + 1)
        # Room for the prompt, the new tokens and two queued steps, rounded up to a power of two so that runs
        # of similar sizes reuse compiled programs.
        need = max(lengths) + max_new_tokens + max_step + block + 1
        policy = policy_for(width, proposer, block + 1)
        return cls(target, proposer, batch=len(lengths), max_len=1 << max(6, need.bit_length()), max_step=max_step,
                   prefill_chunk=prefill_chunk, block=block, verify=verify, policy=policy, sample=sample,
                   capture_layers=drafter.capture_layers if drafter is not None else ())

    def __post_init__(self) -> None:
        for field in ("batch", "max_len", "max_step", "prefill_chunk", "block"):  # the shapes of the state's arrays
            validation.positive_int(getattr(self, field), field)
        # Plain decoding has nothing to reproduce: it runs the target's own steps, invariant where they can be.
        if self.verify != "fast" and self.proposer is not None and not self.target.invariant:
            raise DsparkError(f"speculative verify={self.verify!r} needs batch-invariant steps, which run on the FFI "
                              f"kernels: "
                              f"{self.target.path} is loaded with kernels={self.target.kernels!r} and the plugin "
                              f"is {'loaded' if self.target.kernels == 'reference' else 'missing'}; load it with "
                              f"kernels='auto' or 'ffi' ({BUILD_HINT}), or pass verify='fast'")

    @property
    def lossless(self) -> bool:
        """Whether speculative steps use the lossless rule (sampling rows with a proposer, verify="lossless")."""
        return self.verify == "lossless" and self.sample and self.proposer is not None

    @property
    def drafts_invariant(self) -> bool:
        """Whether the proposer's programs are batch invariant: where the lossless rule samples against the
        drafts' distribution, so a sequence's tokens depend on the drafts' bits. Exact and fast modes emit the
        target's tokens whatever is drafted (the drafts move only the acceptance), so the proposer takes XLA's
        cheaper order there."""
        return self.lossless

    @property
    def draft_noise(self) -> int:
        """The noise purpose the proposer samples with: the target's own in exact and fast modes (the coupling
        that makes accepted candidates the plain run's tokens), an independent one in lossless mode."""
        return sampling.DRAFT if self.lossless else sampling.TARGET

    @property
    def widths(self) -> tuple[int, ...]:
        """The decode widths this decoder dispatches: plain decoding's 1; speculative decoding's 1..max_q, one
        per proposer width, or a fixed width policy's one width (compiling no program that never runs)."""
        if self.proposer is None:
            return (1,)
        widest = min(self.policy.max_q, self.block + 1)
        if self.policy.kind == "fixed":
            return (max(1, min(self.policy.fixed_q, widest)),)
        return tuple(range(1, widest + 1))

    def init(self) -> LoopState:
        """Empty rows: a fresh decode state and proposer state, no sequence active, every row greedy."""
        cfg, batch = self.target.config, self.batch
        footprint.check_state_budget(cfg, batch, self.max_len, self.max_step, self.target.dtype, self.target.path)
        return LoopState(
            state=init_state(cfg, batch, self.max_len, self.max_step, self.target.dtype, self.target.plan),
            proposer=self.proposer.init_state(batch, self.max_step) if self.proposer is not None else None,
            seeds=jnp.zeros((batch,), jnp.int32), ewma=jnp.full((batch,), self.policy.ewma_init, jnp.float32),
            sampling=RowSampling.greedy(batch), active=jnp.zeros((batch,), jnp.bool_))

    def compile(self, loop: LoopState) -> None:
        """Compile every program `prefill` and `step` can dispatch for `loop`'s shapes, before any runs."""
        params, batch = self.target.params, self.batch
        ints, flags = (jax.ShapeDtypeStruct((batch,), t) for t in (jnp.int32, jnp.bool_))
        self._prefill().compile(params, loop, tokens=jax.ShapeDtypeStruct((batch, self.prefill_chunk), jnp.int32),
                                valid=ints, restart=flags, ends=flags, ewma_init=jnp.float32(0),
                                sample=self.sample)
        drafts = jax.ShapeDtypeStruct((batch, self.block), jnp.int32)
        lossless = self._lossless_args(
            jax.ShapeDtypeStruct((batch, self.block, self.target.config.vocab_size), jnp.float32))
        for width in self.widths:
            self._decode().compile(params, loop, drafts=drafts, widths=ints, width=width,
                                   ewma_decay=self.policy.ewma_decay, sample=self.sample, **lossless)
        if self.proposer is None:
            plain_proposal.compile(ints, self.block)
        else:
            self.proposer.precompile(loop.proposer, tuple({self.prefill_chunk, *self.widths}),
                                     (loop.sampling, self.draft_noise, self.lossless) if self.sample else None,
                                     invariant=self.drafts_invariant)
            _width_fn(self.policy).compile(jax.ShapeDtypeStruct((batch, self.block), jnp.float32),
                                           jax.ShapeDtypeStruct((batch,), jnp.float32))

    def prefill(self, loop: LoopState, prompts: Mapping[int, np.ndarray],
                on_logits: Callable[[jax.Array, np.ndarray], None] | None = None
                ) -> tuple[LoopState, dict[int, tuple[int, float]]]:
        """Run `prompts` (row -> int token ids) from position 0 of their rows, in chunks through the target;
        the other rows commit nothing. The proposer absorbs every chunk's features.

        on_logits: called with each chunk's logits float32 `[B, C, V]` and its valid row counts int `[B]`.
        Returns (loop with each prompt row's seed set to its first token, row -> (first token, its logprob)).
        """
        lengths = np.zeros(self.batch, np.int64)
        for row, prompt in prompts.items():
            lengths[row] = len(prompt)
        done = np.zeros(self.batch, np.int64)
        restart = jnp.asarray(lengths > 0)
        ewma_init = jnp.float32(self.policy.ewma_init)
        first: dict[int, tuple[int, float]] = {}
        while (done < lengths).any():
            valid = np.clip(lengths - done, 0, self.prefill_chunk)
            tokens = np.zeros((self.batch, self.prefill_chunk), np.int32)
            for row, prompt in prompts.items():
                tokens[row, : valid[row]] = prompt[done[row] : done[row] + valid[row]]
            ends = (valid > 0) & (done + valid == lengths)
            loop, rows, logits, picked, logprob = self._prefill()(
                self.target.params, loop, tokens=jnp.asarray(tokens), valid=jnp.asarray(valid, jnp.int32),
                restart=restart, ends=jnp.asarray(ends), ewma_init=ewma_init, sample=self.sample)
            loop = self._absorb(loop, rows)
            if on_logits is not None:
                on_logits(logits, valid)
            if ends.any():
                picked, logprob = np.asarray(picked), np.asarray(logprob)
                first.update((int(row), (int(picked[row]), float(logprob[row]))) for row in np.flatnonzero(ends))
            restart = jnp.zeros_like(restart)
            done += valid
        return loop, first

    def step(self, loop: LoopState, running: np.ndarray, lengths: np.ndarray
             ) -> tuple[LoopState, StepOutcome, jax.Array]:
        """Queue one decode step of the active rows; returns (loop, outcome, widths int32 `[B]`) on the device.

        running: bool `[B]`, the rows the host still decodes (a speculative step's program width is the widest
        of their proposer widths, the one read back here); lengths: int `[B]`, an upper bound of
        their committed lengths, to refuse a step past the state's max_len.
        """
        draft_logits = None
        if self.proposer is not None:
            if self.sample:
                drafts, confidences, draft_logits = self.proposer.propose_sampled(
                    loop.proposer, loop.seeds, loop.state.length, loop.sampling, self.draft_noise, self.lossless,
                    invariant=self.drafts_invariant)
            else:
                drafts, confidences = self.proposer.propose(loop.proposer, loop.seeds, loop.state.length,
                                                             invariant=self.drafts_invariant)
            widths = _width_fn(self.policy)(confidences, loop.ewma)
            width = int(np.asarray(widths)[running].max())
        else:
            drafts, widths = plain_proposal(loop.seeds, self.block)
            width = 1
        loop.state.check_step(width, lengths[running])
        loop, rows, outcome = self._decode()(self.target.params, loop, drafts=drafts, widths=widths, width=width,
                                             ewma_decay=self.policy.ewma_decay, sample=self.sample,
                                             **self._lossless_args(draft_logits))
        return self._absorb(loop, rows), outcome, widths

    def _lossless_args(self, draft_logits: object) -> dict[str, object]:
        """The decode program's lossless-rule arguments: none unless this decoder uses the rule."""
        return dict(draft_logits=draft_logits, lossless=True) if self.lossless else {}

    def _absorb(self, loop: LoopState, rows: RowsOut) -> LoopState:
        if self.proposer is None:
            return loop
        absorbed = self.proposer.absorb(loop.proposer, rows.features, rows.positions, invariant=self.drafts_invariant)
        return loop.replace(proposer=absorbed)

    # The programs are looked up on every use (cached per config): the tests watch them by patching these.
    def _prefill(self) -> AotFunction:
        return prefill_program(self.target.config, self._options())

    def _decode(self) -> AotFunction:
        return decode_program(self.target.config, self._options())

    def _options(self) -> StepOptions:
        """The target's step options: batch invariant in exact and lossless modes."""
        return self.target.options(self.capture_layers, invariant=self.verify != "fast")
