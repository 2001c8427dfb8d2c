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
from dsparkjax.formats import FLOAT_TYPES
from dsparkjax.ggufio.reader import GGUFFile
from dsparkjax.kernels.packed import KERNEL_TYPES
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


class _TensorReader:
    """Loads tensors of one file, checking each one's bytes first.

    A matrix (a weight multiplied by `linear`/`expert_linear`) stays packed as a PackedWeight when `pack`
    names a kernel backend and the tensor is quantized, else it is dequantized to the compute dtype.
    """

    def __init__(self, file: GGUFFile, dtype: jnp.dtype, pack: str | None):
        self.file, self.dtype, self.pack = file, jnp.dtype(dtype), pack

    def get(self, name: str, kind: str = "f32") -> jax.Array | PackedWeight | None:
        """kind "matrix": see the class; "table": a lookup table (embeddings) in the compute dtype; "f32":
        float32; "opt": float32 or None when absent."""
        if kind == "opt" and name not in self.file.tensors:
            return None
        if kind == "matrix":
            return self._upload(*self._host_matrix(name))
        self._checked_raw(name)
        values = self.file.array(name)
        if values.dtype == np.int32:
            return jnp.asarray(values)
        return jnp.asarray(values, self.dtype if kind == "table" else jnp.float32)

    def rows(self, names: tuple[str, ...], *, stack: bool = True) -> RowBlocks:
        """Matrices that multiply one input, as a RowBlocks: with `stack`, consecutive ones of one format (the
        same ggml type or both dense, the same in-features and expert count) are stacked into one weight on
        the host before it goes to the device; without, each is a part of its own."""
        groups: list[tuple[tuple, list[np.ndarray]]] = []
        for name in names:
            key, host = self._host_matrix(name)
            if stack and groups and groups[-1][0] == key:
                groups[-1][1].append(host)
            else:
                groups.append((key, [host]))
        parts = tuple(self._upload(key, np.concatenate(hosts, axis=-2) if len(hosts) > 1 else hosts[0])
                      for key, hosts in groups)
        return RowBlocks(parts, tuple(tuple(h.shape[-2] for h in hosts) for _, hosts in groups))

    def _checked_raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor that must be present, checked (`check_tensor_bytes`)."""
        if name not in self.file.tensors:
            raise GGUFContractError(self.file.path, f"tensor {name}", "present", "missing")
        info, raw = self.file.tensors[name], self.file.raw(name)
        check_tensor_bytes(self.file.path, info, raw)
        return raw

    def _host_matrix(self, name: str) -> tuple[tuple, np.ndarray]:
        """(format key, host array) of a matrix: its packed bytes `[..., out, row_bytes]` under the key
        (ggml type, in-features, leading dims), or its dequantized values `[..., out, in]` under (None, ...)."""
        raw = self._checked_raw(name)
        info = self.file.tensors[name]
        lead = tuple(info.shape[:-2])
        if self.pack is not None and info.ggml_type in KERNEL_TYPES and info.ggml_type not in FLOAT_TYPES:
            return (int(info.ggml_type), info.shape[-1], lead), raw.reshape(*info.shape[:-1], raw.shape[-1])
        return (None, info.shape[-1], lead), self.file.array(name)

    def _upload(self, key: tuple, host: np.ndarray) -> Weight:
        ggml_type, in_features, _ = key
        if ggml_type is None:
            return jnp.asarray(host, self.dtype)
        return PackedWeight(jnp.asarray(host), ggml_type, in_features, self.dtype, self.pack)


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
    tid2eid = t.get(p + "ffn_gate_tid2eid.weight") if hashed else None
    if tid2eid is not None and (int(jnp.min(tid2eid)) < 0 or int(jnp.max(tid2eid)) >= n_experts):
        raise GGUFContractError(t.file.path, f"tensor {p}ffn_gate_tid2eid.weight", f"expert ids in [0, {n_experts})",
                                f"ids in [{int(jnp.min(tid2eid))}, {int(jnp.max(tid2eid))}]")
    return MoE(t.get(p + "ffn_norm.weight"), t.get(p + "ffn_gate_inp.weight"), t.get(p + "exp_probs_b.bias", "opt"),
               tid2eid, t.rows((p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight")),
               t.get(p + "ffn_down_exps.weight", "matrix"),
               t.rows((p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")),
               t.get(p + "ffn_down_shexp.weight", "matrix"))


def load_target_params(file: GGUFFile, cfg: TargetConfig, dtype: jnp.dtype, progress: Callable = iter,
                       pack: str | None = None) -> TargetParams:
    """Read every target tensor (checking its bytes) into a TargetParams pytree.

    pack: None dequantizes every weight at load; "ffi" or "reference" keeps quantized matrices packed, for
    the kernels of that backend.
    """
    t = _TensorReader(file, dtype, pack)
    blocks = []
    for i in progress(range(cfg.num_layers)):
        p = f"blk.{i}."
        kind = cfg.layer_type(i)
        compressor = _compressor(t, p + "attn_compressor") if kind != "swa" else None
        indexer = None
        if kind == "csa":
            indexer = Indexer(t.get(p + "indexer.attn_q_b.weight", "matrix"),
                              t.get(p + "indexer.proj.weight", "matrix"), _compressor(t, p + "indexer_compressor"))
        blocks.append(Block(_hc(t, p + "hc_attn"), _attention(t, p, stack_q_kv=True), compressor, indexer,
                            _hc(t, p + "hc_ffn"), _moe(t, p, cfg.is_hash_layer(i), cfg.n_routed_experts)))
    return TargetParams(t.get("token_embd.weight", "table"), tuple(blocks), _hc(t, "output_hc"),
                        t.get("output_norm.weight"), t.get("output.weight", "matrix"))


def load_drafter_params(file: GGUFFile, cfg: DrafterConfig, dtype: jnp.dtype, pack: str | None = None
                        ) -> DrafterParams:
    """Read every drafter tensor (checking its bytes) into a DrafterParams pytree (`pack` as for the target)."""
    t = _TensorReader(file, dtype, pack)
    stages = tuple(
        Block(_hc(t, f"blk.{s}.hc_attn"), _attention(t, f"blk.{s}.", stack_q_kv=False), None, None,
              _hc(t, f"blk.{s}.hc_ffn"), _moe(t, f"blk.{s}.", False, cfg.n_routed_experts))
        for s in range(cfg.num_stages))
    conf_w = t.get("dflash.dspark.confidence.weight", "opt")
    conf_b = t.get("dflash.dspark.confidence.bias", "opt")
    return DrafterParams(stages, _hc(t, "output_hc"), t.get("output_norm.weight"),
                         t.get("dflash.fc.weight", "matrix"), t.get("dflash.hidden_norm.weight"),
                         t.get("dflash.dspark.markov.w1", "table"), t.get("dflash.dspark.markov.w2", "matrix"),
                         None if conf_w is None else conf_w.reshape(-1),
                         None if conf_b is None else conf_b.reshape(()))
