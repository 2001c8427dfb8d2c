"""The tensor contracts of the target (`deepseek4`) and drafter (`deepseek4-dflash-draft`) GGUF files.

A contract is the list of tensors a config implies — name, numpy shape, family — plus the ggml types each
family may use. Names and shapes follow `ds4_arch.md` §5.3 and `dspark.md` §1.4; any tensor outside the
list is rejected, as lucebox's loader does.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from dsparkjax import formats
from dsparkjax.config import (
    DrafterConfig,
    TargetConfig,
    check_drafter_fits_target,
    drafter_config_from_metadata,
    target_config_from_metadata,
)
from dsparkjax.errors import GGUFContractError
from dsparkjax.formats import FLOAT_TYPES
from dsparkjax.formats import GGMLType as T
from dsparkjax.ggufio.finite import find_nonfinite
from dsparkjax.ggufio.reader import GGUFFile, TensorInfo

_ROCM = frozenset({T.Q4_0_ROCMFP4, T.Q4_0_ROCMFP4_FAST, T.Q6_0_ROCMFPX, T.Q8_0_ROCMFPX, T.Q3_0_ROCMFPX,
                   T.Q2_0_ROCMFP2})
_MATRIX = FLOAT_TYPES | {T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS} | _ROCM

# Family -> allowed ggml types. The families are also the unit of a quant recipe (writer.py).
FAMILY_TYPES: dict[str, frozenset[int]] = {
    "embedding": FLOAT_TYPES | {T.Q8_0},
    "output": _MATRIX,
    "attention": _MATRIX,
    "shared_expert": _MATRIX,
    "routed_expert": _MATRIX,
    "draft_fc": _MATRIX,
    "hc": FLOAT_TYPES,
    "compressor": FLOAT_TYPES,
    "indexer": FLOAT_TYPES,
    "router": FLOAT_TYPES,
    "markov": FLOAT_TYPES | {T.Q8_0},
    "confidence": FLOAT_TYPES,
    "vector": frozenset({T.F32}),
    "hash_table": frozenset({T.I32}),
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor a contract requires (or allows, when `required` is False)."""

    name: str
    shape: tuple[int, ...]  # numpy order
    family: str
    required: bool = True


def _hc_specs(prefix: str, n: int, dim: int, mix: int) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}_fn.weight", (mix, n * dim), "hc"),
            TensorSpec(f"{prefix}_base.weight", (mix,), "vector"),
            TensorSpec(f"{prefix}_scale.weight", (3 if mix != n else 1,), "vector")]


def _attention_specs(p: str, dim: int, heads: int, head_dim: int, q_rank: int, groups: int, o_rank: int,
                     *, sinks_required: bool) -> list[TensorSpec]:
    return [
        TensorSpec(p + "attn_norm.weight", (dim,), "vector"),
        TensorSpec(p + "attn_q_a.weight", (q_rank, dim), "attention"),
        TensorSpec(p + "attn_q_a_norm.weight", (q_rank,), "vector"),
        TensorSpec(p + "attn_q_b.weight", (heads * head_dim, q_rank), "attention"),
        TensorSpec(p + "attn_kv.weight", (head_dim, dim), "attention"),
        TensorSpec(p + "attn_kv_a_norm.weight", (head_dim,), "vector"),
        TensorSpec(p + "attn_sinks.weight", (heads,), "vector", required=sinks_required),
        TensorSpec(p + "attn_output_a.weight", (groups * o_rank, heads * head_dim // groups), "attention"),
        TensorSpec(p + "attn_output_b.weight", (dim, groups * o_rank), "attention"),
    ]


def _moe_specs(p: str, dim: int, experts: int, inter: int, *, bias: bool | None) -> list[TensorSpec]:
    """MoE tensors; `bias` True = required, False = must be absent, None = optional (drafter)."""
    specs = [
        TensorSpec(p + "ffn_norm.weight", (dim,), "vector"),
        TensorSpec(p + "ffn_gate_inp.weight", (experts, dim), "router"),
        TensorSpec(p + "ffn_gate_exps.weight", (experts, inter, dim), "routed_expert"),
        TensorSpec(p + "ffn_up_exps.weight", (experts, inter, dim), "routed_expert"),
        TensorSpec(p + "ffn_down_exps.weight", (experts, dim, inter), "routed_expert"),
        TensorSpec(p + "ffn_gate_shexp.weight", (inter, dim), "shared_expert"),
        TensorSpec(p + "ffn_up_shexp.weight", (inter, dim), "shared_expert"),
        TensorSpec(p + "ffn_down_shexp.weight", (dim, inter), "shared_expert"),
    ]
    if bias is not False:
        specs.append(TensorSpec(p + "exp_probs_b.bias", (experts,), "vector", required=bool(bias)))
    return specs


def target_tensor_specs(cfg: TargetConfig) -> list[TensorSpec]:
    """Every tensor of a target GGUF for `cfg`, in file order."""
    d, n = cfg.hidden_size, cfg.hc_mult
    specs = [TensorSpec("token_embd.weight", (cfg.vocab_size, d), "embedding"),
             TensorSpec("output_norm.weight", (d,), "vector"),
             TensorSpec("output.weight", (cfg.vocab_size, d), "output"),
             *_hc_specs("output_hc", n, d, n)]
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        specs += _hc_specs(p + "hc_attn", n, d, cfg.hc_mix_dim)
        specs += _attention_specs(p, d, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                                  cfg.o_lora_rank, sinks_required=True)
        kind = cfg.layer_type(i)
        if kind != "swa":
            width = (2 if kind == "csa" else 1) * cfg.head_dim
            ratio = cfg.compress_ratios[i]
            specs += [TensorSpec(p + "attn_compressor_kv.weight", (width, d), "compressor"),
                      TensorSpec(p + "attn_compressor_gate.weight", (width, d), "compressor"),
                      TensorSpec(p + "attn_compressor_ape.weight", (ratio, width), "compressor"),
                      TensorSpec(p + "attn_compressor_norm.weight", (cfg.head_dim,), "vector")]
        if kind == "csa":
            iw = 2 * cfg.index_head_dim
            specs += [TensorSpec(p + "indexer.attn_q_b.weight", (cfg.index_heads * cfg.index_head_dim,
                                                                 cfg.q_lora_rank), "indexer"),
                      TensorSpec(p + "indexer.proj.weight", (cfg.index_heads, d), "indexer"),
                      TensorSpec(p + "indexer_compressor_kv.weight", (iw, d), "indexer"),
                      TensorSpec(p + "indexer_compressor_gate.weight", (iw, d), "indexer"),
                      TensorSpec(p + "indexer_compressor_ape.weight", (cfg.compress_ratios[i], iw), "indexer"),
                      TensorSpec(p + "indexer_compressor_norm.weight", (cfg.index_head_dim,), "vector")]
        specs += _hc_specs(p + "hc_ffn", n, d, cfg.hc_mix_dim)
        hashed = cfg.is_hash_layer(i)
        specs += _moe_specs(p, d, cfg.n_routed_experts, cfg.moe_intermediate_size, bias=not hashed)
        if hashed:
            specs.append(TensorSpec(p + "ffn_gate_tid2eid.weight", (cfg.vocab_size, cfg.n_active_experts),
                                    "hash_table"))
    return specs


def drafter_tensor_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """Every tensor a DSpark drafter GGUF for `cfg` may hold, in file order (`dspark.md` §1.4)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    specs: list[TensorSpec] = []
    for s in range(cfg.num_stages):
        p = f"blk.{s}."
        specs += _attention_specs(p, d, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                                  cfg.o_lora_rank, sinks_required=False)
        specs += _hc_specs(p + "hc_attn", n, d, cfg.hc_mix_dim)
        specs += _moe_specs(p, d, cfg.n_routed_experts, cfg.moe_intermediate_size, bias=None)
        specs += _hc_specs(p + "hc_ffn", n, d, cfg.hc_mix_dim)
    specs += [TensorSpec("output_norm.weight", (d,), "vector"),
              *_hc_specs("output_hc", n, d, n),
              TensorSpec("dflash.fc.weight", (d, len(cfg.capture_layer_ids) * d), "draft_fc"),
              TensorSpec("dflash.hidden_norm.weight", (d,), "vector"),
              TensorSpec("dflash.dspark.markov.w1", (cfg.vocab_size, cfg.markov_rank), "markov"),
              TensorSpec("dflash.dspark.markov.w2", (cfg.vocab_size, cfg.markov_rank), "markov")]
    if cfg.confidence_dim:
        specs += [TensorSpec("dflash.dspark.confidence.weight", (1, cfg.confidence_dim), "confidence"),
                  TensorSpec("dflash.dspark.confidence.bias", (1,), "vector", required=False)]
    return specs


def check_tensors(path: str, tensors: dict[str, TensorInfo], specs: Iterable[TensorSpec]) -> None:
    """Every required tensor present with the exact shape and an allowed type; nothing unknown."""
    specs = list(specs)
    known = {s.name for s in specs}
    for name in tensors:
        if name not in known:
            raise GGUFContractError(path, f"tensor {name}", "only tensors of the contract", "an unknown tensor")
    for spec in specs:
        info = tensors.get(spec.name)
        if info is None:
            if spec.required:
                raise GGUFContractError(path, f"tensor {spec.name}", f"present, shape {spec.shape}", "missing")
            continue
        if info.shape != spec.shape:
            raise GGUFContractError(path, f"tensor {spec.name}", f"shape {spec.shape} (numpy order)",
                                    f"shape {info.shape}")
        allowed = FAMILY_TYPES[spec.family]
        if info.ggml_type not in allowed:
            names = ", ".join(sorted(formats.type_name(t) for t in allowed))
            raise GGUFContractError(path, f"tensor {spec.name}", f"a {spec.family} type ({names})",
                                    info.type_name)


def check_expert_pairs(path: str, tensors: dict[str, TensorInfo], prefixes: Iterable[str]) -> None:
    """Routed gate and up experts of one layer share a type (they are read by one fused kernel)."""
    for p in prefixes:
        gate, up = tensors[p + "ffn_gate_exps.weight"], tensors[p + "ffn_up_exps.weight"]
        if gate.ggml_type != up.ggml_type:
            raise GGUFContractError(path, f"tensor {up.name}", f"the type of {gate.name} ({gate.type_name})",
                                    up.type_name)


def check_tensor_bytes(path: str, info: TensorInfo, raw: np.ndarray) -> None:
    """Reject ROCmFPX blocks whose scale byte is invalid (> 0x7E) and NaN/inf values or block scales, naming
    the tensor and the first bad block or value."""
    bad = formats.invalid_scale_blocks(raw, info.ggml_type)
    if len(bad):
        raise GGUFContractError(path, f"tensor {info.name}", "ROCm scale bytes in 0x00..0x7E",
                                f"{len(bad)} block(s) with an invalid scale byte, the first at block {int(bad[0])}")
    nonfinite = find_nonfinite(raw, info.ggml_type)
    if nonfinite is not None:
        raise GGUFContractError(path, f"tensor {info.name}", f"finite {info.type_name} {nonfinite.unit}s",
                                f"{nonfinite.count} NaN or inf {nonfinite.unit}(s), the first at index "
                                f"{nonfinite.first}")


def open_target(path: str) -> tuple[GGUFFile, TargetConfig]:
    """Open a target GGUF and check its whole contract (metadata and tensor table; not the bytes), and that the
    smallest decode state its window implies fits the memory (MemoryBudgetError otherwise)."""
    from dsparkjax import footprint  # it reads TensorInfo from this package

    file = GGUFFile(path)
    cfg = target_config_from_metadata(file.metadata, file.path)
    # The smallest state a decode needs: one sequence, one-token steps, float32.
    footprint.check_state_budget(cfg, 1, cfg.sliding_window, 1, np.float32, file.path)
    check_tensors(file.path, file.tensors, target_tensor_specs(cfg))
    check_expert_pairs(file.path, file.tensors, (f"blk.{i}." for i in range(cfg.num_layers)))
    return file, cfg


def open_drafter(path: str, target: TargetConfig | None = None) -> tuple[GGUFFile, DrafterConfig]:
    """Open a drafter GGUF, check its contract and, given the target's config, their compatibility, and that its
    context rings fit the memory (MemoryBudgetError otherwise)."""
    from dsparkjax import footprint  # it reads TensorInfo from this package

    file = GGUFFile(path)
    cfg = drafter_config_from_metadata(file.metadata, file.path)
    footprint.check_drafter_budget(cfg, file.path)
    tensors = file.tensors
    if "dflash.dspark.confidence.bias" in tensors and "dflash.dspark.confidence.weight" not in tensors:
        raise GGUFContractError(file.path, "tensor dflash.dspark.confidence.bias",
                                "dflash.dspark.confidence.weight beside it (an incomplete confidence pair)",
                                "a bias without weight")
    check_tensors(file.path, tensors, drafter_tensor_specs(cfg))
    check_expert_pairs(file.path, tensors, (f"blk.{s}." for s in range(cfg.num_stages)))
    if target is not None:
        check_drafter_fits_target(cfg, target, file.path)
    return file, cfg
