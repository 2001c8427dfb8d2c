"""Static configuration of the DS4 target and the DSpark drafter, read from and written to GGUF metadata.

The configs are frozen, hashable dataclasses so they can be static arguments of `jax.jit`. The GGUF keys
are those of `ds4_arch.md` §5.2 (target, prefix `deepseek4.`) and `dspark.md` §1.4 (drafter, prefix
`deepseek4-dflash-draft.`). Layer types come from `compress_ratios`: 0 = sliding window only ("swa"),
4 = compressed sparse attention with the Lightning Indexer ("csa"), any other ratio = heavily compressed
attention ("hca") — keyed on the role, not on the number 128, so tiny configs can use small HCA ratios.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Mapping

import numpy as np
from gguf import GGUFValueType

from dsparkjax.errors import DsparkError, GGUFContractError

TARGET_ARCH = "deepseek4"
DRAFTER_ARCH = "deepseek4-dflash-draft"
CSA_RATIO = 4
SQRT_SOFTPLUS_GATING = 4  # llama.cpp's enum value for DS4's sqrt-softplus router

LayerType = Literal["swa", "csa", "hca"]


def layer_type_of(ratio: int) -> LayerType:
    """The attention kind of a layer from its compress ratio."""
    if ratio == 0:
        return "swa"
    return "csa" if ratio == CSA_RATIO else "hca"


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Hyperparameters of a DeepSeek-V4 target model (`ds4_arch.md` §1)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_active_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    num_hash_layers: int
    swiglu_limit: tuple[float, ...]
    swiglu_limit_shared: tuple[float, ...]
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_context: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    context_length: int = 1 << 20
    n_shared_experts: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1

    def layer_type(self, layer: int) -> LayerType:
        return layer_type_of(self.compress_ratios[layer])

    @property
    def layer_types(self) -> tuple[LayerType, ...]:
        return tuple(self.layer_type(i) for i in range(self.num_layers))

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Hyperparameters of a DSpark drafter (`dspark.md` §1.3–1.4, `dspark_reference.md`)."""

    num_stages: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_active_experts: int
    moe_intermediate_size: int
    capture_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int
    confidence_dim: int
    sliding_window: int = 128
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    n_shared_experts: int = 1
    head_hc_enabled: int = 0

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim


# ---------------------------------------------------------------------------------------------------------
# Metadata tables: one row per GGUF key, used both to read (with checks) and to write.

Check = Callable[[Any], bool]


@dataclasses.dataclass(frozen=True)
class MetaKey:
    """One GGUF metadata key: where it goes in the config, its GGUF type, and what values are sane."""

    key: str
    field: str | None  # config attribute; None for keys that only carry a fixed required value
    gtype: GGUFValueType
    check: Check
    expect: str  # human description of the sane range, for error messages
    required: bool = True
    array: bool = False
    fixed: Any = None  # the value a `field=None` key must have (and is written with)
    maximum: float | None = None  # a sane model limit: larger values would hang a loop or exhaust memory


def _pos(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _nonneg(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _eps(x: Any) -> bool:
    return isinstance(x, (int, float)) and 0 < x < 1e-2


def _is_integer(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_finite_real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) \
        and math.isfinite(x)


# Sane model limits, far above DeepSeek-V4-Flash's values (ds4_arch.md §1.1) and far below what would make a
# loop run for hours or a shape need terabytes before any check of device memory could run.
MAX_DIM = 1 << 16  # hidden size, head and LoRA widths, expert widths
MAX_VOCAB = 1 << 22
MAX_COUNT = 1 << 12  # layers, heads, experts, stages
MAX_SINKHORN_ITERS = 1000  # DS4 uses 20
MAX_CONTEXT = 1 << 24  # tokens (DS4: 2^20)
MAX_RATIO = 1 << 12  # compress ratio (DS4: 128)
MAX_ROPE_BASE = 1e12


_U32, _F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32

# Keys the target and the drafter share: the MLA attention block and the MoE sizes.
_ATTENTION_KEYS: tuple[MetaKey, ...] = (
    MetaKey("embedding_length", "hidden_size", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("vocab_size", "vocab_size", _U32, _pos, "> 0", maximum=MAX_VOCAB),
    MetaKey("attention.head_count", "num_heads", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("attention.head_count_kv", None, _U32, lambda x: x == 1, "1 (one shared K=V head)", fixed=1),
    MetaKey("attention.key_length", "head_dim", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("rope.dimension_count", "rope_dim", _U32, lambda x: _pos(x) and x % 2 == 0, "even, > 0", maximum=MAX_DIM),
    MetaKey("attention.q_lora_rank", "q_lora_rank", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("attention.output_lora_rank", "o_lora_rank", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("attention.output_group_count", "o_groups", _U32, _pos, "> 0", maximum=MAX_COUNT),
)
_MOE_KEYS: tuple[MetaKey, ...] = (
    MetaKey("expert_count", "n_routed_experts", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("expert_used_count", "n_active_experts", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("expert_feed_forward_length", "moe_intermediate_size", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("expert_shared_count", "n_shared_experts", _U32, lambda x: x == 1, "1"),
)

TARGET_KEYS: tuple[MetaKey, ...] = (
    MetaKey("block_count", "num_layers", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("context_length", "context_length", _U32, _pos, "> 0", required=False, maximum=MAX_CONTEXT),
    *_ATTENTION_KEYS,
    MetaKey("attention.sliding_window", "sliding_window", _U32, _pos, "> 0", maximum=MAX_CONTEXT),
    MetaKey("attention.indexer.head_count", "index_heads", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("attention.indexer.key_length", "index_head_dim", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("attention.indexer.top_k", "index_topk", _U32, _pos, "> 0", maximum=MAX_CONTEXT),
    MetaKey("attention.compress_ratios", "compress_ratios", _U32, _nonneg, "ratios >= 0", array=True,
            maximum=MAX_RATIO),
    MetaKey("attention.compress_rope_freq_base", "compress_rope_theta", _F32, _pos, "> 0", maximum=MAX_ROPE_BASE),
    MetaKey("attention.layer_norm_rms_epsilon", "rms_norm_eps", _F32, _eps, "in (0, 0.01)"),
    *_MOE_KEYS,
    MetaKey("expert_group_count", None, _U32, lambda x: x == 0, "0 (no grouped routing)", False, fixed=0),
    MetaKey("expert_weights_scale", "routed_scaling_factor", _F32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("expert_weights_norm", None, GGUFValueType.BOOL, lambda x: x is True, "true", False, fixed=True),
    MetaKey("expert_gating_func", None, _U32, lambda x: x == SQRT_SOFTPLUS_GATING, "4 (sqrt-softplus)", False,
            fixed=SQRT_SOFTPLUS_GATING),
    MetaKey("hash_layer_count", "num_hash_layers", _U32, _nonneg, ">= 0", maximum=MAX_COUNT),
    MetaKey("swiglu_clamp_exp", "swiglu_limit", _F32, _pos, "clamps > 0", array=True, maximum=MAX_DIM),
    MetaKey("swiglu_clamp_shexp", "swiglu_limit_shared", _F32, _pos, "clamps > 0", required=False, array=True,
            maximum=MAX_DIM),
    MetaKey("hyper_connection.count", "hc_mult", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("hyper_connection.sinkhorn_iterations", "hc_sinkhorn_iters", _U32, _pos, "> 0", maximum=MAX_SINKHORN_ITERS),
    MetaKey("hyper_connection.epsilon", "hc_eps", _F32, _eps, "in (0, 0.01)"),
    MetaKey("rope.freq_base", "rope_theta", _F32, _pos, "> 0", maximum=MAX_ROPE_BASE),
    MetaKey("rope.scaling.type", None, GGUFValueType.STRING, lambda x: x == "yarn", '"yarn"', False,
            fixed="yarn"),
    MetaKey("rope.scaling.factor", "yarn_factor", _F32, _pos, "> 0", maximum=MAX_CONTEXT),
    MetaKey("rope.scaling.original_context_length", "yarn_original_context", _U32, _pos, "> 0", maximum=MAX_CONTEXT),
    MetaKey("rope.scaling.yarn_beta_fast", "yarn_beta_fast", _F32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("rope.scaling.yarn_beta_slow", "yarn_beta_slow", _F32, _pos, "> 0", maximum=MAX_DIM),
)

# lucebox's loader has defaults for the optional drafter keys (dspark.md §1.4); the dataclass carries them.
DRAFTER_KEYS: tuple[MetaKey, ...] = (
    MetaKey("block_count", "num_stages", _U32, _pos, "> 0", maximum=MAX_COUNT),
    *_ATTENTION_KEYS,
    *_MOE_KEYS,
    MetaKey("attention.sliding_window", "sliding_window", _U32, _pos, "> 0", required=False, maximum=MAX_CONTEXT),
    MetaKey("hyper_connection.count", "hc_mult", _U32, _pos, "> 0", required=False, maximum=MAX_COUNT),
    MetaKey("hyper_connection.sinkhorn_iterations", "hc_sinkhorn_iters", _U32, _pos, "> 0", required=False,
            maximum=MAX_SINKHORN_ITERS),
    MetaKey("hyper_connection.epsilon", "hc_eps", _F32, _eps, "in (0, 0.01)", required=False),
    MetaKey("expert_weights_scale", "routed_scaling_factor", _F32, _pos, "> 0", required=False, maximum=MAX_DIM),
    MetaKey("rope.freq_base", "rope_theta", _F32, _pos, "> 0", required=False, maximum=MAX_ROPE_BASE),
    MetaKey("attention.layer_norm_rms_epsilon", "rms_norm_eps", _F32, _eps, "in (0, 0.01)", required=False),
    MetaKey("swiglu_clamp_exp", "swiglu_limit", _F32, _pos, "> 0", required=False, array=True, maximum=MAX_DIM),
    MetaKey("dflash.n_target_layers", None, _U32, _pos, "> 0 and equal to the capture id count", maximum=MAX_COUNT),
    MetaKey("dflash.block_size", "block_size", _U32, _pos, "> 0", maximum=MAX_COUNT),
    MetaKey("dflash.mask_token_id", "mask_token_id", _U32, _nonneg, ">= 0", maximum=MAX_VOCAB),
    MetaKey("dflash.head_hc_enabled", "head_hc_enabled", _U32, _nonneg, ">= 0", required=False),
    MetaKey("dflash.capture_layer_ids", "capture_layer_ids", GGUFValueType.INT32, _nonneg, "ids >= 0",
            array=True, maximum=MAX_COUNT),
    MetaKey("dflash.dspark.enabled", None, _U32, lambda x: x == 1, "1 (a DSpark drafter)", fixed=1),
    MetaKey("dflash.dspark.markov_rank", "markov_rank", _U32, _pos, "> 0", maximum=MAX_DIM),
    MetaKey("dflash.dspark.vocab_size", None, _U32, _pos, "equal to vocab_size", maximum=MAX_VOCAB),
    MetaKey("dflash.dspark.confidence_dim", "confidence_dim", _U32, _nonneg, ">= 0", maximum=2 * MAX_DIM),
)


def _check_value(mk: MetaKey, full: str, v: Any, path: str) -> None:
    """The GGUF value type the key needs (an integer where a count or size is meant, a finite number where a
    float is), then its sane range and limit: GGUFContractError naming the key otherwise."""
    if mk.gtype in (_U32, GGUFValueType.INT32) and not _is_integer(v):
        raise GGUFContractError(path, f"metadata key {full}", f"an integer ({mk.gtype.name})",
                                f"{v!r} ({type(v).__name__})")
    if mk.gtype == _F32 and not _is_finite_real(v):
        raise GGUFContractError(path, f"metadata key {full}", "a finite number (FLOAT32)",
                                f"{v!r} ({type(v).__name__})")
    if not mk.check(v):
        raise GGUFContractError(path, f"metadata key {full}", mk.expect, repr(v))
    if mk.maximum is not None and v > mk.maximum:
        raise GGUFContractError(path, f"metadata key {full}", f"at most {mk.maximum:g} (a sane model limit)", repr(v))


def _read_keys(
    meta: Mapping[str, Any], arch: str, keys: tuple[MetaKey, ...], path: str
) -> dict[str, Any]:
    """Read and range-check the keys of one table; returns the config fields found."""
    found = meta.get("general.architecture")
    if found != arch:
        raise GGUFContractError(path, "general.architecture", repr(arch), repr(found))
    fields: dict[str, Any] = {}
    for mk in keys:
        full = f"{arch}.{mk.key}"
        if full not in meta:
            if mk.required:
                raise GGUFContractError(path, f"metadata key {full}", f"present ({mk.expect})", "missing")
            continue
        value = meta[full]
        if isinstance(value, list) and not mk.array:
            raise GGUFContractError(path, f"metadata key {full}", "a scalar", repr(value)[:80])
        values = value if isinstance(value, list) else [value]  # an array key may hold one scalar
        if mk.array and not values:
            raise GGUFContractError(path, f"metadata key {full}", "a non-empty array", "[]")
        if mk.gtype == _F32:  # stored as float32: keep the shortest decimal that round-trips (1e-06, not 9.99999997e-07)
            values = [float(str(np.float32(v))) if isinstance(v, float) else v for v in values]
        for v in values:
            _check_value(mk, full, v, path)
        if mk.field is not None:
            fields[mk.field] = tuple(values) if mk.array else values[0]
    return fields


def target_config_from_metadata(meta: Mapping[str, Any], path: str) -> TargetConfig:
    """Build a TargetConfig from plain-Python GGUF metadata, raising GGUFContractError on any violation."""
    f = _read_keys(meta, TARGET_ARCH, TARGET_KEYS, path)
    n = f["num_layers"]
    prefix = TARGET_ARCH + "."
    ratios = f["compress_ratios"]
    if len(ratios) < n:
        raise GGUFContractError(path, prefix + "attention.compress_ratios", f">= {n} entries", str(len(ratios)))
    f["compress_ratios"] = tuple(int(r) for r in ratios[:n])  # converters may append the MTP layer's 0
    for name in ("swiglu_limit", "swiglu_limit_shared"):
        clamps = f.get(name, f["swiglu_limit"])
        if len(clamps) == 1:
            clamps = clamps * n
        if len(clamps) < n:
            raise GGUFContractError(path, prefix + "swiglu_clamp_exp", f">= {n} entries", str(len(clamps)))
        f[name] = tuple(float(c) for c in clamps[:n])
    for tok_key, field in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                           ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if tok_key in meta:
            if not _is_integer(meta[tok_key]) or meta[tok_key] < 0:
                raise GGUFContractError(path, f"metadata key {tok_key}", "a token id (an integer >= 0)",
                                        repr(meta[tok_key]))
            f[field] = int(meta[tok_key])
    f = {k: (float(v) if isinstance(v, float) else v) for k, v in f.items()}
    cfg = TargetConfig(**f)
    _check_target_consistency(cfg, path)
    return cfg


def _check_block_shapes(cfg: TargetConfig | DrafterConfig, arch: str, path: str) -> None:
    """Consistency of the keys both contracts share (`_ATTENTION_KEYS`, `_MOE_KEYS`)."""
    def bad(what: str, expected: str, found: Any) -> None:
        raise GGUFContractError(path, f"{arch}.{what}", expected, repr(found))

    if cfg.rope_dim > cfg.head_dim:
        bad("rope.dimension_count", f"<= key_length {cfg.head_dim}", cfg.rope_dim)
    if cfg.num_heads % cfg.o_groups:
        bad("attention.output_group_count", f"a divisor of head_count {cfg.num_heads}", cfg.o_groups)
    if cfg.n_active_experts > cfg.n_routed_experts:
        bad("expert_used_count", f"<= expert_count {cfg.n_routed_experts}", cfg.n_active_experts)


def _check_target_consistency(cfg: TargetConfig, path: str) -> None:
    def bad(what: str, expected: str, found: Any) -> None:
        raise GGUFContractError(path, f"{TARGET_ARCH}.{what}", expected, repr(found))

    _check_block_shapes(cfg, TARGET_ARCH, path)
    if cfg.rope_dim > cfg.index_head_dim:
        bad("rope.dimension_count", f"<= indexer key_length {cfg.index_head_dim}", cfg.rope_dim)
    if cfg.num_hash_layers > cfg.num_layers:
        bad("hash_layer_count", f"<= block_count {cfg.num_layers}", cfg.num_hash_layers)
    if cfg.bos_token_id >= cfg.vocab_size or cfg.eos_token_id >= cfg.vocab_size:
        bad("vocab_size", "> bos and eos ids", cfg.vocab_size)


def drafter_config_from_metadata(meta: Mapping[str, Any], path: str) -> DrafterConfig:
    """Build a DrafterConfig from plain-Python GGUF metadata, raising GGUFContractError on any violation.

    `hash_layer_count` and the compress ratios are ignored: drafter stages never hash-route and never
    compress (`dspark.md` §1.4).
    """
    f = _read_keys(meta, DRAFTER_ARCH, DRAFTER_KEYS, path)
    prefix = DRAFTER_ARCH + "."
    f["capture_layer_ids"] = tuple(int(i) for i in f["capture_layer_ids"])
    n_target = meta[prefix + "dflash.n_target_layers"]
    if n_target != len(f["capture_layer_ids"]):
        raise GGUFContractError(path, prefix + "dflash.capture_layer_ids",
                                f"{n_target} ids (dflash.n_target_layers)", str(len(f["capture_layer_ids"])))
    if meta[prefix + "dflash.dspark.vocab_size"] != f["vocab_size"]:
        raise GGUFContractError(path, prefix + "dflash.dspark.vocab_size", f"{f['vocab_size']} (vocab_size)",
                                str(meta[prefix + "dflash.dspark.vocab_size"]))
    if "swiglu_limit" in f:
        f["swiglu_limit"] = float(f["swiglu_limit"][0])  # one clamp for every stage (lucebox writes one)
    cfg = DrafterConfig(**f)
    if cfg.mask_token_id >= cfg.vocab_size:
        raise GGUFContractError(path, prefix + "dflash.mask_token_id", f"< vocab_size {cfg.vocab_size}",
                                str(cfg.mask_token_id))
    if cfg.confidence_dim not in (0, cfg.hidden_size, cfg.hidden_size + cfg.markov_rank):
        raise GGUFContractError(path, prefix + "dflash.dspark.confidence_dim",
                                f"0, {cfg.hidden_size} or {cfg.hidden_size + cfg.markov_rank}",
                                str(cfg.confidence_dim))
    _check_block_shapes(cfg, DRAFTER_ARCH, path)
    return cfg


def check_drafter_fits_target(draft: DrafterConfig, target: TargetConfig, draft_path: str) -> None:
    """The drafter/target compatibility rules of `dspark.md` §1.4 (lucebox `load_spec_drafter`)."""
    from dsparkjax.errors import IncompatibleDrafterError

    prefix = DRAFTER_ARCH + "."
    pairs = (("embedding_length", draft.hidden_size, target.hidden_size),
             ("vocab_size", draft.vocab_size, target.vocab_size))
    for key, got, want in pairs:
        if got != want:
            raise IncompatibleDrafterError(draft_path, prefix + key, f"{want} (the target's)", str(got))
    if draft.mask_token_id >= target.vocab_size:
        raise IncompatibleDrafterError(draft_path, prefix + "dflash.mask_token_id",
                                       f"< target vocab {target.vocab_size}", str(draft.mask_token_id))
    for i in draft.capture_layer_ids:
        if not 0 <= i < target.num_layers:
            raise IncompatibleDrafterError(draft_path, prefix + "dflash.capture_layer_ids",
                                           f"ids in [0, {target.num_layers})", str(list(draft.capture_layer_ids)))


def metadata_items(cfg: TargetConfig | DrafterConfig) -> list[tuple[str, Any, GGUFValueType]]:
    """(key, value, gguf type) triples that describe `cfg`, for the GGUF writer (inverse of the readers)."""
    if isinstance(cfg, TargetConfig):
        arch, keys = TARGET_ARCH, TARGET_KEYS
    else:
        arch, keys = DRAFTER_ARCH, DRAFTER_KEYS
    items: list[tuple[str, Any, GGUFValueType]] = [("general.architecture", arch, GGUFValueType.STRING)]
    for mk in keys:
        if mk.field is not None:
            value = getattr(cfg, mk.field)
        elif mk.key == "dflash.n_target_layers":
            value = len(cfg.capture_layer_ids)  # type: ignore[union-attr]
        elif mk.key == "dflash.dspark.vocab_size":
            value = cfg.vocab_size
        else:
            value = mk.fixed
        if mk.array and not isinstance(value, tuple):
            value = (value,)
        items.append((f"{arch}.{mk.key}", list(value) if mk.array else value, mk.gtype))
    return items


# ---------------------------------------------------------------------------------------------------------
# Presets.


def deepseek_v4_flash(layers: int = 43) -> TargetConfig:
    """The real DeepSeek-V4-Flash (`ds4_arch.md` §1.1, §1.2); fewer `layers` keep its first ones (the
    benchmarks' DS4-sized models)."""
    if not 3 <= layers <= 43:
        raise DsparkError(f"DeepSeek-V4-Flash has 43 layers, the first 3 hash-routed; got layers={layers}")
    return TargetConfig(
        vocab_size=129280, hidden_size=4096, num_layers=layers, num_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        compress_ratios=(0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, layers)),
        index_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256, n_active_experts=6,
        moe_intermediate_size=2048, routed_scaling_factor=1.5, num_hash_layers=3,
        swiglu_limit=(10.0,) * layers, swiglu_limit_shared=(10.0,) * layers,
    )


def dspark_flash(target_layers: int = 43) -> DrafterConfig:
    """The DeepSeek-V4-Flash DSpark drafter (`dspark_reference.md`), reading the last three of `target_layers`."""
    return DrafterConfig(
        num_stages=3, hidden_size=4096, vocab_size=129280, num_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, n_active_experts=6,
        moe_intermediate_size=2048, capture_layer_ids=tuple(range(target_layers - 3, target_layers)), block_size=5,
        mask_token_id=128799, markov_rank=256, confidence_dim=4096 + 256,
    )


def tiny_target(*, vocab_size: int = 512, hidden_size: int = 64, moe_intermediate_size: int = 32,
                swiglu_limit: float = 10.0, layers: int = 4) -> TargetConfig:
    """The CPU test config of `ds4_arch.md` §7: every layer kind, hash and top-k MoE, reachable boundaries.

    Layers: 0 SWA, 1 CSA, 2 HCA (ratio 8), 3 CSA; hash routing on layers 0 and 1 (fewer `layers` keep the first
    ones); window 8 so the ring wraps every 8 tokens; indexer top-2 so selection starts at t >= 11; 16 indexer
    heads so indexer scores rarely tie (§6.3 item 15).
    """
    if not 1 <= layers <= 4:
        raise DsparkError(f"the tiny target has 4 layers; got layers={layers}")
    return TargetConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=layers, num_heads=4, head_dim=128,
        rope_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=(0, 4, 8, 4)[:layers], index_heads=16, index_head_dim=128, index_topk=2,
        n_routed_experts=8, n_active_experts=2, moe_intermediate_size=moe_intermediate_size,
        routed_scaling_factor=1.5, num_hash_layers=min(2, layers), swiglu_limit=(swiglu_limit,) * layers,
        swiglu_limit_shared=(swiglu_limit,) * layers, context_length=4096,
    )


def tiny_drafter(target: TargetConfig, *, confidence: bool = True) -> DrafterConfig:
    """A tiny DSpark drafter that fits `target`: 3 stages, capture after the last 3 target layers."""
    n_cap = min(3, target.num_layers)
    markov_rank = 16
    return DrafterConfig(
        num_stages=3, hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=4,
        head_dim=target.head_dim, rope_dim=target.rope_dim, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=8, n_active_experts=2, moe_intermediate_size=target.moe_intermediate_size,
        capture_layer_ids=tuple(range(target.num_layers - n_cap, target.num_layers)), block_size=5,
        mask_token_id=target.vocab_size - 1, markov_rank=markov_rank,
        confidence_dim=(target.hidden_size + markov_rank) if confidence else 0, sliding_window=16,
    )


def yarn_ramp(cfg: TargetConfig) -> tuple[float, float]:
    """The YaRN blend bounds (lo, hi) over rope pairs for compressed layers (`ds4_arch.md` §2)."""
    dim = cfg.rope_dim

    def correction(beta: float) -> float:
        return dim * math.log(cfg.yarn_original_context / (beta * 2 * math.pi)) / (2 * math.log(cfg.compress_rope_theta))

    lo = max(math.floor(correction(cfg.yarn_beta_fast)), 0)
    hi = min(math.ceil(correction(cfg.yarn_beta_slow)), dim - 1)
    return float(lo), float(hi if hi != lo else hi + 0.001)
