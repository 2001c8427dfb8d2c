"""Count what a compiled target step launches: custom calls and XLA fusions, invariant and fast, by source.

    python scripts/step_census.py                               # DS4 dims, 4 layers, bf16, width 1, batch 1
    python scripts/step_census.py --layers 4 --widths 1,6 --batch 8 --dtype float32
    python scripts/step_census.py --layers 8 --scan_layers --dtype float32   # and what each loop body copies

Builds the target step of DeepSeek-V4-Flash's dims on parameter shapes alone (a loader run on the random
model's `ShapeSource`: nothing is allocated), lowers and compiles it for the default backend under the
batch-invariant policy (exact mode) and under the fast one, and counts the top-level instructions of the
optimized HLO's entry computation (each is one kernel launch or library call on the GPU, one loop on the CPU):
custom calls by target, fusions, and the rest (copies, dots, gathers, ...). Each instruction is attributed to
the Python line that made it (its HLO metadata), so the table says which model op costs which launches. The
CPU's fusions are a proxy for the GPU's (XLA:GPU fuses more); run it on the GPU for the real counts.

With `--scan_layers` it also lists what the scanned bodies only move (`loop_moves`: copies, slices, fusions of
nothing else), per repetition, by what was moved: a stacked cache (whole, or one layer of it), a stacked weight,
or something else. On the CPU, XLA updates bfloat16 caches in float32 (its float normalization): each update
converts and rewrites its whole buffer, unrolled, and in a scanned body the whole stack, which it then copies into
the loop's carry; `--dtype float32` shows the updates in place.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import os
import re
from typing import Iterator

from absl import app, flags

_LAYERS = flags.DEFINE_integer("layers", 4, "DS4's first N layers (at least 3).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype.")
_WIDTHS = flags.DEFINE_list("widths", ["1"], "Step widths q.")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences per step.")
_CONTEXT = flags.DEFINE_integer("context", 1024, "State capacity in tokens.")
_BY_SOURCE = flags.DEFINE_bool("by_source", True, "Also print the invariant-minus-fast difference per source line.")
_SCAN = flags.DEFINE_bool("scan_layers", False, "Layers of one structure in one scanned body (load_target's); "
                          "also list what the loop bodies copy.")

# `%name = type[shape]{layout} opcode(...)` in an HLO computation body.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SCOPE = re.compile(r'op_name="[^"]*?census:([\w.]+:\d+:\w+)')
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One top-level instruction of the entry computation: what it is and the line that made it."""

    kind: str  # "custom-call:<target>", "fusion" or the opcode
    source: str  # the model line and function whose op made this custom call ("?" for the rest)
    result_bytes: int


def _bytes(shape_text: str) -> int:
    """Bytes of an HLO result type such as `f32[1,64,512]{2,1,0}` or a tuple of them."""
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1, "f64": 8, "s64": 8}
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * sizes.get(dtype, 4)
    return total


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation of an HLO module's text by name: its instruction lines."""
    comps: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            lines = comps.setdefault(head.group(1), [])
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return comps


# Opcodes that only move data; a fusion of nothing else is a copy too.
_MOVE_OPS = {"copy", "dynamic-slice", "slice", "transpose"}
_MOVE_FUSED = _MOVE_OPS | {"parameter", "constant", "bitcast", "reshape"}


@dataclasses.dataclass(frozen=True)
class Move:
    """An instruction of a while loop's body that only moves data, run once per iteration."""

    dtype: str  # its result's element type, "f32", "u8", ...
    dims: tuple[int, ...]  # its result's dims
    result_bytes: int

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """`shape_key` of what it moved."""
        return self.dtype, tuple(d for d in self.dims if d != 1)


def loop_moves(hlo_text: str) -> list[Move]:
    """The instructions of every while body (nested loops' too) that only move data: a copy, a slice, a
    transpose, or a fusion of nothing else. A body that reads a stacked array in place has none of its size."""
    comps = computations(hlo_text)
    bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"body=%([\w.\-]+)", line)}
    moves = []
    for body in bodies:
        for line in comps[body]:
            m = _INSTR.match(line)
            if not m:
                continue
            opcode = m.group(2)
            if opcode == "fusion":
                fused = comps[re.search(r"calls=%([\w.\-]+)", line).group(1)]
                ops = {f.group(2) for f in map(_INSTR.match, fused) if f}
                moving = ops <= _MOVE_FUSED and bool(ops & _MOVE_OPS)
            else:
                moving = opcode in _MOVE_OPS
            if moving:
                dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", m.group(1)).groups()
                moves.append(Move(dtype, tuple(int(d) for d in filter(None, dims.split(","))), _bytes(m.group(1))))
    return moves


def stacked_shapes(tree) -> set[tuple[str, tuple[int, ...]]]:
    """`shape_key`s of every leaf of stacked arrays `[L, ...]` and of one layer of it: the shapes `loop_moves` finds
    when a body copies a stack or a layer of it."""
    import jax

    return {shape_key(dims, leaf.dtype) for leaf in jax.tree.leaves(tree) for dims in (leaf.shape, leaf.shape[1:])}


def shape_key(dims, dtype) -> tuple[str, tuple[int, ...]]:
    """(HLO element type, dims without their 1s) of an array: a slice keeps the sliced axis as 1, a reshape drops
    it, so a Move and the array it copied have the same key (`Move.key`)."""
    import numpy as np

    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "uint8": "u8"}
    return names.get(np.dtype(dtype).name, np.dtype(dtype).name), tuple(int(d) for d in dims if d != 1)


def entry_launches(hlo_text: str) -> list[Launch]:
    """The entry computation's instructions that launch work (parameters, tuples, bitcasts, ... excluded)."""
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    launches = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m or m.group(2) in _FREE:
            continue
        opcode = m.group(2)
        kind = opcode
        if opcode == "custom-call":
            target = _TARGET.search(line)
            kind = f"custom-call:{target.group(1) if target else '?'}"
        src = _SCOPE.search(line)
        source = src.group(1) if src else "?"
        launches.append(Launch(kind, source, _bytes(m.group(1))))
    return launches


# Frames that only route a model op to its custom call: the census names the model line above them.
_ROUTING = ("reduce.py", "weights.py", "stacked.py", "rowwise.py", "ffi.py", "policy.py", "kernels/__init__.py")


def _model_caller() -> str:
    """`file.py:line:function` of the innermost dsparkjax/model frame on the stack that is not routing."""
    for frame in inspect.stack()[2:]:
        path = frame.filename.replace(os.sep, "/")
        if "/dsparkjax/" in path and not path.endswith(_ROUTING):
            return f"{path.rsplit('/', 1)[-1]}:{frame.lineno}:{frame.function}"
    return "unknown:0:unknown"


@contextlib.contextmanager
def named_custom_calls() -> Iterator[None]:
    """Trace every dsparkjax custom call under a name scope of the model line that asked for it."""
    import jax

    from dsparkjax.kernels import ffi

    call = ffi._call

    def scoped(target, out, *args, **attrs):
        with jax.named_scope(f"census:{_model_caller()}"):
            return call(target, out, *args, **attrs)

    ffi._call = scoped
    try:
        yield
    finally:
        ffi._call = call


def shapes_step(q: int):
    """DS4's target (the flags' layers, dtype, layout) as shapes, an empty decode state's shapes for steps of q
    rows, and the tokens' (`tiny.shapes_target`: nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from dsparkjax.config import deepseek_v4_flash, dspark_flash
    from dsparkjax.model.state import init_state
    from dsparkjax.target_api import DTYPES
    from dsparkjax.tiny import shapes_target

    cfg = deepseek_v4_flash(_LAYERS.value)
    dtype = DTYPES[_DTYPE.value]
    target = shapes_target(cfg, dspark_flash(_LAYERS.value), dtype, scan_layers=_SCAN.value)
    state = jax.eval_shape(lambda: init_state(cfg, _BATCH.value, _CONTEXT.value, q, dtype, target.plan))
    return target, state, jax.ShapeDtypeStruct((_BATCH.value, q), jnp.int32)


def step_hlo(invariant: bool, q: int) -> str:
    """The optimized HLO of DS4's target step (the flags' layers, dtype, batch, layout) at width q."""
    import jax

    from dsparkjax.model.target import TargetModel

    target, state, tokens = shapes_step(q)
    options = target.options(invariant=invariant)
    step = jax.jit(TargetModel(target.config, options).step, donate_argnums=(1,),
                   compiler_options=options.policy.compiler_options)
    with named_custom_calls():
        lowered = step.lower(target.params, state, tokens)
    return lowered.compile().as_text()


def moved(q: int, hlo: dict[str, str]) -> None:
    """Print what the scanned bodies of each mode's step (`hlo`: mode -> optimized HLO) copy per repetition."""
    from dsparkjax.model.params import LayerStack
    from dsparkjax.model.state import CacheStack

    target, state, _ = shapes_step(q)
    kinds = {"cache": stacked_shapes([c for c in state.layers if isinstance(c, CacheStack)]),
             "weight": stacked_shapes([b for b in target.params.blocks if isinstance(b, LayerStack)])}
    print(f"\nwidth {q}, scanned bodies: instructions that only move data, per repetition of each body "
          f"(segments {target.plan})")
    print("| moved | mode | instructions | bytes |")
    print("|---|---|---|---|")
    for mode, text in hlo.items():
        per = collections.defaultdict(list)
        for x in loop_moves(text):
            per[next((k for k, shapes in kinds.items() if x.key in shapes), "other")].append(x)
        for kind in ("cache", "weight", "other"):
            print(f"| {kind} | {mode} | {len(per[kind])} | {sum(x.result_bytes for x in per[kind])} |")


def summary(launches: list[Launch]) -> collections.Counter:
    """Launch count per kind ("custom-call:<target>", "fusion", other opcodes)."""
    return collections.Counter(x.kind for x in launches)


def main(argv: list[str]) -> None:
    del argv
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: DS4 dims, {_LAYERS.value} layers "
          f"({'scanned' if _SCAN.value else 'unrolled'}), {_DTYPE.value}, batch {_BATCH.value}; top-level "
          f"instructions of the optimized step")
    for q in (int(w) for w in _WIDTHS.value):
        hlo = {mode: step_hlo(mode == "invariant", q) for mode in ("invariant", "fast")}
        census = {mode: entry_launches(text) for mode, text in hlo.items()}
        kinds = sorted(set().union(*(summary(c) for c in census.values())))
        print(f"\nwidth {q}:")
        print("| kind | invariant | fast | invariant bytes out | fast bytes out |")
        print("|---|---|---|---|---|")
        for kind in kinds + ["all"]:
            row = [[x for x in census[m] if kind in ("all", x.kind)] for m in ("invariant", "fast")]
            print(f"| {kind} | {len(row[0])} | {len(row[1])} | {sum(x.result_bytes for x in row[0])} | "
                  f"{sum(x.result_bytes for x in row[1])} |")
        if _BY_SOURCE.value:
            per = {m: collections.Counter((x.source, x.kind) for x in census[m]) for m in census}
            diff = {k: per["invariant"][k] - per["fast"][k] for k in set(per["invariant"]) | set(per["fast"])}
            print(f"\nwidth {q}, invariant minus fast by source line (launches):")
            for (source, kind), n in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0])):
                if n:
                    print(f"  {n:+4d}  {source:<22} {kind}")
        if _SCAN.value:
            moved(q, hlo)


if __name__ == "__main__":
    app.run(main)
