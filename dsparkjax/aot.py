"""Ahead-of-time compiled functions: one XLA executable per argument signature, compiled once and reused.

`generate` compiles every program a run can need (each step width, the proposer's calls, its decode loop's
helpers) before it starts its clock, so tok/s measures decoding, not XLA.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class AotFunction:
    """`jax.jit(fn)` whose executables can be compiled ahead of time (`compile`) for given argument shapes.

    Calls go through jit's own C++ dispatch (microseconds); an executable compiled by `compile` sits in
    JAX's compilation cache, so the first call with those shapes does not compile again. Arguments may be
    arrays or `jax.ShapeDtypeStruct`s when compiling, static ones (`static_argnums`) their hashable values;
    donated arguments stay donated.
    """

    def __init__(self, fn: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (),
                 static_argnums: tuple[int, ...] = ()):
        self._jit = jax.jit(fn, donate_argnums=donate_argnums, static_argnums=static_argnums)
        self._static = frozenset(static_argnums)
        self._compiled: dict[Any, Any] = {}

    def compile(self, *args: Any) -> Any:
        """The executable for arguments shaped like `args` (compiled on first request)."""
        spec = tuple(a if i in self._static else jax.tree.map(_abstract, a) for i, a in enumerate(args))
        leaves, treedef = jax.tree.flatten([a for i, a in enumerate(spec) if i not in self._static])
        static = tuple(a for i, a in enumerate(spec) if i in self._static)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves), static)
        if key not in self._compiled:
            self._compiled[key] = self._jit.lower(*spec).compile()
        return self._compiled[key]

    def __call__(self, *args: Any) -> Any:
        return self._jit(*args)
