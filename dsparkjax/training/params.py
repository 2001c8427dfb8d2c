"""Trainable parameters as a dict of arrays keyed by GGUF tensor name, and their model pytrees.

A dict is what the GGUF writer takes and what optax updates; `ArraySource` hands its arrays to the GGUF
loaders (`model/params.py`) as a file source would, so `load_target_params(ArraySource(...))` inside a
traced loss builds the inference pytree from traced arrays and gradients reach every float tensor. Hash
routing tables (int32) are not trained: they stay concrete numpy arrays, which the loader's range check
reads.
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np

from dsparkjax.formats import GGMLType
from dsparkjax.ggufio.contract import TensorSpec
from dsparkjax.ggufio.reader import TensorInfo
from dsparkjax.tiny import is_generated, random_params

Arrays = dict[str, jax.Array]


class ArraySource:
    """A TensorSource (`model/sources.py`) over in-memory arrays: float ones (possibly traced) as F32,
    int32 ones as I32."""

    def __init__(self, arrays: Mapping[str, jax.Array | np.ndarray], path: str = "<training parameters>"):
        self.path, self._arrays = path, arrays
        self.tensors = {name: TensorInfo(name, GGMLType.I32 if a.dtype == np.int32 else GGMLType.F32,
                                         tuple(a.shape), 0, 0)
                        for name, a in arrays.items()}

    def fetch(self, name: str) -> jax.Array | np.ndarray:
        return self._arrays[name]


def initial_params(specs: list[TensorSpec], seed: int, hc_mult: int, n_experts: int) -> tuple[Arrays, dict]:
    """(trainable float32 arrays, frozen int32 hash tables) for a contract, drawn as the random tiny models
    are (`tiny.random_params`: comb bases near identity, projections ~ 2/sqrt(fan_in), ...)."""
    drawn = random_params([s for s in specs if is_generated(s)], seed, hc_mult, n_experts)
    trainable = {k: jax.numpy.asarray(v) for k, v in drawn.items() if v.dtype != np.int32}
    frozen = {k: v for k, v in drawn.items() if v.dtype == np.int32}
    return trainable, frozen


def to_numpy(params: Mapping[str, jax.Array | np.ndarray]) -> dict[str, np.ndarray]:
    """Host copies for the GGUF writer (float32, or int32 tables)."""
    return {k: np.asarray(v) for k, v in params.items()}
