"""The target and drafter GGUF contracts (ds4_arch.md §5, dspark.md §1.4 and §6 item 13, quant_hc.md §5).

Round trips through the writer and reader for every quant recipe, then one malformed file per contract
rule: each is a valid tiny file (encoded once) with exactly one thing changed, written with
`write_raw_gguf`, and each error must name the file, the culprit (tensor or key) and what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType

from dsparkjax import formats
from dsparkjax import inspect as ds_inspect
from dsparkjax.config import (
    DRAFTER_ARCH,
    TARGET_ARCH,
    DrafterConfig,
    TargetConfig,
    drafter_config_from_metadata,
    metadata_items,
    target_config_from_metadata,
    tiny_target,
)
from dsparkjax.errors import FormatError, GGUFContractError, IncompatibleDrafterError
from dsparkjax.formats import GGMLType as T
from dsparkjax.ggufio import (
    RECIPES,
    RawTensor,
    check_tensor_bytes,
    drafter_tensor_specs,
    encode,
    open_drafter,
    open_gguf,
    open_target,
    target_tensor_specs,
    write_model_gguf,
    write_raw_gguf,
)
from dsparkjax.ggufio.writer import QUANT_RECIPE_KEY, recipe_type
from dsparkjax.tiny import tiny_pair
from model_helpers import recipe_configs

REPO = Path(__file__).resolve().parents[1]

# Relative RMS error bound of a dequantized tensor against its float32 original, per stored type.
REL_ERROR = {T.F32: 0.0, T.F16: 1e-3, T.Q8_0: 0.01, T.Q2_K: 0.4, T.Q4_K: 0.1, T.IQ2_XXS: 0.4,
             T.Q2_0_ROCMFP2: 0.42, T.Q3_0_ROCMFPX: 0.22, T.Q4_0_ROCMFP4_FAST: 0.12}  # 2-4 bit: ~0.34/0.17/0.09


@dataclasses.dataclass
class Model:
    """One written (or writable) GGUF: its config, float parameters and the tensors `encode` made."""

    path: str
    cfg: TargetConfig | DrafterConfig
    params: dict[str, np.ndarray]
    encoded: dict[str, RawTensor]

    @property
    def drafter(self) -> bool:
        return isinstance(self.cfg, DrafterConfig)

    @property
    def specs(self):
        return drafter_tensor_specs(self.cfg) if self.drafter else target_tensor_specs(self.cfg)


def encode_model(cfg: TargetConfig | DrafterConfig, params: dict[str, np.ndarray], recipe: str
                 ) -> dict[str, RawTensor]:
    drafter = isinstance(cfg, DrafterConfig)
    specs = drafter_tensor_specs(cfg) if drafter else target_tensor_specs(cfg)
    return {s.name: encode(s.name, params[s.name], recipe_type(recipe, s, drafter=drafter))
            for s in specs if s.name in params}


# ---------------------------------------------------------------------------------------------------------
# Round trips: write_model_gguf -> reader, for both contracts and every recipe.


@pytest.fixture(scope="module", params=RECIPES)
def written(request, tmp_path_factory) -> tuple[str, dict[str, Model]]:
    recipe = request.param
    tcfg, dcfg = recipe_configs(recipe)
    tcfg, tparams, dcfg, dparams = tiny_pair(0, target_cfg=tcfg, drafter_cfg=dcfg)
    out = tmp_path_factory.mktemp(f"roundtrip_{recipe}")
    models = {}
    for kind, cfg, params in (("target", tcfg, tparams), ("drafter", dcfg, dparams)):
        path = str(out / f"{kind}.gguf")
        write_model_gguf(path, cfg, params, recipe=recipe)
        models[kind] = Model(path, cfg, params, encode_model(cfg, params, recipe))
    return recipe, models


def open_model(m: Model, target_cfg: TargetConfig | None = None):
    return open_drafter(m.path, target_cfg) if m.drafter else open_target(m.path)


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_round_trip_bytes_are_what_encode_made(written, kind):
    recipe, models = written
    m = models[kind]
    file, _ = open_model(m, models["target"].cfg)
    assert set(file.tensors) == set(m.encoded)
    assert list(file.tensors) == list(m.encoded)  # contract (file) order
    for name, enc in m.encoded.items():
        info = file.tensors[name]
        assert info.ggml_type == enc.ggml_type, name
        assert info.shape == tuple(enc.shape), name
        assert file.raw(name).tobytes() == np.ascontiguousarray(enc.data).tobytes(), name
    assert file.metadata[QUANT_RECIPE_KEY] == recipe


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_round_trip_types_follow_the_recipe(written, kind):
    recipe, models = written
    m = models[kind]
    file, _ = open_model(m)
    for spec in m.specs:
        if spec.name in file.tensors:
            assert file.tensors[spec.name].ggml_type == recipe_type(recipe, spec, drafter=m.drafter), spec.name


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_round_trip_config(written, kind):
    _, models = written
    m = models[kind]
    file, cfg = open_model(m)
    read = drafter_config_from_metadata if m.drafter else target_config_from_metadata
    assert read(file.metadata, file.path) == cfg
    assert cfg == m.cfg  # F32 metadata reads back as the shortest decimal, so configs compare exactly


def test_round_trip_config_is_exact(tiny_files, tiny_params):
    tcfg, _, dcfg, _ = tiny_params
    file, cfg = open_target(tiny_files[0])
    assert target_config_from_metadata(file.metadata, file.path) == tcfg
    _, dread = open_drafter(tiny_files[1], cfg)
    assert dread == dcfg


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_round_trip_values(written, kind):
    _, models = written
    m = models[kind]
    file, _ = open_model(m)
    for name, want in m.params.items():
        got = file.array(name)
        info = file.tensors[name]
        assert got.shape == want.shape, name
        if info.ggml_type in (T.F32, T.I32):
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want.astype(np.float64) ** 2))
        assert rel <= REL_ERROR[info.ggml_type], f"{name} as {info.type_name}: relative RMS error {rel:.4f}"


def test_recipe_that_cannot_encode_a_tensor_names_it(tiny_params, tmp_path):
    tcfg, tparams, _, _ = tiny_params  # hidden 64: not a whole IQ2_XXS block of 256
    with pytest.raises(FormatError, match=r"blk\.0\.ffn_gate_exps\.weight .*IQ2_XXS.*256"):
        write_model_gguf(str(tmp_path / "t.gguf"), tcfg, tparams, recipe="published")


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_describe_lists_config_and_recipe(written, kind):
    recipe, models = written
    m, target = models[kind], models["target"]
    text = ds_inspect.describe(target.path, draft=m.path if m.drafter else None, check_bytes=True)
    section = text[text.index(f"{'drafter' if m.drafter else 'target'}: {m.path}"):]
    assert f"    hidden_size: {m.cfg.hidden_size}" in section
    assert f"    vocab_size: {m.cfg.vocab_size}" in section
    assert f"  tensors: {len(m.encoded)} " in section
    assert f"written as {recipe!r}" in section
    expected: dict[str, set[str]] = {}
    for spec in m.specs:
        if spec.name in m.encoded:
            expected.setdefault(spec.family, set()).add(formats.type_name(m.encoded[spec.name].ggml_type))
    for family, types in expected.items():
        assert f"    {family}: {', '.join(sorted(types))}\n" in section + "\n", family
    quantized = sorted({t for types in expected.values() for t in types} - {"F32", "F16", "BF16", "I32"})
    packed_line = next(line for line in section.splitlines() if line.startswith("  packed on the kernels"))
    assert [part.split(" (")[0] for part in packed_line.split(": ", 1)[1].split(", ")] == (quantized or ["none"])
    if m.drafter:
        assert text.endswith("drafter fits the target: yes")


# ---------------------------------------------------------------------------------------------------------
# Malformed files: a valid tiny f32 pair with one thing changed.


@pytest.fixture(scope="module")
def base(tiny_params) -> dict[str, Model]:
    tcfg, tparams, dcfg, dparams = tiny_params
    return {"target": Model("", tcfg, tparams, encode_model(tcfg, tparams, "f32")),
            "drafter": Model("", dcfg, dparams, encode_model(dcfg, dparams, "f32"))}


def write_variant(path, m: Model, *, drop=(), tensors: dict[str, RawTensor] | None = None,
                  meta: dict[str, Any] | None = None, meta_drop=(), arch: str | None = None) -> str:
    """Write `m` as a raw GGUF, dropping/replacing/adding tensors and metadata keys (full key names).

    A `meta` value may be `(value, GGUFValueType)` to change the stored type.
    """
    tensors, meta = tensors or {}, meta or {}
    triples = []
    for key, value, gtype in metadata_items(m.cfg):
        if key in meta_drop:
            continue
        if key in meta:
            value = meta[key]
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
                value, gtype = value
        triples.append((key, value, gtype))
    raw = [tensors.get(n, t) for n, t in m.encoded.items() if n not in drop]
    raw += [t for n, t in tensors.items() if n not in m.encoded]
    write_raw_gguf(path, arch or (DRAFTER_ARCH if m.drafter else TARGET_ARCH), triples, raw)
    return str(path)


def contract_error(fn, *args, cls=GGUFContractError) -> str:
    with pytest.raises(cls) as excinfo:
        fn(*args)
    return str(excinfo.value)


def assert_names(msg: str, path: str, *parts: str) -> None:
    assert msg.startswith(f"{path}: "), msg
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_valid_variant_opens(base, tmp_path):
    target = write_variant(tmp_path / "t.gguf", base["target"])
    draft = write_variant(tmp_path / "d.gguf", base["drafter"])
    _, tcfg = open_target(target)
    _, dcfg = open_drafter(draft, tcfg)
    assert tcfg == base["target"].cfg
    assert dcfg == base["drafter"].cfg


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_truncated_file_names_the_tensor_out_of_bounds(base, tmp_path, kind):
    good = write_variant(tmp_path / "good.gguf", base[kind])
    last = max(open_gguf(good).tensors.values(), key=lambda i: i.offset)
    data = Path(good).read_bytes()[: last.offset + last.nbytes - 1]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data)
    opener = open_drafter if kind == "drafter" else open_target
    msg = contract_error(opener, str(bad))
    assert_names(msg, str(bad), f"tensor {last.name}", f"{last.nbytes} bytes at offset {last.offset}",
                 f"a file of {len(data)} bytes", "truncated")


@pytest.mark.parametrize("size", [0, 3, 16, 200, 2000])
def test_file_truncated_inside_the_header(base, tmp_path, size):
    good = write_variant(tmp_path / "good.gguf", base["target"])
    first = min(open_gguf(good).tensors.values(), key=lambda i: i.offset)
    assert size < first.offset  # the cut lies in the header, metadata or tensor table
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(Path(good).read_bytes()[:size])
    msg = contract_error(open_target, str(bad))
    assert_names(msg, str(bad), "truncated or corrupt")
    assert any(part in msg for part in ("GGUF header", "metadata key ", "tensor ")), msg  # the part cut


def test_a_directory_is_no_gguf_file(tmp_path):
    assert_names(contract_error(open_target, str(tmp_path)), str(tmp_path), "a directory")


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.gguf")
    assert_names(contract_error(open_target, path), path, "no such file")


def test_unknown_tensor_in_drafter(base, tmp_path):
    """dspark.md §1.4: a drafter must not hold token_embd (or output)."""
    tcfg = base["target"].cfg
    extra = {"token_embd.weight": base["target"].encoded["token_embd.weight"]}
    path = write_variant(tmp_path / "d.gguf", base["drafter"], tensors=extra)
    msg = contract_error(open_drafter, path, tcfg)
    assert_names(msg, path, "tensor token_embd.weight", "only tensors of the contract", "an unknown tensor")


def test_unknown_tensor_in_target(base, tmp_path):
    extra = {"blk.4.attn_norm.weight": encode("blk.4.attn_norm.weight", np.ones(64, np.float32), T.F32)}
    path = write_variant(tmp_path / "t.gguf", base["target"], tensors=extra)
    assert_names(contract_error(open_target, path), path, "tensor blk.4.attn_norm.weight", "an unknown tensor")


@pytest.mark.parametrize("kind,name", [("target", "blk.1.attn_kv.weight"), ("target", "blk.0.ffn_gate_tid2eid.weight"),
                                       ("target", "blk.2.exp_probs_b.bias"), ("drafter", "dflash.fc.weight"),
                                       ("drafter", "dflash.dspark.markov.w2")])
def test_missing_tensor(base, tmp_path, kind, name):
    m = base[kind]
    shape = next(s.shape for s in m.specs if s.name == name)
    path = write_variant(tmp_path / "x.gguf", m, drop=[name])
    opener = open_drafter if m.drafter else open_target
    assert_names(contract_error(opener, path), path, f"tensor {name}", f"present, shape {shape}", "missing")


def test_optional_tensors_may_be_missing(base, tmp_path):
    """Drafter sinks and router biases are optional (dspark.md §1.4)."""
    optional = ["blk.0.attn_sinks.weight", "blk.1.exp_probs_b.bias"]
    path = write_variant(tmp_path / "d.gguf", base["drafter"], drop=optional)
    open_drafter(path, base["target"].cfg)


@pytest.mark.parametrize("kind,name,shape", [
    ("drafter", "dflash.hidden_norm.weight", (65,)),
    ("drafter", "dflash.fc.weight", (64, 128)),  # 2 capture ids' width instead of 3
    ("target", "blk.2.attn_compressor_ape.weight", (4, 128)),  # HCA ratio 8, not 4
    ("target", "blk.1.ffn_down_exps.weight", (8, 32, 64)),  # transposed expert stack
])
def test_wrong_shape(base, tmp_path, kind, name, shape):
    m = base[kind]
    want = next(s.shape for s in m.specs if s.name == name)
    bad = encode(name, np.zeros(shape, np.float32), T.F32)
    path = write_variant(tmp_path / "x.gguf", m, tensors={name: bad})
    opener = open_drafter if m.drafter else open_target
    assert_names(contract_error(opener, path), path, f"tensor {name}", f"shape {want}", f"found shape {shape}")


@pytest.mark.parametrize("kind,name,gtype,family", [
    ("target", "output_norm.weight", T.F16, "vector"),
    ("drafter", "blk.0.attn_norm.weight", T.Q8_0, "vector"),
    ("target", "blk.3.ffn_gate_inp.weight", T.Q8_0, "router"),
    ("target", "token_embd.weight", T.Q4_0_ROCMFP4, "embedding"),
    ("target", "blk.1.ffn_gate_tid2eid.weight", T.F32, "hash_table"),
    ("drafter", "blk.0.hc_attn_fn.weight", T.Q8_0, "hc"),
    ("drafter", "dflash.fc.weight", T.I32, "draft_fc"),
])
def test_wrong_type(base, tmp_path, kind, name, gtype, family):
    m = base[kind]
    bad = encode(name, m.params[name].astype(np.float32), gtype)
    path = write_variant(tmp_path / "x.gguf", m, tensors={name: bad})
    opener = open_drafter if m.drafter else open_target
    assert_names(contract_error(opener, path), path, f"tensor {name}", f"expected a {family} type (",
                 f"found {formats.type_name(gtype)}")


@pytest.mark.parametrize("kind,arch", [("target", "deepseek2"), ("target", DRAFTER_ARCH),
                                       ("drafter", TARGET_ARCH), ("drafter", "deepseek4-dspark")])
def test_wrong_arch(base, tmp_path, kind, arch):
    m = base[kind]
    path = write_variant(tmp_path / "x.gguf", m, arch=arch)
    opener = open_drafter if m.drafter else open_target
    want = DRAFTER_ARCH if m.drafter else TARGET_ARCH
    assert_names(contract_error(opener, path), path, "general.architecture", f"expected {want!r}", f"found {arch!r}")


@pytest.mark.parametrize("kind,key", [("target", "deepseek4.attention.q_lora_rank"),
                                      ("target", "deepseek4.attention.compress_ratios"),
                                      ("target", "deepseek4.hash_layer_count"),
                                      ("drafter", "deepseek4-dflash-draft.dflash.capture_layer_ids"),
                                      ("drafter", "deepseek4-dflash-draft.dflash.dspark.enabled"),
                                      ("drafter", "deepseek4-dflash-draft.dflash.mask_token_id")])
def test_missing_metadata_key(base, tmp_path, kind, key):
    m = base[kind]
    path = write_variant(tmp_path / "x.gguf", m, meta_drop=[key])
    opener = open_drafter if m.drafter else open_target
    assert_names(contract_error(opener, path), path, f"metadata key {key}", "expected present", "found missing")


_TP, _DP = TARGET_ARCH + ".", DRAFTER_ARCH + "."


@pytest.mark.parametrize("kind,key,value,expected", [
    ("target", "expert_used_count", 9, "<= expert_count 8"),
    ("target", "block_count", 0, "> 0"),
    ("target", "block_count", ("4", GGUFValueType.STRING), "an integer (UINT32)"),
    ("target", "block_count", (4.0, GGUFValueType.FLOAT32), "an integer (UINT32)"),
    ("target", "hyper_connection.sinkhorn_iterations", 2_000_000_000, "at most 1000"),
    ("target", "rope.freq_base", float("inf"), "a finite number"),
    ("target", "rope.freq_base", float("nan"), "a finite number"),
    ("target", "attention.layer_norm_rms_epsilon", 0.5, "in (0, 0.01)"),
    ("target", "hash_layer_count", 5, "<= block_count 4"),
    ("target", "rope.dimension_count", 63, "even, > 0"),
    ("target", "attention.head_count_kv", 2, "1 (one shared K=V head)"),
    ("target", "expert_gating_func", 1, "4 (sqrt-softplus)"),
    ("target", "attention.output_group_count", 3, "a divisor of head_count 4"),
    ("target", "attention.compress_ratios", [0, 4], ">= 4 entries"),
    ("drafter", "dflash.dspark.enabled", 0, "1 (a DSpark drafter)"),
    ("drafter", "dflash.n_target_layers", 2, "2 ids (dflash.n_target_layers)"),
    ("drafter", "dflash.dspark.vocab_size", 511, "512 (vocab_size)"),
    ("drafter", "dflash.dspark.confidence_dim", 7, "0, 64 or 80"),
    ("drafter", "attention.output_group_count", 3, "a divisor of head_count 4"),
    ("drafter", "expert_used_count", 9, "<= expert_count 8"),
    ("drafter", "rope.dimension_count", 256, "<= key_length 128"),
])
def test_out_of_range_metadata(base, tmp_path, kind, key, value, expected):
    m = base[kind]
    full = (_DP if m.drafter else _TP) + key
    path = write_variant(tmp_path / "x.gguf", m, meta={full: value})
    opener = open_drafter if m.drafter else open_target
    culprit = _DP + "dflash.capture_layer_ids" if key == "dflash.n_target_layers" else full  # the pair's other key
    assert_names(contract_error(opener, path), path, culprit, f"expected {expected}")


def test_mask_id_out_of_vocab(base, tmp_path):
    key = _DP + "dflash.mask_token_id"
    path = write_variant(tmp_path / "d.gguf", base["drafter"], meta={key: 512})
    assert_names(contract_error(open_drafter, path), path, key, "expected < vocab_size 512", "found 512")


def test_capture_id_beyond_target_depth(base, tmp_path):
    key = _DP + "dflash.capture_layer_ids"
    path = write_variant(tmp_path / "d.gguf", base["drafter"], meta={key: [1, 2, 4]})
    open_drafter(path)  # on its own the drafter is fine: depth is the target's business
    msg = contract_error(open_drafter, path, base["target"].cfg, cls=IncompatibleDrafterError)
    assert_names(msg, path, key, "ids in [0, 4)", "[1, 2, 4]")


def test_negative_capture_id(base, tmp_path):
    key = _DP + "dflash.capture_layer_ids"
    path = write_variant(tmp_path / "d.gguf", base["drafter"], meta={key: [1, -1, 3]})
    assert_names(contract_error(open_drafter, path), path, key, "ids >= 0", "-1")


def test_incompatible_drafter_vocab(tmp_path, base):
    """A valid drafter for a target with another vocabulary."""
    other = tiny_target(vocab_size=256)
    _, _, dcfg, dparams = tiny_pair(0, target_cfg=other)
    path = str(tmp_path / "d.gguf")
    write_model_gguf(path, dcfg, dparams)
    open_drafter(path, other)
    msg = contract_error(open_drafter, path, base["target"].cfg, cls=IncompatibleDrafterError)
    assert_names(msg, path, _DP + "vocab_size", "expected 512 (the target's)", "found 256")


def test_incompatible_drafter_width(tiny_files):
    target_file, draft = tiny_files
    _, tcfg = open_target(target_file)
    wider = dataclasses.replace(tcfg, hidden_size=96)
    msg = contract_error(open_drafter, draft, wider, cls=IncompatibleDrafterError)
    assert_names(msg, draft, _DP + "embedding_length", "expected 96 (the target's)", "found 64")


def test_confidence_bias_without_weight(base, tmp_path):
    bias = {"dflash.dspark.confidence.bias": encode("dflash.dspark.confidence.bias", np.zeros(1, np.float32), T.F32)}
    path = write_variant(tmp_path / "d.gguf", base["drafter"], drop=["dflash.dspark.confidence.weight"], tensors=bias)
    assert_names(contract_error(open_drafter, path), path, "tensor dflash.dspark.confidence.bias",
                 "confidence.weight beside it", "a bias without weight")
    both = write_variant(tmp_path / "both.gguf", base["drafter"], tensors=bias)  # the complete pair is fine
    assert "dflash.dspark.confidence.bias" in open_drafter(both)[0].tensors


def test_confidence_tensors_without_confidence_dim(base, tmp_path):
    """confidence_dim 0 means no head, so a confidence weight is then an unknown tensor."""
    key = _DP + "dflash.dspark.confidence_dim"
    path = write_variant(tmp_path / "d.gguf", base["drafter"], meta={key: 0})
    assert_names(contract_error(open_drafter, path), path, "tensor dflash.dspark.confidence.weight", "unknown")


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_gate_up_expert_type_mismatch(base, tmp_path, kind):
    m = base[kind]
    layer = 2 if kind == "target" else 1
    up = f"blk.{layer}.ffn_up_exps.weight"
    path = write_variant(tmp_path / "x.gguf", m, tensors={up: encode(up, m.params[up], T.F16)})
    opener = open_drafter if m.drafter else open_target
    assert_names(contract_error(opener, path), path, f"tensor {up}",
                 f"the type of blk.{layer}.ffn_gate_exps.weight (F32)", "found F16")


# --- byte- and value-level checks that need the tensor data (at check or load time) ----------------------


@pytest.fixture(scope="module")
def base_target(base, tmp_path_factory) -> str:
    """The base target, written once (for describe and CLI calls that need a target beside a drafter)."""
    return write_variant(tmp_path_factory.mktemp("base") / "t.gguf", base["target"])


@pytest.fixture(scope="module")
def bad_scale_draft(base, tmp_path_factory) -> tuple[str, str, int]:
    """A drafter whose blk.1 down experts are ROCmFP4_FAST with scale byte 0x7F in block 37."""
    m = base["drafter"]
    name, block = "blk.1.ffn_down_exps.weight", 37
    enc = encode(name, m.params[name], T.Q4_0_ROCMFP4_FAST)
    path = write_variant(tmp_path_factory.mktemp("bad_scale") / "d.gguf", m, tensors={name: enc})
    info = open_gguf(path).tensors[name]
    assert len(formats.invalid_scale_blocks(open_gguf(path).raw(name), info.ggml_type)) == 0
    data = bytearray(Path(path).read_bytes())
    data[info.offset + block * formats.type_size(T.Q4_0_ROCMFP4_FAST) + 16] = 0x7F  # the scale after 16 qs bytes
    Path(path).write_bytes(bytes(data))
    return path, name, block


def test_bad_rocm_scale_byte_found_by_byte_check(bad_scale_draft, base, base_target):
    path, name, block = bad_scale_draft
    file, _ = open_drafter(path, base["target"].cfg)  # the contract does not read bytes
    msg = contract_error(check_tensor_bytes, path, file.tensors[name], file.raw(name))
    assert_names(msg, path, f"tensor {name}", "ROCm scale bytes in 0x00..0x7E", "1 block(s)", f"block {block}")
    with pytest.raises(GGUFContractError, match=f"tensor {name}.*block {block}"):
        ds_inspect.describe(base_target, draft=path, check_bytes=True)
    ds_inspect.describe(base_target, draft=path)  # without --check_bytes it passes


def test_bad_rocm_scale_byte_rejected_at_load(bad_scale_draft, base):
    import jax.numpy as jnp

    from dsparkjax.model.params import load_drafter_params

    path, name, block = bad_scale_draft
    file, cfg = open_drafter(path, base["target"].cfg)
    msg = contract_error(load_drafter_params, file, cfg, jnp.float32)
    assert_names(msg, path, f"tensor {name}", f"block {block}")


@pytest.mark.parametrize("bad_id", [8, -1])
def test_tid2eid_expert_out_of_range_at_load(base, tmp_path, bad_id):
    import jax.numpy as jnp

    from dsparkjax.model.params import load_target_params

    m = base["target"]
    name = "blk.1.ffn_gate_tid2eid.weight"
    table = m.params[name].copy()
    table[17, 1] = bad_id
    path = write_variant(tmp_path / "t.gguf", m, tensors={name: encode(name, table, T.I32)})
    file, cfg = open_target(path)  # the table's values are only read at load
    msg = contract_error(load_target_params, file, cfg, jnp.float32)
    assert_names(msg, path, f"tensor {name}", "expert ids in [0, 8)", str(bad_id))


def test_good_pair_loads(tiny_files):
    import jax.numpy as jnp

    from dsparkjax.model.params import load_drafter_params, load_target_params

    tfile, tcfg = open_target(tiny_files[0])
    dfile, dcfg = open_drafter(tiny_files[1], tcfg)
    tparams = load_target_params(tfile, tcfg, jnp.float32)
    dparams = load_drafter_params(dfile, dcfg, jnp.float32)
    assert tparams.embed.shape == (tcfg.vocab_size, tcfg.hidden_size)
    assert dparams.fc.shape == (dcfg.hidden_size, 3 * dcfg.hidden_size)


# ---------------------------------------------------------------------------------------------------------
# The inspect CLI.


def run_inspect(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "dsparkjax.inspect", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_inspect_cli_good_pair(tiny_files):
    target, draft = tiny_files
    proc = run_inspect(target, "--draft", draft, "--check_bytes")
    assert proc.returncode == 0, proc.stderr
    assert "vocab_size: 512" in proc.stdout
    assert "quant recipe (family -> ggml types found), written as 'f32':" in proc.stdout
    assert "    routed_expert: F32" in proc.stdout
    assert "drafter fits the target: yes" in proc.stdout


def test_inspect_cli_bad_file_exits_1(base, base_target, tmp_path):
    path = write_variant(tmp_path / "bad.gguf", base["drafter"], tensors={
        "token_embd.weight": base["target"].encoded["token_embd.weight"]})
    proc = run_inspect(base_target, "--draft", path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"{path}: tensor token_embd.weight: expected only tensors of the contract" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_inspect_cli_bad_scale_byte(bad_scale_draft, base_target):
    path, name, block = bad_scale_draft
    proc = run_inspect(base_target, f"--draft={path}", "--check_bytes")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"tensor {name}" in proc.stderr and f"block {block}" in proc.stderr
    assert "Traceback" not in proc.stderr
