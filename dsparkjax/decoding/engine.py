"""A step-level decoding engine: sequences join and leave between steps (continuous batching).

`admit(prompt, sampling, seed)` puts a prompt into a free row with its own sampling parameters and seed;
`step()` prefills the newly admitted rows, queues one decode step of every running row and returns the
tokens each row emitted; `release(row)` frees a row. Sampling parameters are per-row arrays of the loop
state, so rows that sample differently (or greedily) run in the same compiled programs. The programs
are compiled once when the engine is built (`Decoder.compile`) and reused whatever the rows hold: a row's
tokens never depend on the others (exact mode: batch-invariant steps), so admitting a sequence mid-run gives the tokens it would
give alone.

Step k + 1 is queued before step k is read back, so the device never waits for the host; a row released
after step k has had step k + 1 run for nothing. Speculative decoding reads each step back at once instead:
its next program width is the widest of the proposer's widths over the running rows.

A step that a running row has no room for (it could commit past max_len) is refused before anything changes,
naming the row: release it and step on. A step or prefill that raises part way (an out-of-vocabulary draft
read back after the device committed the step) leaves the device state ahead of what the host read, so the
engine refuses every later step: build a new one on its decoder.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax import validation
from dsparkjax.decoding.decoder import Decoder
from dsparkjax.decoding.program import StepOutcome
from dsparkjax.decoding.sampling import GREEDY, RowSampling, SamplingParams, check_seed
from dsparkjax.errors import ArgumentError, CapacityError, DsparkError, TokenIdError


@dataclasses.dataclass
class Emitted:
    """What one row emitted in one `step()` or `prefill()`."""

    tokens: list[int]  # accepted candidates, then the bonus token (or a prompt's first token)
    matched: int = 0  # candidates accepted
    offered: int = 0  # candidates verified
    steps: int = 0  # decode steps (0 for a prompt's first token)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # each token's (decoding/logprobs.py)


@dataclasses.dataclass
class _InFlight:
    """A queued decode step not yet read back."""

    outcome: StepOutcome
    widths: jax.Array
    tickets: dict[int, int]  # row -> admission ticket of the sequence it served
    width: int  # an upper bound of the tokens it commits per row (the widest program)


class Engine:
    """Rows of one `Decoder` that sequences are admitted to and released from between steps."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.loop = decoder.init()
        decoder.compile(self.loop)
        self._sampling = [GREEDY] * decoder.batch  # each row's parameters and seed, as the loop state holds them
        self._seeds = [0] * decoder.batch
        self._sampling_changed = False
        self._pending: dict[int, np.ndarray] = {}  # admitted, not yet prefilled
        self._running: dict[int, int] = {}  # row -> ticket, prefilled and decoding
        self._tickets = 0
        self._ticket_of: dict[int, int] = {}
        self._lengths = np.zeros(decoder.batch, np.int64)  # committed tokens per row, as last read back
        self._mask = np.zeros(decoder.batch, bool)  # the active mask the loop state holds
        self._in_flight: _InFlight | None = None
        self._queue_ahead = decoder.proposer is None  # a speculative step's width is read back first
        self._torn = False  # a step or prefill raised part way: the device may hold what the host never read

    @property
    def free_rows(self) -> list[int]:
        return [row for row in range(self.decoder.batch) if row not in self._ticket_of]

    def admit(self, prompt: Sequence[int] | np.ndarray, sampling: SamplingParams = GREEDY, seed: int = 0) -> int:
        """Put `prompt` (token ids) into a free row, prefilled at the next `step()` or `prefill()`; returns the row.

        sampling: how this sequence samples (greedy by default; sampling needs a decoder built with
        `sample=True`); seed: its seed in [0, 2**32): its sampled tokens depend on the seed, the prompt and
        the parameters only, not on the row or on the other sequences.
        """
        if not isinstance(sampling, SamplingParams):
            raise ArgumentError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        seed = check_seed(seed)
        if not sampling.greedy and not self.decoder.sample:
            raise ArgumentError(f"sampling: temperature {sampling.temperature} > 0, but this engine's decoder decodes "
                                "greedily (build it with sample=True)")
        free = self.free_rows
        if not free:
            raise CapacityError(f"no free row: all {self.decoder.batch} rows of the engine are in use")
        prompt = validation.token_ids(prompt, "prompt", 1)
        if prompt.size == 0:
            raise ArgumentError("prompt needs at least one token")
        self.decoder.target.check_tokens(prompt, "prompt")
        if prompt.size + self.decoder.max_step > self.decoder.max_len:
            raise CapacityError(f"a prompt of {prompt.size} tokens leaves no room in rows of max_len "
                                f"{self.decoder.max_len}")
        row = free[0]
        self._tickets += 1
        self._ticket_of[row] = self._tickets
        self._pending[row] = prompt
        if (sampling, seed) != (self._sampling[row], self._seeds[row]):
            self._sampling[row], self._seeds[row] = sampling, seed
            self._sampling_changed = True
        return row

    def release(self, row: int) -> None:
        """Free `row`; whatever is queued for it is dropped."""
        if row not in self._ticket_of:
            raise ArgumentError(f"row {row} is not in use")
        del self._ticket_of[row]
        self._pending.pop(row, None)
        self._running.pop(row, None)

    def prefill(self) -> dict[int, Emitted]:
        """Prefill the admitted rows (batched): row -> its first token."""
        with self._whole():
            return self._prefill()

    def step(self) -> dict[int, Emitted]:
        """Prefill new rows, queue a decode step of the running rows, and return what rows emitted since the
        last call (the step read back: the previous one when steps queue ahead).

        CapacityError, before anything changes, when a running row could be committed past max_len."""
        self._check_usable()
        self._check_room()
        with self._whole():
            emitted = self._prefill()
            queued = self._dispatch() if self._running else None
            if self._queue_ahead:
                queued, self._in_flight = self._in_flight, queued
            for row, out in self._read(queued).items():  # a row prefilled in this call emitted its first token before
                first = emitted.get(row)
                emitted[row] = out if first is None else dataclasses.replace(
                    out, tokens=first.tokens + out.tokens, logprobs=first.logprobs + out.logprobs)
            return emitted

    def _check_usable(self) -> None:
        """Refuse to go on after a step or prefill that raised part way (`_whole`)."""
        if self._torn:
            raise DsparkError("an earlier step() or prefill() of this engine raised part way, so its rows' device "
                              "state may be ahead of the tokens they emitted; build a new Engine on its decoder")

    @contextlib.contextmanager
    def _whole(self) -> Iterator[None]:
        """Run a change of the loop state and the host's bookkeeping that must not stop part way: if it raises,
        every later one is refused (the device may have committed tokens the caller never got)."""
        self._check_usable()
        self._torn = True
        yield
        self._torn = False

    def _check_room(self) -> None:
        """Refuse a step whose widest program could commit a running row past max_len. The width is chosen only
        after the prefill, which must not run for a refused step: it would emit first tokens never returned."""
        widest = max(self.decoder.widths)
        full = [row for row in self._running if self._lengths[row] + self._ahead + widest > self.decoder.max_len]
        if full:
            raise CapacityError(f"no room for a step of up to {widest} rows in running rows {full}: after up to "
                                f"{int(self._lengths[full].max()) + self._ahead} committed tokens it passes the "
                                f"decode state's max_len {self.decoder.max_len}; release them")

    @property
    def _ahead(self) -> int:
        """An upper bound of the tokens the queued, unread step commits per row."""
        return self._in_flight.width if self._in_flight is not None else 0

    def _prefill(self) -> dict[int, Emitted]:
        if not self._pending:
            return {}
        if self._sampling_changed:  # new arrays only when an admission changed a row's parameters
            self.loop = self.loop.replace(sampling=RowSampling.of(self._sampling, self._seeds))
            self._sampling_changed = False
        self.loop, first = self.decoder.prefill(self.loop, self._pending)
        for row, prompt in self._pending.items():
            self._lengths[row] = len(prompt)
            self._running[row] = self._ticket_of[row]
        self._pending = {}
        return {row: Emitted([token], logprobs=[logprob]) for row, (token, logprob) in first.items()}

    def _dispatch(self) -> _InFlight:
        running = np.zeros(self.decoder.batch, bool)
        running[list(self._running)] = True
        if (running != self._mask).any():  # a new mask only when rows changed: the same buffer otherwise
            self._mask = running
            self.loop = self.loop.replace(active=jnp.asarray(running))
        self.loop, outcome, widths = self.decoder.step(self.loop, running, self._lengths + self._ahead)
        return _InFlight(outcome, widths, dict(self._running), max(self.decoder.widths))

    def _read(self, queued: _InFlight | None) -> dict[int, Emitted]:
        if queued is None:
            return {}
        outcome, widths = jax.device_get((queued.outcome, queued.widths))
        if outcome.bad != -1:  # hash layers index tid2eid by token: an out-of-range draft must never be emitted
            target = self.decoder.target
            raise TokenIdError(f"the proposer drafted token id {int(outcome.bad)}, outside the vocabulary and hash "
                               f"tables [0, {target.config.vocab_size}) of {target.path}")
        emitted = {}
        for row, ticket in queued.tickets.items():
            if self._running.get(row) != ticket:  # released (and maybe re-admitted) since it was queued
                continue
            matched = int(outcome.matched[row])
            self._lengths[row] += matched + 1
            emitted[row] = Emitted([*map(int, outcome.candidates[row, :matched]), int(outcome.bonus[row])],
                                   matched, int(widths[row]) - 1, 1, outcome.logprobs[row, : matched + 1].tolist())
        return emitted
