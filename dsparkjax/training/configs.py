"""The shapes of the shipped trained pair: a DS4 target with every layer kind and a DSpark drafter for it."""

from __future__ import annotations

import dataclasses

from dsparkjax.config import DrafterConfig, TargetConfig, tiny_drafter, tiny_target

VOCAB = 512  # byte-level BPE: 6 chat specials, 256 bytes, merges, and the drafter's MASK as the last id


def trained_target(hidden: int = 64, experts_ffn: int = 64, window: int = 32) -> TargetConfig:
    """Layers SWA, CSA (with the indexer), HCA (ratio 8), CSA; hash routing on layers 0-1, top-k on 2-3;
    hc_mult 4; 8 experts, 2 active; 2 heads of 96 dims (32 roped)."""
    return dataclasses.replace(
        tiny_target(vocab_size=VOCAB, hidden_size=hidden, moe_intermediate_size=experts_ffn),
        num_heads=2, head_dim=96, rope_dim=32, q_lora_rank=32, o_lora_rank=16, sliding_window=window,
        index_heads=2, index_head_dim=64, index_topk=4, context_length=8192)


def trained_drafter(target: TargetConfig, window: int = 32) -> DrafterConfig:
    """3 stages over the features of the last 3 target layers, block 5, Markov rank 32, a bias-free
    confidence head on [pre-norm hidden ; W1[prev]]; MASK is the last (reserved) vocabulary id."""
    markov_rank = 32
    return dataclasses.replace(tiny_drafter(target), num_heads=2, q_lora_rank=32, o_lora_rank=16,
                               markov_rank=markov_rank,
                               confidence_dim=target.hidden_size + markov_rank, sliding_window=window)
