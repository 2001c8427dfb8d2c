"""Count what a compiled target step launches: custom calls and XLA fusions, invariant and fast, by source.

    python scripts/step_census.py                               # DS4 dims, 4 layers, bf16, width 1, batch 1
    python scripts/step_census.py --layers 4 --widths 1,6 --batch 8 --dtype float32

Builds the target step of DeepSeek-V4-Flash's dims on parameter shapes alone (a loader run on the random
model's `ShapeSource`: nothing is allocated), lowers and compiles it for the default backend under the
batch-invariant policy (exact mode) and under the fast one, and counts the top-level instructions of the
optimized HLO's entry computation (each is one kernel launch or library call on the GPU, one loop on the CPU):
custom calls by target, fusions, and the rest (copies, dots, gathers, ...). Each instruction is attributed to
the Python line that made it (its HLO metadata), so the table says which model op costs which launches. The
CPU's fusions are a proxy for the GPU's (XLA:GPU fuses more); run it on the GPU for the real counts.
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


def step_hlo(invariant: bool, q: int) -> str:
    """The optimized HLO of DS4's target step (the flags' layers, dtype, batch) at width q."""
    import jax
    import jax.numpy as jnp

    from dsparkjax.config import deepseek_v4_flash, dspark_flash
    from dsparkjax.model.state import init_state
    from dsparkjax.model.target import TargetModel
    from dsparkjax.target_api import DTYPES
    from dsparkjax.tiny import shapes_target

    cfg = deepseek_v4_flash(_LAYERS.value)
    dtype = DTYPES[_DTYPE.value]
    target = shapes_target(cfg, dspark_flash(_LAYERS.value), dtype)
    options = target.options(invariant=invariant)
    state = jax.eval_shape(lambda: init_state(cfg, _BATCH.value, _CONTEXT.value, q, dtype))
    tokens = jax.ShapeDtypeStruct((_BATCH.value, q), jnp.int32)
    step = jax.jit(TargetModel(cfg, options).step, donate_argnums=(1,),
                   compiler_options=options.policy.compiler_options)
    with named_custom_calls():
        lowered = step.lower(target.params, state, tokens)
    return lowered.compile().as_text()


def summary(launches: list[Launch]) -> collections.Counter:
    """Launch count per kind ("custom-call:<target>", "fusion", other opcodes)."""
    return collections.Counter(x.kind for x in launches)


def main(argv: list[str]) -> None:
    del argv
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: DS4 dims, {_LAYERS.value} layers, "
          f"{_DTYPE.value}, batch {_BATCH.value}; top-level instructions of the optimized step")
    for q in (int(w) for w in _WIDTHS.value):
        census = {mode: entry_launches(step_hlo(mode == "invariant", q)) for mode in ("invariant", "fast")}
        kinds = sorted(set().union(*(summary(c) for c in census.values())))
        print(f"\nwidth {q}:")
        print(f"| kind | invariant | fast | invariant bytes out | fast bytes out |")
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


if __name__ == "__main__":
    app.run(main)
