"""HF-transformers reference for the DS4 target: build a `DeepseekV4ForCausalLM` that matches a dsparkjax
`TargetConfig` and load a dsparkjax parameter dict (GGUF tensor names, PyTorch orientation) into it.

Used by `tests/test_hf_parity.py` (`ds4_arch.md` §7 test matrix item 1). Needs torch and a transformers with
`models/deepseek_v4` (>= 5.23). The model is built in fp32, eval mode, on the CPU, with eager attention and
eager experts. HF has no QAT simulations (FP8 KV, Hadamard + FP4 indexer), so compare against dsparkjax with
`simulate_qat=False`.

Name map (`ds4_arch.md` §5.3 GGUF name -> HF module path, `model.layers.N.` prefix for `blk.N.`):

  token_embd / output_norm / output            -> model.embed_tokens / model.norm / lm_head
  output_hc_{fn,base,scale}                    -> model.hc_head.hc_{fn,base,scale}
  hc_{attn,ffn}_{fn,base,scale}                -> {attn,ffn}_hc.{fn,base,scale}
  attn_norm / ffn_norm                         -> input_layernorm / post_attention_layernorm
  attn_q_a, attn_q_a_norm, attn_q_b            -> self_attn.q_a_proj, q_a_norm, q_b_proj
  attn_kv, attn_kv_a_norm, attn_sinks          -> self_attn.kv_proj, kv_norm, sinks
  attn_output_a, attn_output_b                 -> self_attn.o_a_proj, o_b_proj
  attn_compressor_{kv,gate,ape,norm}           -> self_attn.compressor.{kv_proj,gate_proj,position_bias,kv_norm}
  indexer.attn_q_b, indexer.proj               -> self_attn.compressor.indexer.{q_b_proj, scorer.weights_proj}
  indexer_compressor_{kv,gate,ape,norm}        -> self_attn.compressor.indexer.{kv_proj,gate_proj,position_bias,kv_norm}
  ffn_gate_inp, exp_probs_b.bias               -> mlp.gate.weight, mlp.gate.e_score_correction_bias
  ffn_gate_tid2eid                             -> mlp.gate.tid2eid (int64)
  ffn_{gate,up}_exps                           -> mlp.experts.gate_up_proj [E, 2I, D] (gate rows first)
  ffn_down_exps                                -> mlp.experts.down_proj [E, D, I]
  ffn_{gate,up,down}_shexp                     -> mlp.shared_experts.{gate,up,down}_proj
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dsparkjax.config import TargetConfig, layer_type_of

HF_LAYER_TYPE = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                 "hca": "heavily_compressed_attention"}


def hf_config(cfg: TargetConfig):
    """A `DeepseekV4Config` equivalent to `cfg` (`ds4_arch.md` §7 item 1)."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import (
        DeepseekV4Config,
    )

    layer_types = [HF_LAYER_TYPE[layer_type_of(r)] for r in cfg.compress_ratios[: cfg.num_layers]]
    compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    for r in cfg.compress_ratios[: cfg.num_layers]:
        if r:
            compress_rates[HF_LAYER_TYPE[layer_type_of(r)]] = int(r)
    # HF has one compress rate per layer type; dsparkjax allows one per layer. Refuse configs HF cannot express.
    for r in cfg.compress_ratios[: cfg.num_layers]:
        if r and compress_rates[HF_LAYER_TYPE[layer_type_of(r)]] != r:
            raise ValueError(f"HF needs one ratio per layer type, got {cfg.compress_ratios}")
    limits = set(cfg.swiglu_limit) | set(cfg.swiglu_limit_shared)
    if len(limits) != 1:
        raise ValueError(f"HF has one swiglu_limit for routed and shared experts of all layers, got {limits}")
    if cfg.n_shared_experts != 1:
        raise ValueError("HF DeepSeek-V4 has exactly one shared expert")
    hf = DeepseekV4Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.n_active_experts,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=float(cfg.routed_scaling_factor),
        # HF's YaRN validator expects max_position_embeddings = factor * original context (the real model's
        # 1048576); only the explicit factor enters the frequencies.
        max_position_embeddings=int(cfg.yarn_factor * cfg.yarn_original_context),
        rope_theta=float(cfg.rope_theta),
        layer_types=layer_types,
        compress_rates=compress_rates,
        compress_rope_theta=float(cfg.compress_rope_theta),
        hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=float(cfg.hc_eps),
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.num_layers)],
        swiglu_limit=float(limits.pop()),
        sliding_window=cfg.sliding_window,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        rms_norm_eps=float(cfg.rms_norm_eps),
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False,
        partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
        rope_parameters={"rope_type": "yarn", "factor": float(cfg.yarn_factor),
                         "original_max_position_embeddings": int(cfg.yarn_original_context),
                         "beta_fast": float(cfg.yarn_beta_fast), "beta_slow": float(cfg.yarn_beta_slow)},
        use_cache=False,
    )
    # The indexer's rope uses the same partial factor; its head dim (128) differs from the attention head dim,
    # so HF's rope covers `head_dim * partial_rotary_factor` dims of every rotated vector: check that is rope_dim.
    if int(hf.head_dim * hf.partial_rotary_factor) != cfg.rope_dim:
        raise ValueError("partial_rotary_factor does not give rope_dim")
    compress = hf.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["attention_factor"] == 1.0, compress
    assert hf.rope_parameters["main"]["rope_type"] == "default", hf.rope_parameters
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"
    return hf


def hf_param_map(cfg: TargetConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF state-dict name -> array, built from dsparkjax's GGUF-named params. Every input tensor is used once."""
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in params:
            raise KeyError(f"dsparkjax params lack {name}")
        if name in used:
            raise KeyError(f"{name} mapped twice")
        used.add(name)
        return np.asarray(params[name])

    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": take("token_embd.weight"),
        "model.norm.weight": take("output_norm.weight"),
        "lm_head.weight": take("output.weight"),
        "model.hc_head.hc_fn": take("output_hc_fn.weight"),
        "model.hc_head.hc_base": take("output_hc_base.weight"),
        "model.hc_head.hc_scale": take("output_hc_scale.weight"),
    }
    for i in range(cfg.num_layers):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        a = h + "self_attn."
        m = h + "mlp."
        for site in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                out[f"{h}{site}_hc.{part}"] = take(f"{g}hc_{site}_{part}.weight")
        out[h + "input_layernorm.weight"] = take(g + "attn_norm.weight")
        out[h + "post_attention_layernorm.weight"] = take(g + "ffn_norm.weight")
        for ours, theirs in (("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_norm"), ("attn_q_b", "q_b_proj"),
                             ("attn_kv", "kv_proj"), ("attn_kv_a_norm", "kv_norm"),
                             ("attn_output_a", "o_a_proj"), ("attn_output_b", "o_b_proj")):
            out[f"{a}{theirs}.weight"] = take(f"{g}{ours}.weight")
        out[a + "sinks"] = take(g + "attn_sinks.weight")
        kind = cfg.layer_type(i)
        if kind != "swa":
            c = a + "compressor."
            out[c + "kv_proj.weight"] = take(g + "attn_compressor_kv.weight")
            out[c + "gate_proj.weight"] = take(g + "attn_compressor_gate.weight")
            out[c + "position_bias"] = take(g + "attn_compressor_ape.weight")
            out[c + "kv_norm.weight"] = take(g + "attn_compressor_norm.weight")
        if kind == "csa":
            x = a + "compressor.indexer."
            out[x + "q_b_proj.weight"] = take(g + "indexer.attn_q_b.weight")
            out[x + "scorer.weights_proj.weight"] = take(g + "indexer.proj.weight")
            out[x + "kv_proj.weight"] = take(g + "indexer_compressor_kv.weight")
            out[x + "gate_proj.weight"] = take(g + "indexer_compressor_gate.weight")
            out[x + "position_bias"] = take(g + "indexer_compressor_ape.weight")
            out[x + "kv_norm.weight"] = take(g + "indexer_compressor_norm.weight")
        out[m + "gate.weight"] = take(g + "ffn_gate_inp.weight")
        if cfg.is_hash_layer(i):
            out[m + "gate.tid2eid"] = take(g + "ffn_gate_tid2eid.weight").astype(np.int64)
        else:
            out[m + "gate.e_score_correction_bias"] = take(g + "exp_probs_b.bias")
        out[m + "experts.gate_up_proj"] = np.concatenate(
            [take(g + "ffn_gate_exps.weight"), take(g + "ffn_up_exps.weight")], axis=1)
        out[m + "experts.down_proj"] = take(g + "ffn_down_exps.weight")
        for ours, theirs in (("gate", "gate"), ("up", "up"), ("down", "down")):
            out[f"{m}shared_experts.{theirs}_proj.weight"] = take(f"{g}ffn_{ours}_shexp.weight")
    unused = sorted(set(params) - used)
    if unused:
        raise KeyError(f"dsparkjax params not mapped to HF: {unused}")
    return out


def build_hf_model(cfg: TargetConfig, params: Mapping[str, np.ndarray]) -> Any:
    """An fp32 eval-mode CPU `DeepseekV4ForCausalLM` with dsparkjax's weights; fails loudly on any mismatch."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4ForCausalLM,
    )

    hcfg = hf_config(cfg)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hcfg).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers, by name
    mapped = hf_param_map(cfg, params)
    missing = sorted(set(state) - set(mapped))
    extra = sorted(set(mapped) - set(state))
    if missing or extra:
        raise KeyError(f"HF/dsparkjax name mismatch: HF tensors not assigned {missing}; unknown HF names {extra}")
    with torch.no_grad():
        for name, value in mapped.items():
            dst = state[name]
            if tuple(dst.shape) != tuple(value.shape):
                raise ValueError(f"{name}: HF shape {tuple(dst.shape)} != ours {tuple(value.shape)}")
            src = torch.from_numpy(np.ascontiguousarray(value))
            if dst.dtype.is_floating_point:
                if dst.dtype != torch.float32:
                    raise TypeError(f"{name}: HF dtype {dst.dtype}, expected float32")
                src = src.to(torch.float32)
            elif src.dtype != dst.dtype:
                raise TypeError(f"{name}: HF dtype {dst.dtype} != ours {src.dtype}")
            dst.copy_(src)
    # Every tensor assigned exactly once (the state dict lists each once); untied head; values really landed.
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise AssertionError("HF tied lm_head to the embedding; DS4 has an untied head")
    for name, tensor in model.state_dict().items():
        if not np.array_equal(tensor.cpu().numpy(), mapped[name].astype(tensor.cpu().numpy().dtype)):
            raise AssertionError(f"{name} did not load")
    return model


class IndexerRecorder:
    """Records the HF Lightning-Indexer scores `[B, S, T]` of every CSA layer during a forward (via hooks)."""

    def __init__(self, model: Any):
        self.scores: dict[int, torch.Tensor] = {}
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            comp = layer.self_attn.compressor
            indexer = getattr(comp, "indexer", None) if comp is not None else None
            if indexer is None:
                continue
            self._handles.append(indexer.scorer.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(module, args, output):
            self.scores[i] = output.detach().clone()
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def topk_boundary_gaps(scores: torch.Tensor, k: int, ratio: int) -> np.ndarray:
    """For every query (b, t) whose candidate count `(t+1)//ratio` exceeds k, the gap between the k-th and the
    (k+1)-th largest indexer score, relative to the query's largest |score|; a 0 gap is a top-k tie
    (`ds4_arch.md` §6.3 item 15). Returns a flat array (empty when top-k never selects)."""
    s = scores.double().cpu().numpy()
    batch, length, _ = s.shape
    gaps = []
    for b in range(batch):
        for t in range(length):
            n = (t + 1) // ratio
            if n <= k:
                continue
            row = np.sort(s[b, t, :n])[::-1]
            scale = max(np.abs(row).max(), 1e-30)
            gaps.append((row[k - 1] - row[k]) / scale)
    return np.asarray(gaps)


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Full-sequence logits `[B, T, V]` (float32 numpy) from the HF model, without a cache."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, dtype=np.int64)), use_cache=False)
    return out.logits.float().numpy()
