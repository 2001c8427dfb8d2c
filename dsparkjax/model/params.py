"""Parameter pytrees of the target and the drafter, and their loading from a tensor source (`sources.py`: a
GGUF file streamed to the device, random tensors generated there, or shapes alone for sizing).

Weights are immutable pytrees (`flax.struct.dataclass`); a field is None where the layer kind has no such
tensor (no compressor on sliding-window layers, no router bias on hash layers, ...). Matrices are held in
the compute dtype; norms, HC parameters, routers, compressors and biases in float32, as the reference
computes them (`ds4_arch.md` §6.1).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from dsparkjax.config import DrafterConfig, TargetConfig
from dsparkjax import formats
from dsparkjax.errors import GGUFContractError, UnsupportedTypeError
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.kernels.packed import dequantize
from dsparkjax.model.layer_plan import LayerPlan, Segment, plan_layers, unrolled_plan
from dsparkjax.model.sources import FileSource, TensorSource, packs
from dsparkjax.model.weights import PackedWeight, RowBlocks, Weight


@struct.dataclass
class HyperConnection:
    fn: jax.Array  # [M, n·D]
    base: jax.Array  # [M]
    scale: jax.Array  # [3] (sub-layer) or [1] (head)


@struct.dataclass
class Attention:
    norm: jax.Array  # [D] attn_norm
    wq_a_kv: RowBlocks  # wq_a [r_q, D] and wkv [d, D]: queries' low rank and the kv head, one input
    q_norm: jax.Array  # [r_q]
    wq_b: Weight  # [H·d, r_q]
    kv_norm: jax.Array  # [d]
    sinks: jax.Array | None  # [H]
    wo_a: Weight  # [g·r_o, H·d/g]
    wo_b: Weight  # [D, g·r_o]


@struct.dataclass
class Compressor:
    wkv: jax.Array  # [c·w, D] float32
    wgate: jax.Array  # [c·w, D] float32
    ape: jax.Array  # [m, c·w] float32
    norm: jax.Array  # [w]


@struct.dataclass
class Indexer:
    wq_b: Weight  # [Hi·di, r_q]
    weights_proj: Weight  # [Hi, D]
    compressor: Compressor


@struct.dataclass
class MoE:
    norm: jax.Array  # [D] ffn_norm
    router: jax.Array  # [E, D] float32
    bias: jax.Array | None  # [E] selection bias (learned-routing layers)
    tid2eid: jax.Array | None  # int32 [V, k] (hash layers)
    gate_up: RowBlocks  # the experts' gate and up, [E, I, D] each
    down: Weight  # [E, D, I]
    shared_gate_up: RowBlocks  # the shared expert's gate and up, [I, D] each
    shared_down: Weight  # [D, I]


@struct.dataclass
class Block:
    hc_attn: HyperConnection
    attn: Attention
    compressor: Compressor | None
    indexer: Indexer | None
    hc_ffn: HyperConnection
    moe: MoE


@struct.dataclass
class LayerStack:
    """The layers of a scanned segment (`layer_plan.Segment`): blocks[j] holds body position j of every
    repetition, each array leaf stacked along a leading axis of `count` (repetition r at index r)."""

    blocks: tuple[Block, ...]
    count: int = struct.field(pytree_node=False)


@struct.dataclass
class TargetParams:
    embed: jax.Array  # [V, D]
    blocks: tuple[Block | LayerStack, ...]  # one per segment of the layer plan: a Block, or a LayerStack
    hc_head: HyperConnection
    norm: jax.Array  # [D]
    head: Weight  # [V, D]


@struct.dataclass
class DrafterParams:
    stages: tuple[Block, ...]
    hc_head: HyperConnection
    norm: jax.Array  # [D] the drafter's own final norm
    fc: Weight  # [D, n_cap·D] main_proj
    hidden_norm: jax.Array  # [D] main_norm
    markov_w1: jax.Array  # [V, r]
    markov_w2: Weight  # [V, r]
    confidence_w: jax.Array | None  # [conf_dim]
    confidence_b: jax.Array | None  # [] (absent in DeepSeek's head; lucebox writes a zero)


class _TensorReader:
    """Builds parameters from a source's stored tensors (`sources.py`), on the device.

    A matrix (a weight multiplied by `linear`/`expert_linear`) stays packed as a PackedWeight when `pack`
    names a kernel backend and the tensor is packed as stored, else it is decoded to the compute dtype on the
    device. Under a kernel backend a quantized type without a kernel is refused (UnsupportedTypeError with
    the dense bytes it would take) rather than silently decoded to several times its size. On a ShapeSource
    every step runs under `jax.eval_shape`: the result holds shapes, not arrays.
    """

    def __init__(self, source: TensorSource, dtype: jnp.dtype, pack: str | None):
        self.source, self.dtype, self.pack = source, jnp.dtype(dtype), pack

    def get(self, name: str, kind: str = "f32") -> jax.Array | PackedWeight | None:
        """kind "matrix": see the class; "table": a lookup table (embeddings) in the compute dtype; "f32":
        float32 (int32 tables stay int32); "opt": float32 or None when absent."""
        if kind == "opt" and name not in self.source.tensors:
            return None
        if kind == "matrix":
            return self._weight(*self._matrix(name))
        stored = self._fetch(name)
        if stored.dtype == jnp.int32:
            return stored
        return self._dense(name, stored, self.dtype if kind == "table" else jnp.dtype(jnp.float32))

    def expert_ids(self, name: str, n_experts: int) -> jax.Array:
        """A hash-routing table, int32 `[V, k]`, checked to hold expert ids in [0, n_experts)."""
        table = self.get(name)
        if isinstance(table, (jax.ShapeDtypeStruct, jax.core.Tracer)):  # sizing, or traced (training): no values
            return table
        lo, hi = int(jnp.min(table)), int(jnp.max(table))
        if lo < 0 or hi >= n_experts:
            raise GGUFContractError(self.source.path, f"tensor {name}", f"expert ids in [0, {n_experts})",
                                    f"ids in [{lo}, {hi}]")
        return table

    def rows(self, names: tuple[str, ...], *, stack: bool = True) -> RowBlocks:
        """Matrices that multiply one input, as a RowBlocks: with `stack`, consecutive ones of one format (the
        same ggml type or both dense, the same in-features and expert count) are stacked into one weight on
        the device; without, each is a part of its own."""
        groups: list[tuple[tuple, list[jax.Array]]] = []
        for name in names:
            key, array = self._matrix(name)
            if stack and groups and groups[-1][0] == key:
                groups[-1][1].append(array)
            else:
                groups.append((key, [array]))
        parts = tuple(self._weight(key, self._apply(_stack_rows, *arrays) if len(arrays) > 1 else arrays[0])
                      for key, arrays in groups)
        return RowBlocks(parts, tuple(tuple(a.shape[-2] for a in arrays) for _, arrays in groups))

    def reshaped(self, array, shape: tuple[int, ...]):
        """`array` (from `get`, or None) reshaped to `shape`."""
        return None if array is None else self._apply(jnp.reshape, array, shape=shape)

    def _fetch(self, name: str):
        if name not in self.source.tensors:
            raise GGUFContractError(self.source.path, f"tensor {name}", "present", "missing")
        return self.source.fetch(name)

    def _matrix(self, name: str) -> tuple[tuple, jax.Array]:
        """(format key, array) of a matrix: its packed bytes `[..., out, row_bytes]` under the key (ggml type,
        in-features, leading dims), or its values in the compute dtype `[..., out, in]` under (None, ...)."""
        stored = self._fetch(name)
        info = self.source.tensors[name]
        lead = tuple(info.shape[:-2])
        if self.pack is not None and packs(info.ggml_type):
            return (int(info.ggml_type), info.shape[-1], lead), stored
        if self.pack is not None and formats.block_size(info.ggml_type) > 1:
            dense = math.prod(info.shape) * self.dtype.itemsize
            raise UnsupportedTypeError(
                f"{self.source.path}: tensor {name}: {info.type_name} has no packed kernel, so loading it would "
                f"decode it dense: {dense / 1e9:.3g} GB in {self.dtype.name} instead of {info.nbytes / 1e9:.3g} GB "
                f"packed; refused (kernels={self.pack!r})")
        return (None, info.shape[-1], lead), self._dense(name, stored, self.dtype)

    def _dense(self, name: str, stored, dtype: jnp.dtype):
        """A stored tensor's values in `dtype`, decoded on the device when packed."""
        info = self.source.tensors[name]
        if stored.dtype == jnp.uint8:
            return self._apply(_decoded, stored, ggml_type=int(info.ggml_type), shape=info.shape, dtype=dtype)
        return self._apply(_cast, stored, dtype=dtype)

    def _weight(self, key: tuple, array) -> Weight:
        ggml_type, in_features, _ = key
        if ggml_type is None:
            return array
        return PackedWeight(array, ggml_type, in_features, self.dtype, self.pack)

    @staticmethod
    def _apply(fn: Callable, *arrays, **static):
        """fn(*arrays, **static), or its shapes when the arrays are ShapeDtypeStructs (a sizing run)."""
        if isinstance(arrays[0], jax.ShapeDtypeStruct):
            return jax.eval_shape(functools.partial(fn, **static), *arrays)
        result = fn(*arrays, **static)
        if isinstance(result, jax.Array) and not isinstance(result, jax.core.Tracer):
            # waited for, so the inputs are freed before the next tensor is fetched: one tensor's stored and
            # converted forms are the most that are ever live beside the weights (host memory on the CPU)
            result.block_until_ready()
        return result


@functools.partial(jax.jit, static_argnames=("ggml_type", "shape", "dtype"))
def _decoded(packed: jax.Array, ggml_type: int, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """Packed rows uint8 `[..., row_bytes]` -> their values in `dtype`, numpy `shape`."""
    return dequantize(packed, ggml_type, shape[-1]).reshape(shape).astype(dtype)


def _cast(values: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return values.astype(dtype)


def _stack_rows(*arrays: jax.Array) -> jax.Array:
    return jnp.concatenate(arrays, axis=-2)


def _hc(t: _TensorReader, prefix: str) -> HyperConnection:
    return HyperConnection(t.get(prefix + "_fn.weight"), t.get(prefix + "_base.weight"),
                           t.get(prefix + "_scale.weight"))


def _attention(t: _TensorReader, p: str, *, stack_q_kv: bool) -> Attention:
    """stack_q_kv: wq_a and wkv in one matmul where their formats allow (the target, whose queries and kv rows
    always come from the same input; the drafter also computes kv rows alone, for its context)."""
    m = "matrix"
    return Attention(t.get(p + "attn_norm.weight"),
                     t.rows((p + "attn_q_a.weight", p + "attn_kv.weight"), stack=stack_q_kv),
                     t.get(p + "attn_q_a_norm.weight"), t.get(p + "attn_q_b.weight", m),
                     t.get(p + "attn_kv_a_norm.weight"), t.get(p + "attn_sinks.weight", "opt"),
                     t.get(p + "attn_output_a.weight", m), t.get(p + "attn_output_b.weight", m))


def _compressor(t: _TensorReader, p: str) -> Compressor:
    return Compressor(t.get(p + "_kv.weight"), t.get(p + "_gate.weight"), t.get(p + "_ape.weight"),
                      t.get(p + "_norm.weight"))


def _moe(t: _TensorReader, p: str, hashed: bool, n_experts: int) -> MoE:
    tid2eid = t.expert_ids(p + "ffn_gate_tid2eid.weight", n_experts) if hashed else None
    return MoE(t.get(p + "ffn_norm.weight"), t.get(p + "ffn_gate_inp.weight"), t.get(p + "exp_probs_b.bias", "opt"),
               tid2eid, t.rows((p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight")),
               t.get(p + "ffn_down_exps.weight", "matrix"),
               t.rows((p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")),
               t.get(p + "ffn_down_shexp.weight", "matrix"))


def _as_source(source: TensorSource | GGUFFile) -> TensorSource:
    return FileSource(source) if isinstance(source, GGUFFile) else source


def load_target_params(source: TensorSource | GGUFFile, cfg: TargetConfig, dtype: jnp.dtype,
                       pack: str | None = None, *, scan_layers: bool = False) -> TargetParams:
    """Read every target tensor of a source (a GGUFFile: its FileSource, checking each tensor's bytes) into a
    TargetParams pytree on the device.

    pack: None dequantizes every weight at load; "ffi" or "reference" keeps quantized matrices packed, for
    the kernels of that backend.
    scan_layers: layers of one structure and tensor formats are stacked into LayerStacks (`target_plan`), for
    the scanned step; each layer is written into its stack as it loads, so loading holds one layer more than
    the weights.
    """
    t = _TensorReader(_as_source(source), dtype, pack)

    def block(i: int) -> Block:
        p = f"blk.{i}."
        kind = cfg.layer_type(i)
        compressor = _compressor(t, p + "attn_compressor") if kind != "swa" else None
        indexer = None
        if kind == "csa":
            indexer = Indexer(t.get(p + "indexer.attn_q_b.weight", "matrix"),
                              t.get(p + "indexer.proj.weight", "matrix"), _compressor(t, p + "indexer_compressor"))
        return Block(_hc(t, p + "hc_attn"), _attention(t, p, stack_q_kv=True), compressor, indexer,
                     _hc(t, p + "hc_ffn"), _moe(t, p, cfg.is_hash_layer(i), cfg.n_routed_experts))

    plan = target_plan(cfg, t.source.tensors) if scan_layers else unrolled_plan(cfg)
    blocks = tuple(
        LayerStack(tuple(_stacked((block(seg.start + r * seg.period + j) for r in range(seg.count)), seg.count)
                         for j in range(seg.period)), seg.count)
        if seg.scanned else block(seg.start)
        for seg in plan)
    return TargetParams(t.get("token_embd.weight", "table"), blocks, _hc(t, "output_hc"),
                        t.get("output_norm.weight"), t.get("output.weight", "matrix"))


def target_plan(cfg: TargetConfig, tensors) -> LayerPlan:
    """The layer plan of a target whose tensor table is `tensors` (name -> TensorInfo): layers of the same
    structure whose tensors have the same types and shapes share a stack."""
    keys: list[list] = [[] for _ in range(cfg.num_layers)]
    for name, info in tensors.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < cfg.num_layers:
            keys[int(parts[1])].append((parts[2], int(info.ggml_type), tuple(info.shape)))
    return plan_layers(cfg, [tuple(sorted(k)) for k in keys])


def plan_of(params: TargetParams) -> LayerPlan:
    """The layer plan that params' layout follows (the decode state must be built with the same)."""
    plan, start = [], 0
    for b in params.blocks:
        plan.append(Segment(start, len(b.blocks), b.count) if isinstance(b, LayerStack) else Segment(start, 1, 1))
        start = plan[-1].stop
    return tuple(plan)


def layer_blocks(params: TargetParams):
    """Every Block of params: one per unrolled layer, and each LayerStack's stacked ones (leaves `[count, ...]`)."""
    for b in params.blocks:
        yield from (b.blocks if isinstance(b, LayerStack) else (b,))


def _stacked(blocks, count: int) -> Block:
    """`count` Blocks of one structure as one Block whose leaves are stacked `[count, ...]`, written into the
    stack one by one (the stack donated), so only one unstacked Block is held at a time."""
    first = next(blocks)
    if isinstance(jax.tree.leaves(first)[0], jax.ShapeDtypeStruct):  # a sizing run: shapes alone
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((count, *x.shape), x.dtype), first)
    stack = jax.tree.map(lambda x: jnp.zeros((count, *x.shape), x.dtype), first)
    for r, blk in enumerate(itertools.chain([first], blocks)):
        stack = _put(stack, blk, r)
    return stack


@functools.partial(jax.jit, donate_argnums=(0,))
def _put(stack, blk, r):
    return jax.tree.map(lambda s, x: s.at[r].set(x), stack, blk)


def load_drafter_params(source: TensorSource | GGUFFile, cfg: DrafterConfig, dtype: jnp.dtype,
                        pack: str | None = None) -> DrafterParams:
    """Read every drafter tensor of a source into a DrafterParams pytree (as `load_target_params`)."""
    t = _TensorReader(_as_source(source), dtype, pack)
    stages = tuple(
        Block(_hc(t, f"blk.{s}.hc_attn"), _attention(t, f"blk.{s}.", stack_q_kv=False), None, None,
              _hc(t, f"blk.{s}.hc_ffn"), _moe(t, f"blk.{s}.", False, cfg.n_routed_experts))
        for s in range(cfg.num_stages))
    conf_w = t.get("dflash.dspark.confidence.weight", "opt")
    conf_b = t.get("dflash.dspark.confidence.bias", "opt")
    return DrafterParams(stages, _hc(t, "output_hc"), t.get("output_norm.weight"),
                         t.get("dflash.fc.weight", "matrix"), t.get("dflash.hidden_norm.weight"),
                         t.get("dflash.dspark.markov.w1", "table"), t.get("dflash.dspark.markov.w2", "matrix"),
                         t.reshaped(conf_w, (-1,)), t.reshaped(conf_b, ()))
