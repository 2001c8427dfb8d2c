"""Ahead-of-time compiled functions: one XLA executable per argument signature, compiled once and reused.

`Decoder.compile` builds every program a run can need (each step width, the proposer's calls, the loop's
helpers) before `generate` starts its clock, so tok/s measures decoding, not XLA. Those given a `cache_name` are
traced through `dsparkjax.exported` while the persistent compilation cache is on, so a warm start loads their
exported modules instead of tracing and lowering them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from dsparkjax import exported


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class AotFunction:
    """`jax.jit(fn)` whose executables can be compiled ahead of time (`compile`) for given argument shapes.

    A call runs the executable `compile` made for its static arguments and shapes (through its C++ dispatch,
    microseconds), else goes through jit, which compiles what it has not seen. Jit alone would not do: it keys
    its executables on whether each array is committed to a device as well as on its type, and through the
    exported path (below) every output is committed, so a program fed its own outputs (a decode loop's state)
    compiled again at its first call; an executable takes committed and uncommitted arrays alike.
    `compiler_options` are XLA options of its executables (`KernelPolicy.compiler_options`).
    Arguments, positional or keyword, may be arrays or `jax.ShapeDtypeStruct`s when compiling, static ones
    (`static_argnums` / `static_argnames`) their hashable values; donated arguments stay donated.
    `cache_name` names what `fn` computes, stably across processes and completely (every setting its trace
    depends on other than its arguments: a config's and options' repr); with it, and while JAX's persistent
    compilation cache is on, a trace goes through the exported-program cache (`dsparkjax.exported`).
    """

    def __init__(self, fn: Callable[..., Any], *, donate_argnums: tuple[int, ...] = (),
                 static_argnums: tuple[int, ...] = (), donate_argnames: tuple[str, ...] = (),
                 static_argnames: tuple[str, ...] = (), compiler_options: dict[str, Any] | None = None,
                 cache_name: str | None = None):
        # Only the given ones are passed: jit then infers the others from the signature, so a donated or static
        # argument named here is donated or static whether it is passed by position or by keyword.
        given = dict(donate_argnums=donate_argnums, static_argnums=static_argnums, donate_argnames=donate_argnames,
                     static_argnames=static_argnames)
        traced = fn if cache_name is None else _through_exported(fn, cache_name, compiler_options)
        self._jit = jax.jit(traced, **{k: v for k, v in given.items() if v}, compiler_options=compiler_options)
        self._static = frozenset(static_argnums)
        self._static_names = frozenset(static_argnames)
        self._compiled: dict[Any, Any] = {}
        self._by_static: dict[Any, list[Any]] = {}  # static arguments -> their executables, last used first

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        """The executable for arguments shaped like `args` and `kwargs` (compiled on first request)."""
        args = tuple(a if i in self._static else jax.tree.map(_abstract, a) for i, a in enumerate(args))
        kwargs = {k: v if k in self._static_names else jax.tree.map(_abstract, v) for k, v in kwargs.items()}
        dynamic = ([a for i, a in enumerate(args) if i not in self._static],
                   {k: v for k, v in kwargs.items() if k not in self._static_names})
        leaves, treedef = jax.tree.flatten(dynamic)
        static = self._static_key(args, kwargs)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves), static)
        if key not in self._compiled:
            self._compiled[key] = self.lower(*args, **kwargs).compile()
            self._by_static.setdefault(static, []).append(self._compiled[key])
        return self._compiled[key]

    def _static_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The static arguments' values: what, beside shapes, tells one executable from another."""
        return (tuple(a for i, a in enumerate(args) if i in self._static),
                tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names)))

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The program traced and lowered for arguments (arrays or `jax.ShapeDtypeStruct`s) like `args` and
        `kwargs`, not compiled: `jax.stages.Lowered` (start-up timings separate this from compiling)."""
        return self._jit.lower(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        executables = self._by_static.get(self._static_key(args, kwargs))
        if executables:
            dynamic = [a for i, a in enumerate(args) if i not in self._static]
            named = {k: v for k, v in kwargs.items() if k not in self._static_names}
            for n, executable in enumerate(executables):
                try:
                    out = executable(*dynamic, **named)
                except TypeError:  # compiled for other shapes (another batch's): it checks before running
                    continue
                if n:
                    executables.insert(0, executables.pop(n))
                return out
        return self._jit(*args, **kwargs)

    def clear(self) -> None:
        """Forget the executables, so `compile` compiles again (after `jax.clear_caches()` dropped JAX's)."""
        self._compiled.clear()
        self._by_static.clear()


def _through_exported(fn: Callable[..., Any], cache_name: str, compiler_options: dict[str, Any] | None
                      ) -> Callable[..., Any]:
    """`fn` for jit to trace, going through the exported-program cache while it is on. It runs only when jit
    traces (calls dispatch in jit's C++ path), and keeps `fn`'s signature (`functools.wraps`), from which jit
    infers the static and donated arguments given by name or position."""

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        folder = exported.directory()
        if folder is None:
            return fn(*args, **kwargs)
        return exported.call(fn, cache_name, compiler_options, folder, args, kwargs)

    return traced
