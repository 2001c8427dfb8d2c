"""Tokenizer from GGUF metadata, streaming decode, the DeepSeek-V4 chat template and prompts files."""

from __future__ import annotations

import gguf
import pytest

from dsparkjax.chat import Prompt, load_prompts, render_chat
from dsparkjax.errors import ArgumentError, GGUFContractError, TokenIdError
from dsparkjax.ggufio import open_gguf
from dsparkjax.tokenizer import Tokenizer, build_tiny_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TEXT = "Héllo wörld, καλημέρα! 你好，世界。🦊 naïve café 12345\n\tend"


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return build_tiny_tokenizer(512)


@pytest.fixture(scope="module")
def from_gguf(tiny: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer written into a GGUF with GGUFWriter and read back with GGUFReader."""
    path = tmp_path_factory.mktemp("gguf") / "tok.gguf"
    writer = gguf.GGUFWriter(path, arch="deepseek4")
    tiny.write_to(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_metadata(open_gguf(path).metadata, str(path))


# --- tokenizer ------------------------------------------------------------------------------------


def test_tiny_tokenizer_layout_and_determinism(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 512
    assert (tiny.bos_id, tiny.eos_id) == (0, 1)
    assert tiny.token_to_id(BOS) == 0 and tiny.token_to_id(EOS) == 1
    assert tiny.token_to_id("<｜User｜>") == 2 and tiny.token_to_id("</think>") == 5
    assert tiny.token_to_id("not a token") is None
    assert build_tiny_tokenizer(512).to_metadata() == tiny.to_metadata()
    padded = build_tiny_tokenizer(4096)  # more room than the corpus has merges: padded with unused tokens
    assert padded.vocab_size == 4096 and padded.to_metadata()["tokenizer.ggml.token_type"][-1] == 5
    with pytest.raises(ValueError, match="too small"):
        build_tiny_tokenizer(100)


def test_gguf_round_trip(tiny: Tokenizer, from_gguf: Tokenizer) -> None:
    assert from_gguf.to_metadata() == tiny.to_metadata()
    assert from_gguf.encode(TEXT) == tiny.encode(TEXT)


@pytest.mark.parametrize("text", [TEXT, "", " ", "a", "🦊🦊🦊", "𝄞 unseen", "é" * 7, "line\r\nbreak  spaces "])
def test_encode_decode_round_trip(from_gguf: Tokenizer, text: str) -> None:
    ids = from_gguf.encode(text)
    assert from_gguf.decode(ids) == text
    assert from_gguf.encode(text, add_bos=True) == [from_gguf.bos_id, *ids]


@pytest.mark.parametrize("text, match", [
    ("ab\udcffc", "lone surrogate U[+]DCFF at index 2"),  # a non-UTF-8 byte of a command-line argument
    (b"abc", "text must be a str, got bytes"),
])
def test_encode_refuses_what_is_no_text(from_gguf: Tokenizer, text, match) -> None:
    """The tokenizers library raised a bare TypeError for both."""
    with pytest.raises(ArgumentError, match=match):
        from_gguf.encode(text)


def test_special_tokens_are_single_ids(from_gguf: Tokenizer) -> None:
    prompt = render_chat([{"role": "user", "content": "Hi"}], thinking=True)
    ids = from_gguf.encode(prompt)
    names = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>"]
    assert [i for i in ids if i < 6] == [from_gguf.token_to_id(n) for n in names]
    assert from_gguf.decode(ids) == prompt
    assert from_gguf.decode(ids, skip_special=True) == "Hi<think>"  # <think> is user-defined, not control


def test_decode_rejects_unknown_ids(from_gguf: Tokenizer) -> None:
    with pytest.raises(TokenIdError):
        from_gguf.decode([3, 512])
    with pytest.raises(TokenIdError):
        from_gguf.incremental_decoder().push(-1)


def test_incremental_decoding_holds_back_split_characters(from_gguf: Tokenizer) -> None:
    # A character absent from the training corpus stays as one token per UTF-8 byte.
    clef = "𝄞"
    ids = from_gguf.encode(clef)
    assert len(ids) == len(clef.encode()) == 4
    decoder = from_gguf.incremental_decoder()
    assert [decoder.push(i) for i in ids] == ["", "", "", clef]
    assert decoder.flush() == ""

    truncated = from_gguf.incremental_decoder()
    assert [truncated.push(i) for i in ids[:2]] == ["", ""]
    assert truncated.flush() == "\ufffd"


def test_incremental_decoding_matches_decode(from_gguf: Tokenizer) -> None:
    text = render_chat([{"role": "user", "content": TEXT + " 𝄞"}]) + "Antwort: Ça va 🦊" + EOS
    ids = from_gguf.encode(text)
    for skip in (False, True):
        decoder = from_gguf.incremental_decoder(skip_special=skip)
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == from_gguf.decode(ids, skip_special=skip)
        assert "\ufffd" not in "".join(pieces)


# --- malformed metadata ---------------------------------------------------------------------------


def _broken(tiny: Tokenizer, **changes: object) -> dict:
    meta = tiny.to_metadata()
    for key, value in changes.items():
        key = "tokenizer.ggml." + key
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    return meta


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"merges": None}, "tokenizer.ggml.merges"),
        ({"merges": ["a b", "nospace"]}, "tokenizer.ggml.merges"),
        ({"merges": ["a b", "zq qz"]}, "tokenizer.ggml.merges"),
        ({"token_type": [1, 1, 3]}, "tokenizer.ggml.token_type"),
        ({"bos_token_id": 512}, "tokenizer.ggml.bos_token_id"),
        ({"eos_token_id": None}, "tokenizer.ggml.eos_token_id"),
        ({"model": "llama"}, "tokenizer.ggml.model"),
        ({"pre": "qwen2"}, "tokenizer.ggml.pre"),
    ],
)
def test_malformed_metadata_names_the_key(tiny: Tokenizer, changes: dict, key: str) -> None:
    with pytest.raises(GGUFContractError) as info:
        Tokenizer.from_metadata(_broken(tiny, **changes), "model.gguf")
    assert info.value.what == key and info.value.path == "model.gguf"
    assert key in str(info.value)


def test_token_types_length_mismatch_message(tiny: Tokenizer) -> None:
    meta = _broken(tiny, token_type=tiny.to_metadata()["tokenizer.ggml.token_type"][:-1])
    with pytest.raises(GGUFContractError, match=r"token_type: expected an array of 512 entries .*found 511 entries"):
        Tokenizer.from_metadata(meta, "model.gguf")


# --- chat template --------------------------------------------------------------------------------

U, A = "<｜User｜>", "<｜Assistant｜>"


def test_chat_template_single_turn() -> None:
    hi = [{"role": "user", "content": "Hi"}]
    assert render_chat(hi) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert render_chat(hi, thinking=True) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
    assert render_chat(hi, add_generation_prompt=False) == "<｜begin▁of▁sentence｜><｜User｜>Hi"


def test_chat_template_system_message() -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}]
    assert render_chat(msgs) == BOS + "You are terse." + U + "2+2?" + A + "</think>"
    assert render_chat(msgs, thinking=True) == BOS + "You are terse." + U + "2+2?" + A + "<think>"
    # default_system only fills in a missing system turn
    assert render_chat(msgs, default_system="Be kind.") == render_chat(msgs)
    assert render_chat(msgs[1:], default_system="Be kind.") == BOS + "Be kind." + U + "2+2?" + A + "</think>"


def test_chat_template_multi_turn_drops_old_reasoning() -> None:
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "2+2?"},
    ]
    expected_history = BOS + U + "Hi" + A + "</think>" + "Hello!" + EOS + U + "2+2?" + A
    assert render_chat(msgs) == expected_history + "</think>"
    assert render_chat(msgs, thinking=True) == expected_history + "<think>"
    # the reasoning of an assistant turn after the last user turn is kept in thinking mode
    done = msgs + [{"role": "assistant", "content": "4", "reasoning_content": "add"}]
    assert render_chat(done, thinking=True) == expected_history + "<think>" + "add</think>4" + EOS
    assert render_chat(done) == expected_history + "</think>" + "4" + EOS


def test_chat_template_rejects_bad_messages() -> None:
    with pytest.raises(ValueError, match="role"):
        render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        render_chat([{"role": "user", "content": None}])


# --- prompts files --------------------------------------------------------------------------------


def test_load_text_prompts(tmp_path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("First prompt\n\n   \nSecond: {not json} 🦊\n", encoding="utf-8")
    prompts = load_prompts(path)
    assert prompts == [Prompt(text="First prompt"), Prompt(text="Second: {not json} 🦊")]
    assert prompts[0].render(chat_template=False) == "First prompt"
    assert prompts[0].render(thinking=True) == BOS + U + "First prompt" + A + "<think>"


def test_load_jsonl_prompts(tmp_path) -> None:
    path = tmp_path / "prompts.txt"  # detected as JSONL from its first line
    path.write_text(
        '{"prompt": "raw text"}\n\n'
        '{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}\n',
        encoding="utf-8",
    )
    raw, chat = load_prompts(path)
    assert raw == Prompt(text="raw text")
    assert chat.render() == BOS + "S" + U + "Q" + A + "</think>"
    with pytest.raises(ValueError, match="cannot bypass"):
        chat.render(chat_template=False)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "unterminated}', "malformed JSON"),
        ('{"text": "x"}', "exactly one of"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(path)
    assert f"{path}:3:" in str(info.value)
