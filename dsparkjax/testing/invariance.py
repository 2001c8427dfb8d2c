"""Batch-invariance checks: does row i of a step of width q and batch B carry plain decoding's bits?

The reference of a sequence is plain decoding: q = 1, B = 1 steps from its own state, each committed. A
width-q step of a batch of B sequences must give every row the reference's bits: its logits, its captured
features, and the state it leaves after committing the q rows. The drafter's proposal for a sequence must not
depend on the batch it is proposed in, and absorbing q verified rows at once must leave the context rows that
absorbing them one by one leaves. `check_target` and `check_drafter` compare bit patterns and return one
`Diff` per compared quantity, width and batch; `scripts/check_invariance.py` and the tests report them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dsparkjax.decoding.program import step_program
from dsparkjax.decoding.proposer import Drafter
from dsparkjax.kernels import policy as kernel_policy
from dsparkjax.model.drafter import DrafterModel, DrafterState
from dsparkjax.model.state import DecodeState, commit, init_state
from dsparkjax.target_api import Target

WIDTHS = (1, 2, 3, 4, 5, 6)
BATCHES = (1, 3, 8)


@dataclasses.dataclass(frozen=True)
class Diff:
    """How one compared quantity of one (width, batch) differs from its reference."""

    what: str  # "logits", "features", "state.layer2.comp_kv", "drafter.block_logits", ...
    width: int
    batch: int
    max_bits: int  # the most bits any value differs in (popcount of the XOR of the bit patterns)
    differing: int  # values that differ
    total: int  # values compared


def bit_differences(a: Any, b: Any) -> np.ndarray:
    """Per-element count of differing bits between two arrays of one float or int dtype (same shape)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{a.shape} with {b.dtype}{b.shape}")
    unsigned = np.dtype(f"uint{8 * a.dtype.itemsize}")
    x = np.bitwise_xor(np.ascontiguousarray(a).view(unsigned), np.ascontiguousarray(b).view(unsigned))
    return np.unpackbits(x.view(np.uint8)).reshape(*x.shape, -1).sum(-1) if x.size else np.zeros(x.shape, int)


def diff_of(what: str, width: int, batch: int, pairs: Iterable[tuple[Any, Any]]) -> Diff:
    """One Diff over every (value, reference) array pair."""
    bits = [bit_differences(a, b).ravel() for a, b in pairs]
    flat = np.concatenate(bits) if bits else np.zeros(0, int)
    return Diff(what, width, batch, int(flat.max(initial=0)), int(np.count_nonzero(flat)), int(flat.size))


def take_rows(tree: Any, rows: list[int]) -> Any:
    """The sequences `rows` of a batched state pytree (every leaf has the batch axis first), as new buffers."""
    index = jnp.asarray(rows, jnp.int32)
    return jax.tree.map(lambda leaf: jnp.take(leaf, index, axis=0), tree)


def _leaves(tree: Any) -> dict[str, np.ndarray]:
    """Named leaves of a state pytree: 'layer{i}.{buffer}' for a DecodeState, 'stage{i}' for a DrafterState."""
    if isinstance(tree, DecodeState):
        out = {"length": np.asarray(tree.length)}
        for i, cache in enumerate(tree.layers):
            for name in ("window", "comp_proj", "comp_kv", "index_proj", "index_keys"):
                if getattr(cache, name) is not None:
                    out[f"layer{i}.{name}"] = np.asarray(getattr(cache, name))
        return out
    return {f"stage{i}": np.asarray(kv) for i, kv in enumerate(tree.context_kv)}


@dataclasses.dataclass
class Setup:
    """Prefilled sequences to check from: one batched state and what its sequences decode next."""

    state: DecodeState  # B sequences, prefilled to `lengths`
    drafter_state: DrafterState | None  # the drafter's context of the same prefixes
    lengths: np.ndarray  # int [B], committed tokens
    tokens: np.ndarray  # int32 [B, max width], the rows each sequence steps next
    capture: tuple[int, ...]  # the target layers whose features the drafter reads


def prefilled(target: Target, drafter: Drafter | None, lengths: list[int], seed: int, chunk: int = 8) -> Setup:
    """Sequences of random tokens prefilled to `lengths` in chunks (the drafter absorbing every chunk).

    Pick lengths past the sliding window (ring wrap) and next to compressor boundaries, so the checked steps
    cover both.
    """
    cfg = target.config
    rng = np.random.default_rng(seed)
    batch, longest = len(lengths), max(lengths)
    max_step = max(chunk, max(WIDTHS))
    max_len = 1 << (longest + max_step + max(WIDTHS)).bit_length()
    prompts = rng.integers(0, cfg.vocab_size, (batch, longest)).astype(np.int32)
    capture = drafter.capture_layers if drafter is not None else ()
    step = step_program(cfg, target.options(capture))
    state = init_state(cfg, batch, max_len, max_step, target.dtype)
    dstate = drafter.init_state(batch, max_step) if drafter is not None else None
    lengths_np = np.asarray(lengths)
    done = np.zeros(batch, np.int64)
    while (done < lengths_np).any():
        valid = np.clip(lengths_np - done, 0, chunk)
        rows = np.zeros((batch, chunk), np.int32)
        for b in range(batch):
            rows[b, : valid[b]] = prompts[b, done[b] : done[b] + valid[b]]
        positions = jnp.asarray(done[:, None] + np.arange(chunk)[None, :], jnp.int32)
        _, features, state = step(target.params, state, jnp.asarray(rows))
        if drafter is not None:
            dstate = drafter.absorb(dstate, features, positions, invariant=True)
        state = commit(state, jnp.asarray(valid, jnp.int32))
        done += valid
    tokens = rng.integers(0, cfg.vocab_size, (batch, max(WIDTHS))).astype(np.int32)
    return Setup(state, dstate, lengths_np, tokens, capture)


def default_lengths(target: Target, count: int = 8) -> list[int]:
    """Prompt lengths that put the checked steps across ring wraps and compressor boundaries."""
    cfg = target.config
    ratios = sorted({m for m in cfg.compress_ratios if m > 1}) or [4]
    base = cfg.sliding_window + 1
    out = []
    for i in range(count):
        m = ratios[i % len(ratios)]
        start = -(-base // m) * m + m * (i // len(ratios))
        out.append(start - 1 - (i % 3))  # steps of up to 6 rows cross the boundary at start - 1
    return out


def check_target(target: Target, setup: Setup, *, widths: Iterable[int] = WIDTHS,
                 batches: Iterable[int] = BATCHES, seed: int = 0) -> list[Diff]:
    """Every row of width-q steps of B sequences against plain decoding of its sequence.

    Returns one Diff per (quantity, q, B): logits, features and each state buffer after committing the q rows.
    """
    n = setup.tokens.shape[0]
    step = step_program(target.config, target.options(setup.capture))
    widths = list(widths)
    reference = []  # per sequence: [(logits [V], features, state leaves after rows 0..i)]
    for s in range(n):
        state, rows = take_rows(setup.state, [s]), []
        for i in range(max(widths)):
            logits, features, state = step(target.params, state, jnp.asarray(setup.tokens[s : s + 1, i : i + 1]))
            state = commit(state, jnp.ones((1,), jnp.int32))
            rows.append((np.asarray(logits[0, 0]), np.asarray(features[0, 0]), _leaves(state)))
        reference.append(rows)
    rng = np.random.default_rng(seed)
    diffs = []
    for batch in batches:
        groups = _groups(rng, n, batch)
        for q in widths:
            got: dict[str, list[tuple[Any, Any]]] = {}
            for group in groups:
                state = take_rows(setup.state, group)
                logits, features, state = step(target.params, state, jnp.asarray(setup.tokens[group, :q]))
                state = commit(state, jnp.full((len(group),), q, jnp.int32))
                logits, features, leaves = np.asarray(logits), np.asarray(features), _leaves(state)
                for j, s in enumerate(group):
                    for i in range(q):
                        got.setdefault("logits", []).append((logits[j, i], reference[s][i][0]))
                        got.setdefault("features", []).append((features[j, i], reference[s][i][1]))
                    for name, leaf in leaves.items():
                        got.setdefault(f"state.{name}", []).append((leaf[j], reference[s][q - 1][2][name][0]))
            diffs += [diff_of(what, q, batch, pairs) for what, pairs in got.items()]
    return diffs


def check_drafter(drafter: Drafter, setup: Setup, *, widths: Iterable[int] = WIDTHS,
                  batches: Iterable[int] = BATCHES, seed: int = 0) -> list[Diff]:
    """The drafter's proposal per batch size, and absorbing q rows at once, against B = 1 and one row at a time.

    The proposal compares the block's logits before the Markov bias, the candidates and the confidences (the
    batch axis is its only variable width); absorbing compares every stage's context rows. Both run under the
    drafter's batch-invariant policy, lossless mode's (`Decoder.drafts_invariant`: exact and fast modes' drafts
    need not be, their output does not depend on them). Returns Diffs named 'drafter.*' (width 1 for the
    proposal).
    """
    target = drafter.target
    n = setup.tokens.shape[0]
    model = DrafterModel(drafter.config, target.simulate_qat, drafter.policy(invariant=True))
    seeds = jnp.asarray(setup.tokens[:, 0])
    seed_pos = jnp.asarray(setup.lengths, jnp.int32)

    @functools.partial(jax.jit, compiler_options=model.policy.compiler_options)
    def proposal(params, embed, head, state, seeds, seed_pos):
        with kernel_policy.use(model.policy):
            hidden = model.block_hidden(params, embed, state, seeds, seed_pos)
            logits = model.block_logits(params, hidden, head)
        candidates, confidences = model.propose(params, embed, head, state, seeds, seed_pos)
        return logits, candidates, confidences

    def propose(rows: list[int]) -> tuple[np.ndarray, ...]:
        out = proposal(drafter.params, target.params.embed, target.params.head, take_rows(setup.drafter_state, rows),
                       seeds[jnp.asarray(rows)], seed_pos[jnp.asarray(rows)])
        return tuple(np.asarray(x) for x in out)

    alone = [propose([s]) for s in range(n)]
    rng = np.random.default_rng(seed)
    diffs = []
    for batch in batches:
        got: dict[str, list[tuple[Any, Any]]] = {}
        for group in _groups(rng, n, batch):
            out = propose(group)
            for j, s in enumerate(group):
                for name, value, ref in zip(("block_logits", "candidates", "confidences"), out, alone[s]):
                    got.setdefault(f"drafter.{name}", []).append((value[j], ref[0]))
        diffs += [diff_of(what, 1, batch, pairs) for what, pairs in got.items()]

    widths = list(widths)
    features = _row_features(target, setup, max(widths))
    positions = setup.lengths[:, None] + np.arange(max(widths))[None, :]
    for batch in batches:
        groups = _groups(rng, n, batch)
        for q in widths:
            pairs = []
            for group in groups:
                at_once = drafter.absorb(take_rows(setup.drafter_state, group), jnp.asarray(features[group, :q]),
                                         jnp.asarray(positions[group, :q], jnp.int32), invariant=True)
                one_by_one = take_rows(setup.drafter_state, group)
                for i in range(q):
                    one_by_one = drafter.absorb(one_by_one, jnp.asarray(features[group, i : i + 1]),
                                                jnp.asarray(positions[group, i : i + 1], jnp.int32), invariant=True)
                a, b = _leaves(at_once), _leaves(one_by_one)
                pairs += [(a[name], b[name]) for name in a]
            diffs.append(diff_of("drafter.absorb", q, batch, pairs))
    return diffs


def _row_features(target: Target, setup: Setup, width: int) -> np.ndarray:
    """The target's captured features of each sequence's next `width` rows: float32 `[B, width, n_cap, D]`."""
    step = step_program(target.config, target.options(setup.capture))
    _, features, _ = step(target.params, take_rows(setup.state, list(range(setup.tokens.shape[0]))),
                          jnp.asarray(setup.tokens[:, :width]))
    return np.asarray(features)


def _groups(rng: np.random.Generator, n: int, batch: int) -> list[list[int]]:
    """Batches of `batch` sequences in random orders that together hold every sequence at least once."""
    order = list(rng.permutation(n))
    groups = []
    for start in range(0, n, batch):
        group = order[start : start + batch]
        while len(group) < batch:  # the last group is topped up with sequences from the others
            group.append(order[(start + len(group)) % n] if n >= batch else order[len(group) % n])
        groups.append([int(s) for s in group])
    return groups


def report(diffs: list[Diff]) -> str:
    """The differing quantities per width and batch, then `max bit differences: N`."""
    lines = [f"{d.what:28s} q={d.width} B={d.batch}: {d.differing}/{d.total} values differ, up to {d.max_bits} bits"
             for d in diffs if d.max_bits]
    lines.append(f"max bit differences: {max((d.max_bits for d in diffs), default=0)}")
    return "\n".join(lines)
