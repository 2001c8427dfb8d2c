"""The model on quantized GGUFs: packed weights through the kernels (FFI and jnp reference) vs dequantized.

A tiny pair written with the lucebox `rocmfpx` recipe (ROCmFP2/FP3 target experts, ROCmFP4_FAST drafter
experts, Q8_0 attention) keeps its matrices packed on the device; the FFI kernels compute each row in an
order that does not depend on the other rows, so exact speculative decoding stays token-identical to plain
decoding on packed weights too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparkjax import kernels
from dsparkjax.decoding import decoder as decoder_module
from dsparkjax.decoding.forward import forward
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.errors import DsparkError
from dsparkjax.formats import GGMLType
from dsparkjax.ggufio.contract import target_tensor_specs
from dsparkjax.ggufio.writer import RawTensor, write_model_gguf
from dsparkjax.decoding.program import step_program
from dsparkjax.kernels import policy as kernel_policy
from dsparkjax.kernels.policy import KernelPolicy
from dsparkjax.model import weights
from dsparkjax.model.state import init_state
from dsparkjax.model.weights import PackedWeight
from dsparkjax.target_api import load_target
from dsparkjax.testing import synthetic
from dsparkjax.testing.oracle import oracle_for
from dsparkjax.tiny import random_params, write_tiny_pair
from model_helpers import recipe_configs, scratch_dir

needs_plugin = pytest.mark.skipif(not kernels.ffi.available(), reason="FFI plugin for this platform not built")


@functools.lru_cache(maxsize=None)
def rocmfpx_pair() -> tuple[str, str]:
    return write_tiny_pair(scratch_dir("rocmfpx-"), recipe="rocmfpx", tokenizer=None)


@pytest.mark.parametrize("backend", ["reference", pytest.param("ffi", marks=needs_plugin)])
def test_packed_weights_match_dequantized(backend):
    target_path, _ = rocmfpx_pair()
    dense = load_target(target_path, kernels="dequantize", simulate_qat=False)
    packed = load_target(target_path, kernels=backend, simulate_qat=False)
    experts = packed.params.blocks[2].moe.gate_up.parts[0]
    assert isinstance(experts, PackedWeight) and experts.ggml_type == 107  # ROCmFP2 stays packed
    assert isinstance(packed.params.blocks[0].attn.wq_b, PackedWeight)  # Q8_0 attention too
    tokens = np.random.default_rng(0).integers(0, 512, (2, 24))
    want, got = forward(dense, tokens), forward(packed, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@functools.lru_cache(maxsize=None)
def q4k_experts_pair() -> tuple[str, str]:
    """A tiny pair written with the Q4KExperts recipe (routed experts Q4_K, the rest as `published`)."""
    tcfg, dcfg = recipe_configs("q4k_experts")
    return write_tiny_pair(scratch_dir("q4k-"), recipe="q4k_experts", tokenizer=None,
                           target_cfg=tcfg, drafter_cfg=dcfg)


@pytest.mark.parametrize("backend", ["reference", pytest.param("ffi", marks=needs_plugin)])
def test_q4k_experts_load_packed_and_generate_as_dequantized(backend):
    """A Q4KExperts file keeps its routed experts packed as Q4_K (gate with up stacked, down) on the packed
    kernels, gives the dequantized model's logits to float32 rounding and the same greedy tokens, the drafter's
    experts packed too."""
    target_path, draft_path = q4k_experts_pair()
    dense = load_target(target_path, kernels="dequantize", simulate_qat=False)
    packed = load_target(target_path, kernels=backend, simulate_qat=False)
    for blk in packed.params.blocks:
        (gate_up,) = blk.moe.gate_up.parts
        for w in (gate_up, blk.moe.down):
            assert isinstance(w, PackedWeight) and w.ggml_type == int(GGMLType.Q4_K) and w.backend == backend
        assert blk.moe.down.data.dtype == jnp.uint8
    drafter = load_drafter(draft_path, packed)
    assert drafter.params.stages[0].moe.down.ggml_type == int(GGMLType.Q4_K)
    vocab = packed.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 24))
    want, got = forward(dense, tokens), forward(packed, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    prompts = [list(range(3, 12)), [7, 1, 30]]
    plain = generate(dense, prompts, mode="ar", max_new_tokens=10, stop_tokens=())
    ours = generate(packed, prompts, mode="ar", max_new_tokens=10, stop_tokens=())
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]


def test_auto_picks_packed_kernels_for_quantized_files(tmp_path):
    target_path, _ = rocmfpx_pair()
    assert load_target(target_path).kernels == kernels.default_backend()
    assert load_target(write_tiny_pair(str(tmp_path), tokenizer=None)[0]).kernels == "dequantize"


@needs_plugin
def test_generation_compiles_the_targets_own_step(monkeypatch):
    """Generation runs the step program forward() and the drafter use: on an "ffi" target the HC mixes go
    through the mHC custom call there too (they once ran on the jnp path in generation only)."""
    target_path, draft_path = rocmfpx_pair()
    target = load_target(target_path, kernels="ffi")
    drafter = load_drafter(draft_path, target)
    seen = []
    for name in ("prefill_program", "decode_program"):
        program = getattr(decoder_module, name)
        monkeypatch.setattr(decoder_module, name,
                            lambda cfg, options, program=program: seen.append(options) or program(cfg, options))
    generate(target, [[3, 4, 5]], drafter=drafter, mode="ar", max_new_tokens=2, stop_tokens=())
    assert seen and set(seen) == {target.options(drafter.capture_layers)}
    assert seen[0].policy.hc_backend == "ffi"


@needs_plugin
def test_two_kernel_policies_compile_two_programs():
    """The kernel policy is part of the step's jit key: a target whose policy takes the dense copy from one row
    gets its own program, in which the packed non-expert matmuls are no longer FFI calls (fast mode's steps: the
    invariant ones never take the copy)."""
    target_path, _ = rocmfpx_pair()
    kernel_target = load_target(target_path, kernels="ffi", simulate_qat=False)
    copy_target = dataclasses.replace(kernel_target, policy=KernelPolicy(gemm_min_rows=1))
    options = [t.options(invariant=False) for t in (kernel_target, copy_target)]
    assert options[0] != options[1]
    steps = [step_program(kernel_target.config, o) for o in options]
    state = init_state(kernel_target.config, 1, 8, 2, kernel_target.dtype)
    tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    calls = [step.compile(kernel_target.params, state, tokens).as_text().count('"dspark_qmatmul"') for step in steps]
    assert calls[0] > 0 and calls[1] == 0, calls


@needs_plugin
def test_exact_spec_equals_greedy_on_packed_ffi_weights():
    target_path, draft_path = rocmfpx_pair()
    target = load_target(target_path, kernels="ffi")
    drafter = load_drafter(draft_path, target)
    assert isinstance(drafter.params.stages[0].moe.gate_up.parts[0], PackedWeight)
    prompts = [list(range(3, 12)), list(range(40, 45)), [7]]
    plain = generate(target, prompts, drafter=drafter, mode="ar", max_new_tokens=12, stop_tokens=())
    oracle = oracle_for(prompts, plain, 512, wrong_rate=0.3, seed=2, capture_layers=drafter.capture_layers)
    spec = generate(target, prompts, drafter=oracle, max_new_tokens=12, width=5, stop_tokens=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.matched for s in spec) > 0 and sum(s.offered - s.matched for s in spec) > 0
    real = generate(target, prompts, drafter=drafter, max_new_tokens=12, stop_tokens=())
    assert [s.token_ids for s in real] == [p.token_ids for p in plain]


@needs_plugin
@pytest.mark.parametrize("groups", [None, 4], ids=["dense", "grouped"])
@pytest.mark.parametrize("rule", ["rows", "large_weight"])
def test_many_rows_multiply_a_dense_copy(groups, rule):
    """From the policy's gemm_min_rows rows on (or gemm_min_rows_large for a weight of large_weight_bytes), a
    packed non-expert matmul on the "ffi" backend multiplies the weight's dense copy (the numbers of
    kernels="dequantize", bit for bit); below, the packed kernel."""
    ggml_type, n, k = int(GGMLType.Q8_0), 48, 128
    data = synthetic.random_packed(jax.random.key(0), ggml_type, (n,), k)
    if rule == "rows":
        policy = KernelPolicy(gemm_min_rows=6)
    else:
        policy = KernelPolicy(gemm_min_rows=1000, gemm_min_rows_large=6, large_weight_bytes=data.size)
    packed = PackedWeight(data, ggml_type, k, jnp.dtype(jnp.bfloat16), "ffi")
    dense = kernels.dequantize(data, ggml_type, k).astype(jnp.bfloat16)

    @jax.jit
    def linear(x, w):
        with kernel_policy.use(policy):
            return weights.linear(x, w, groups=groups)

    for rows in (5, 6, 9):
        shape = (rows, k) if groups is None else (rows, groups, k)
        x = jax.random.normal(jax.random.key(rows), shape, jnp.bfloat16)
        got, want = np.asarray(linear(x, packed)), np.asarray(linear(x, dense))
        if rows >= 6:
            np.testing.assert_array_equal(got, want)
        else:  # the kernel keeps the weights' and activations' float32 values: close, not the GEMM's bits
            assert not np.array_equal(got, want)
            np.testing.assert_allclose(got, want, rtol=0.05, atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["reference", pytest.param("ffi", marks=needs_plugin)])
@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
def test_stacked_rows_give_each_matrix_its_own_call(backend, experts):
    """A RowBlocks part holding two matrices' rows gives each matrix its own call's values: the FFI kernels'
    bits (each row's order is its own), the jnp reference's to float32 rounding (XLA's dot may sum the wider
    product in another order)."""
    ggml_type, k = int(GGMLType.IQ2_XXS), 512
    lead = (4,) if experts else ()
    a, b = (synthetic.random_packed(jax.random.key(s), ggml_type, (*lead, n), k) for s, n in ((1, 24), (2, 40)))
    own = [PackedWeight(w, ggml_type, k, jnp.dtype(jnp.float32), backend) for w in (a, b)]
    stacked = weights.RowBlocks((PackedWeight(jnp.concatenate([a, b], axis=-2), ggml_type, k,
                                              jnp.dtype(jnp.float32), backend),), ((24, 40),))
    x = jax.random.normal(jax.random.key(3), (5, k), jnp.float32)
    if experts:
        ids = jnp.asarray([[0, 3], [1, 1], [2, 0], [3, 2], [0, 1]], jnp.int32)
        got = weights.expert_linear_rows(x, stacked, ids)
        want = [weights.expert_linear(x, w, ids) for w in own]
    else:
        got, want = weights.linear_rows(x, stacked), [weights.linear(x, w) for w in own]
        (second,) = weights.linear_rows(x, weights.RowBlocks(tuple(own), ((24,), (40,))), only=(1,))
        np.testing.assert_array_equal(np.asarray(second), np.asarray(want[1]))  # the other part not multiplied
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        if backend == "ffi":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_loader_stacks_matrices_of_one_input_by_format(monkeypatch, tmp_path):
    """The published recipe's pairs share a format, so each is one weight, but the drafter keeps wq_a and wkv
    apart (it computes context kv rows alone). A file whose shared expert's up is F16 next to a Q8_0 gate keeps
    the two apart, and still computes the model the dequantized weights give. (The routed gate and up must
    share a type: the contract refuses a file where they differ.)"""
    tcfg, dcfg = recipe_configs("published")
    target_path, draft_path = write_tiny_pair(str(tmp_path / "published"), recipe="published", tokenizer=None,
                                              target_cfg=tcfg, drafter_cfg=dcfg)
    target = load_target(target_path, kernels="reference")
    drafter = load_drafter(draft_path, target)
    blk, stage = target.params.blocks[0], drafter.params.stages[0]
    cfg = target.config
    assert len(blk.attn.wq_a_kv.parts) == 1 and blk.attn.wq_a_kv.sizes == ((cfg.q_lora_rank, cfg.head_dim),)
    assert [p.ggml_type for p in blk.moe.gate_up.parts] == [int(GGMLType.IQ2_XXS)]
    assert blk.moe.gate_up.parts[0].shape == (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert [p.ggml_type for p in blk.moe.shared_gate_up.parts] == [int(GGMLType.Q8_0)]
    assert len(stage.attn.wq_a_kv.parts) == 2

    from dsparkjax.ggufio import writer

    published = writer.recipe_type

    def shared_up_in_f16(recipe, spec, *, drafter):
        return int(GGMLType.F16) if "ffn_up_shexp" in spec.name else published(recipe, spec, drafter=drafter)

    monkeypatch.setattr(writer, "recipe_type", shared_up_in_f16)
    mixed_path, _ = write_tiny_pair(str(tmp_path / "mixed"), recipe="published", tokenizer=None, target_cfg=tcfg,
                                    drafter_cfg=dcfg)
    mixed = load_target(mixed_path, kernels="reference", simulate_qat=False)
    gate, up = mixed.params.blocks[0].moe.shared_gate_up.parts
    assert isinstance(gate, PackedWeight) and gate.ggml_type == int(GGMLType.Q8_0) and isinstance(up, jax.Array)
    dense = load_target(mixed_path, kernels="dequantize", simulate_qat=False)
    (both,) = dense.params.blocks[0].moe.shared_gate_up.parts
    assert both.shape == (2 * cfg.moe_intermediate_size, cfg.hidden_size)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    want, got = forward(dense, tokens), forward(mixed, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_random_blocks_write_a_packed_model_at_the_float_models_scale(tmp_path):
    """`random_blocks` (how the DS4-sized benchmark model is made) writes the recipe's quantized matrices as
    random valid blocks, deterministic per seed, at the projections' std 2/sqrt(K); the file loads packed and
    its logits are finite."""
    tcfg, dcfg = recipe_configs("published")
    paths = [write_tiny_pair(str(tmp_path / name), recipe="published", tokenizer=None, target_cfg=tcfg,
                             drafter_cfg=dcfg, random_blocks=True, seed=seed)
             for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    a, b, c = ([open(p, "rb").read() for p in pair] for pair in paths)
    assert a == b and a[0] != c[0] and a[1] != c[1]
    quantized = write_tiny_pair(str(tmp_path / "q"), recipe="published", tokenizer=None, target_cfg=tcfg,
                                drafter_cfg=dcfg)
    assert open(quantized[0], "rb").read() != a[0]
    target = load_target(paths[0][0], kernels="reference")
    blk = target.params.blocks[-1]
    for w in (blk.moe.gate_up.parts[0], blk.moe.down, blk.attn.wq_b, target.params.head):
        assert isinstance(w, PackedWeight), type(w)
        std = float(jnp.std(kernels.dequantize(w.data, w.ggml_type, w.in_features)))
        assert 0.8 < std * np.sqrt(w.in_features) / 2 < 1.2, (w.ggml_type, std)
    assert load_drafter(paths[0][1], target).params.stages[0].moe.down.ggml_type == int(GGMLType.Q2_K)
    tokens = np.random.default_rng(1).integers(0, tcfg.vocab_size, (2, 8))
    assert np.isfinite(forward(target, tokens)).all()


def test_random_blocks_are_checked(tmp_path):
    """Encoded parameters must be in the recipe's type; random blocks need whole blocks and fp16 scales."""
    tcfg, _ = recipe_configs("published")
    params = random_params(target_tensor_specs(tcfg), 0, tcfg.hc_mult, tcfg.n_routed_experts,
                           packed_recipe="published")
    name = "blk.0.attn_q_a.weight"
    params[name] = RawTensor(name, int(GGMLType.IQ2_XXS), params[name].shape, params[name].data)
    with pytest.raises(DsparkError, match=rf"{name} is encoded as {name} in IQ2_XXS; recipe 'published' stores it "
                                          "as Q8_0"):
        write_model_gguf(str(tmp_path / "t.gguf"), tcfg, params, recipe="published")
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        synthetic.random_packed(jax.random.key(0), int(GGMLType.IQ2_XXS), (2,), 100)
    with pytest.raises(ValueError, match="scale bytes are exponents"):
        synthetic.random_packed(jax.random.key(0), int(GGMLType.Q4_0_ROCMFP4), (2,), 64, 0.5)
