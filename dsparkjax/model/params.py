"""Parameter pytrees of the target and the drafter, and their loading from GGUF files.

Weights are immutable pytrees (`flax.struct.dataclass`); a field is None where the layer kind has no such
tensor (no compressor on sliding-window layers, no router bias on hash layers, ...). Matrices are held in
the compute dtype; norms, HC parameters, routers, compressors and biases in float32, as the reference
computes them (`ds4_arch.md` §6.1).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsparkjax.config import DrafterConfig, TargetConfig
from dsparkjax.errors import GGUFContractError
from dsparkjax.ggufio.contract import check_tensor_bytes
from dsparkjax.formats import GGMLType
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.kernels.packed import KERNEL_TYPES
from dsparkjax.model.weights import PackedWeight, Weight

_FLOAT = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})


@struct.dataclass
class HyperConnection:
    fn: jax.Array  # [M, n·D]
    base: jax.Array  # [M]
    scale: jax.Array  # [3] (sub-layer) or [1] (head)


@struct.dataclass
class Attention:
    norm: jax.Array  # [D] attn_norm
    wq_a: Weight  # [r_q, D]
    q_norm: jax.Array  # [r_q]
    wq_b: Weight  # [H·d, r_q]
    wkv: Weight  # [d, D]
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
    gate: Weight  # [E, I, D]
    up: Weight  # [E, I, D]
    down: Weight  # [E, D, I]
    shared_gate: Weight  # [I, D]
    shared_up: Weight  # [I, D]
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
class TargetParams:
    embed: jax.Array  # [V, D]
    blocks: tuple[Block, ...]
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


def _getter(file: GGUFFile, dtype: jnp.dtype, pack: str | None) -> Callable[..., jax.Array | PackedWeight | None]:
    """`get(name, kind)` loads one tensor, checking its bytes first.

    kind "matrix": a weight multiplied by `linear`/`expert_linear` — kept packed as a PackedWeight when
    `pack` names a kernel backend and the tensor is quantized, else dequantized to the compute dtype;
    "table": a lookup table (embeddings) in the compute dtype; "f32": float32; "opt": float32 or None.
    """

    def get(name: str, kind: str = "f32") -> jax.Array | PackedWeight | None:
        if name not in file.tensors:
            if kind == "opt":
                return None
            raise GGUFContractError(file.path, f"tensor {name}", "present", "missing")
        info = file.tensors[name]
        raw = file.raw(name)
        check_tensor_bytes(file.path, info, raw)
        if kind == "matrix" and pack is not None and info.ggml_type in KERNEL_TYPES and info.ggml_type not in _FLOAT:
            data = jnp.asarray(raw.reshape(*info.shape[:-1], raw.shape[-1]))
            return PackedWeight(data, int(info.ggml_type), info.shape[-1], jnp.dtype(dtype), pack)
        values = file.array(name)
        if values.dtype == np.int32:
            return jnp.asarray(values)
        return jnp.asarray(values, dtype if kind in ("matrix", "table") else jnp.float32)

    return get


def _hc(get: Callable, prefix: str) -> HyperConnection:
    return HyperConnection(get(prefix + "_fn.weight"), get(prefix + "_base.weight"), get(prefix + "_scale.weight"))


def _attention(get: Callable, p: str) -> Attention:
    m = "matrix"
    return Attention(get(p + "attn_norm.weight"), get(p + "attn_q_a.weight", m), get(p + "attn_q_a_norm.weight"),
                     get(p + "attn_q_b.weight", m), get(p + "attn_kv.weight", m), get(p + "attn_kv_a_norm.weight"),
                     get(p + "attn_sinks.weight", "opt"), get(p + "attn_output_a.weight", m),
                     get(p + "attn_output_b.weight", m))


def _compressor(get: Callable, p: str) -> Compressor:
    return Compressor(get(p + "_kv.weight"), get(p + "_gate.weight"), get(p + "_ape.weight"), get(p + "_norm.weight"))


def _moe(get: Callable, p: str, hashed: bool, n_experts: int, path: str) -> MoE:
    m = "matrix"
    tid2eid = get(p + "ffn_gate_tid2eid.weight") if hashed else None
    if tid2eid is not None and (int(jnp.min(tid2eid)) < 0 or int(jnp.max(tid2eid)) >= n_experts):
        raise GGUFContractError(path, f"tensor {p}ffn_gate_tid2eid.weight", f"expert ids in [0, {n_experts})",
                                f"ids in [{int(jnp.min(tid2eid))}, {int(jnp.max(tid2eid))}]")
    return MoE(get(p + "ffn_norm.weight"), get(p + "ffn_gate_inp.weight"), get(p + "exp_probs_b.bias", "opt"),
               tid2eid, get(p + "ffn_gate_exps.weight", m), get(p + "ffn_up_exps.weight", m),
               get(p + "ffn_down_exps.weight", m), get(p + "ffn_gate_shexp.weight", m),
               get(p + "ffn_up_shexp.weight", m), get(p + "ffn_down_shexp.weight", m))


def load_target_params(file: GGUFFile, cfg: TargetConfig, dtype: jnp.dtype, progress: Callable = iter,
                       pack: str | None = None) -> TargetParams:
    """Read every target tensor (checking its bytes) into a TargetParams pytree.

    pack: None dequantizes every weight at load; "ffi" or "reference" keeps quantized matrices packed, for
    the kernels of that backend.
    """
    get = _getter(file, dtype, pack)
    blocks = []
    for i in progress(range(cfg.num_layers)):
        p = f"blk.{i}."
        kind = cfg.layer_type(i)
        compressor = _compressor(get, p + "attn_compressor") if kind != "swa" else None
        indexer = None
        if kind == "csa":
            indexer = Indexer(get(p + "indexer.attn_q_b.weight", "matrix"), get(p + "indexer.proj.weight", "matrix"),
                              _compressor(get, p + "indexer_compressor"))
        blocks.append(Block(_hc(get, p + "hc_attn"), _attention(get, p), compressor, indexer, _hc(get, p + "hc_ffn"),
                            _moe(get, p, cfg.is_hash_layer(i), cfg.n_routed_experts, file.path)))
    return TargetParams(get("token_embd.weight", "table"), tuple(blocks), _hc(get, "output_hc"),
                        get("output_norm.weight"), get("output.weight", "matrix"))


def load_drafter_params(file: GGUFFile, cfg: DrafterConfig, dtype: jnp.dtype, pack: str | None = None
                        ) -> DrafterParams:
    """Read every drafter tensor (checking its bytes) into a DrafterParams pytree (`pack` as for the target)."""
    get = _getter(file, dtype, pack)
    stages = tuple(
        Block(_hc(get, f"blk.{s}.hc_attn"), _attention(get, f"blk.{s}."), None, None, _hc(get, f"blk.{s}.hc_ffn"),
              _moe(get, f"blk.{s}.", False, cfg.n_routed_experts, file.path))
        for s in range(cfg.num_stages))
    conf_w = get("dflash.dspark.confidence.weight", "opt")
    conf_b = get("dflash.dspark.confidence.bias", "opt")
    return DrafterParams(stages, _hc(get, "output_hc"), get("output_norm.weight"), get("dflash.fc.weight", "matrix"),
                         get("dflash.hidden_norm.weight"), get("dflash.dspark.markov.w1", "table"),
                         get("dflash.dspark.markov.w2", "matrix"),
                         None if conf_w is None else conf_w.reshape(-1),
                         None if conf_b is None else conf_b.reshape(()))
