"""Which target layers share one scanned body (issue 38: compile time that does not grow with depth).

XLA compiles an unrolled step once per layer: about 53 s for a 30-layer DS4 program on an H100. Layers with the
same structure (attention kind, compression ratio, hash or learned routing, SwiGLU clamps, tensor formats) can
run as one body under `jax.lax.scan`, their parameters and caches stacked along a leading axis. A run of
layers whose structure repeats with a short period (DS4: HCA, CSA alternating from layer 3 on) is one segment
whose body holds one period; anything else is a segment of one layer. DS4's 43 layers give three bodies:
layers 0-1 (SWA, hash), layer 2 (CSA, hash) and layers 3-42 (HCA, CSA pairs, 20 times).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

from dsparkjax.config import TargetConfig

MAX_PERIOD = 2  # longest repeating pattern looked for (DS4's is 2)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers `start .. start + period·count − 1`; layer `start + r·period + j` is repetition r of body
    position j. count 1 runs unrolled (its parameters are not stacked)."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    @property
    def scanned(self) -> bool:
        return self.count > 1


LayerPlan = tuple[Segment, ...]


def layer_signature(cfg: TargetConfig, layer: int) -> tuple:
    """What makes two layers' traced bodies the same: the config's per-layer static values."""
    return (cfg.layer_type(layer), cfg.compress_ratios[layer], cfg.is_hash_layer(layer), cfg.swiglu_limit[layer],
            cfg.swiglu_limit_shared[layer])


def plan_layers(cfg: TargetConfig, tensor_keys: Sequence[Hashable] | None = None) -> LayerPlan:
    """Segments covering every layer of `cfg`, greedily from layer 0: at each layer the repeating run (period
    1..MAX_PERIOD, at least two repetitions) that covers most layers (the shorter period on a tie), else the
    layer alone. `tensor_keys[i]`, when given, is added to layer i's signature (its tensors' formats and
    shapes), so layers whose weights are stored differently never share a stack."""
    n = cfg.num_layers
    sigs = [(layer_signature(cfg, i), None if tensor_keys is None else tensor_keys[i]) for i in range(n)]
    plan, i = [], 0
    while i < n:
        best = Segment(i, 1, 1)
        for period in range(1, MAX_PERIOD + 1):
            count = 1
            while i + (count + 1) * period <= n and sigs[i + count * period : i + (count + 1) * period] == \
                    sigs[i : i + period]:
                count += 1
            if count > 1 and period * count > best.period * best.count:
                best = Segment(i, period, count)
        plan.append(best)
        i = best.stop
    return tuple(plan)


def unrolled_plan(cfg: TargetConfig) -> LayerPlan:
    """Every layer a segment of its own: the unrolled step's layout."""
    return tuple(Segment(i, 1, 1) for i in range(cfg.num_layers))
