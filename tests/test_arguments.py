"""Bad arguments to the public API are refused up front, with an error naming the argument (issue 41)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from model_helpers import tiny_target_model

from dsparkjax.decoding.forward import forward
from dsparkjax.decoding.generate import generate
from dsparkjax.decoding.proposer import load_drafter
from dsparkjax.errors import ArgumentError, DsparkError, TokenIdError
from dsparkjax.target_api import load_target


@pytest.fixture(scope="module")
def target():
    return tiny_target_model()


def test_float_token_ids_are_refused(target):
    with pytest.raises(ArgumentError, match="prompt 1 must hold integer token ids, got dtype float64"):
        generate(target, [[1, 2], [3.0, 4.5]])
    with pytest.raises(ArgumentError, match="token_ids must hold integer token ids"):
        forward(target, [[1.5, 2.0]])


def test_ragged_prompts_are_refused_where_rows_must_be_rectangular(target):
    with pytest.raises(ArgumentError, match="token_ids must be a rectangular array .* different lengths"):
        forward(target, [[1, 2, 3], [4]])
    with pytest.raises(ArgumentError, match="prompt 0 must be a rectangular array"):
        generate(target, [[1, [2, 3]]])


@pytest.mark.parametrize("ids, first", [
    (np.array([5, 2**64 - 1], np.uint64), 2**64 - 1),  # wrapped to -1 in int64: the error named id -1
    ([5, 2**63], 2**63),  # numpy makes it uint64: wrapped the same way
    ([2**63, -1], 2**63),  # numpy makes it float64: "must hold integer token ids, got dtype float64"
    ([5, 2**70], 2**70),  # numpy makes it an object array: "ragged or mixed rows"
    ([5, -(2**70)], -(2**70)),
])
def test_token_ids_past_int64_are_named(target, ids, first):
    with pytest.raises(ArgumentError, match=f"prompt 0 holds token id {first}, outside the int64 range"):
        generate(target, [ids])
    with pytest.raises(ArgumentError, match=f"token_ids holds token id {first}, outside the int64 range"):
        forward(target, [ids])


def test_string_prompts_are_refused(target):
    with pytest.raises(ArgumentError, match="prompts must be a list of token-id lists, got str"):
        generate(target, "hello")
    with pytest.raises(ArgumentError, match="prompt 0 must be token ids .*got a string: tokenize it first"):
        generate(target, ["hello"])
    with pytest.raises(ArgumentError, match="prompt 0 must hold integer token ids, got strings"):
        generate(target, [["a", "b"]])


@pytest.mark.parametrize("value", [2.5, 2.0, 0, -3, True, "4"])
def test_max_new_tokens_must_be_a_positive_integer(target, value):
    with pytest.raises(ArgumentError, match=f"max_new_tokens must be an integer >= 1, got {value!r}"):
        generate(target, [[1, 2]], max_new_tokens=value)


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_prefill_chunk_must_be_a_positive_integer(target, value):
    with pytest.raises(ArgumentError, match=f"prefill_chunk must be an integer >= 1, got {value!r}"):
        generate(target, [[1, 2]], prefill_chunk=value)
    with pytest.raises(ArgumentError, match=f"chunk must be an integer >= 1, got {value!r}"):
        forward(target, [[1, 2]], chunk=value)


def test_a_target_passed_as_the_drafter_is_refused(target):
    with pytest.raises(ArgumentError, match="drafter must be a Proposer .*got Target .*lacks block_size"):
        generate(target, [[1, 2]], drafter=target)


@pytest.mark.parametrize("argument", ["mode", "verify"])
def test_unknown_mode_or_verification_is_refused(target, argument):
    with pytest.raises(ArgumentError, match=f"{argument} must be one of .*got 'bogus'"):
        generate(target, [[1, 2]], **{argument: "bogus"})


@pytest.mark.parametrize("value", [math.nan, -0.5, math.inf, "hot"])
def test_temperature_must_be_finite_and_not_negative(target, value):
    with pytest.raises(ArgumentError, match="temperature must be a finite number >= 0"):
        generate(target, [[1, 2]], temperature=value)


@pytest.mark.parametrize("value, held", [(1e300, "inf"), (1e-300, "0.0"),
                                         (1e-39, "1.0000002153053333e-39, a subnormal XLA flushes to 0")])
def test_a_temperature_float32_does_not_hold_is_refused(target, value, held):
    """float32 rows made 1e300 inf (uniform sampling), and 1e-300 zero and 1e-39 a subnormal that XLA flushes to
    zero (both silently greedy)."""
    message = re.escape(f"temperature {value!r} does not survive float32 (it becomes {held})")
    with pytest.raises(ArgumentError, match=message):
        generate(target, [[1, 2]], temperature=value)


def test_forward_past_the_context_length_is_refused(target):
    too_long = [[1] * (target.config.context_length + 1)]
    with pytest.raises(ArgumentError, match=f"token_ids: {target.config.context_length + 1} positions; forward "
                                            f"runs 1 to the context length {target.config.context_length}"):
        forward(target, too_long)
    with pytest.raises(ArgumentError, match="exceeds the context length"):
        generate(target, [[1, 2]], max_new_tokens=target.config.context_length)


def test_out_of_range_token_ids_are_refused(target):
    with pytest.raises(TokenIdError, match="prompt 1: id 600 is outside the vocabulary"):
        generate(target, [[1], [600]])
    with pytest.raises(TokenIdError, match="token ids: id -1 is outside the vocabulary"):
        forward(target, [[3, -1]])


def test_numpy_integer_arguments_are_taken_as_ints(target):
    """np.int64 is an integer like int (a length read from an array): it must run, not fail deep inside."""
    results = generate(target, np.array([[1, 2]]), max_new_tokens=np.int64(2), prefill_chunk=np.int32(4))
    assert len(results[0].token_ids) == 2


@pytest.mark.parametrize("stops, match", [
    ([600], "stop_tokens: id 600 is outside the vocabulary"),
    ([-1], "stop_tokens: id -1 is outside the vocabulary"),
    ([1.5], "stop_tokens must hold integer token ids"),
    ("ab", "stop_tokens must be token ids .*got a string"),
    (7, r"stop_tokens must have 1 axes of token ids, got shape \(\)"),
])
def test_stop_tokens_must_be_ids_in_the_vocabulary(target, stops, match):
    """A stop token that can never be emitted (or is no token) would silently never stop a sequence."""
    with pytest.raises(DsparkError, match=match):
        generate(target, [[1, 2]], stop_tokens=stops)


def test_on_token_must_be_callable(target):
    with pytest.raises(ArgumentError, match="on_token must be a callable .*got int"):
        generate(target, [[1, 2]], on_token=5)


def test_a_path_passed_as_the_target_is_refused(target):
    with pytest.raises(ArgumentError, match="target must be a Target such as load_target.*got str"):
        generate(target.path, [[1, 2]])
    with pytest.raises(ArgumentError, match="target must be a Target such as load_target.*got str"):
        forward(target.path, [[1, 2]])


def test_prefill_chunk_beyond_the_context_length_is_refused(target):
    """A chunk longer than any prompt can be would size the prefill program past memory (a raw OOM)."""
    chunk = target.config.context_length + 1
    with pytest.raises(ArgumentError, match=f"prefill_chunk {chunk} exceeds the context length"):
        generate(target, [[1, 2]], prefill_chunk=chunk)


def test_forward_of_no_sequences_is_refused(target):
    with pytest.raises(ArgumentError, match=r"token_ids: no sequences \(shape \(0, 3\)\)"):
        forward(target, np.zeros((0, 3), np.int64))


@pytest.mark.parametrize("option, value, match", [
    ("dtype", ["float32"], r"dtype must be one of 'float32', 'bfloat16', got \['float32'\]"),  # was a TypeError
    ("kernels", "cuda", "kernels must be one of 'auto', 'dequantize', 'ffi', 'reference', got 'cuda'"),
    ("policy", "fast", "policy must be a KernelPolicy .*got str"),
    ("simulate_qat", "no", "simulate_qat must be True or False, got 'no'"),  # a string read as true
    ("scan_layers", 1, "scan_layers must be True or False, got 1"),
    ("progress", None, "progress must be True or False, got None"),
])
def test_load_target_options_are_checked(tiny_files, option, value, match):
    with pytest.raises(ArgumentError, match=match):
        load_target(tiny_files[0], **{option: value})


def test_load_drafter_needs_a_loaded_target(tiny_files):
    with pytest.raises(ArgumentError, match="target must be a Target such as load_target.*got str"):
        load_drafter(tiny_files[1], tiny_files[0])
