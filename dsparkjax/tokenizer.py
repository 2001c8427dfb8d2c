"""The byte-level BPE tokenizer of DS4 GGUF files, built from GGUF metadata with the `tokenizers` package.

A DS4 GGUF carries its vocabulary the llama.cpp way: ``tokenizer.ggml.model`` = "gpt2" (byte-level BPE),
``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` ("a b" strings, in priority order),
``tokenizer.ggml.token_type`` (llama.cpp types: 1 normal, 3 control, 4 user-defined, 5 unused, ...),
``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` and optionally ``tokenizer.ggml.pre`` (which
pre-tokenizer regexes split text before BPE) and ``tokenizer.chat_template``. Control tokens are
registered as special tokens and user-defined ones as added tokens, so both are matched whole in the
input text (the chat template relies on this) and only control tokens are dropped by ``skip_special``.
"""

from __future__ import annotations

import codecs
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

from dsparkjax.chat import CONTROL_TOKENS, USER_DEFINED_TOKENS
from dsparkjax.errors import ArgumentError, GGUFContractError, TokenIdError

_K = gguf.Keys.Tokenizer
_MODEL = "gpt2"
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = (int(t) for t in (
    gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.UNUSED))
_VALID_TYPES = frozenset(int(t) for t in gguf.TokenType)

#: llama.cpp's "deepseek-v3" pre-tokenizer (also DeepSeek-V3/V4's tokenizer.json): digits in groups of at
#: most three, runs of CJK ideographs/kana, then a GPT-4-like word/punctuation/space split.
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
#: Supported ``tokenizer.ggml.pre`` values; a missing key means the plain GPT-2 split.
_PRE_TOKENIZERS = ("gpt2", "deepseek-v3")


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer for a ``tokenizer.ggml.pre`` value (validated by the caller)."""
    if pre == "deepseek-v3":
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _DEEPSEEK_V3_SPLITS]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map, in which byte-level BPE tokens are spelled.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 upwards in order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(shifted)}


_CHAR_TO_BYTE = _char_to_byte()


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build it with ``from_metadata`` or ``build_tiny_tokenizer``."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], bos_id: int, eos_id: int,
                 pre: str | None, chat_template: str | None):
        """Wrap already-validated metadata values; use ``from_metadata`` to validate them."""
        self._tokens, self._merges, self._types = tokens, merges, token_types
        self.bos_id, self.eos_id = bos_id, eos_id
        self._pre, self._chat_template = pre, chat_template
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
        self._hf = tokenizers.Tokenizer(bpe)
        self._hf.pre_tokenizer = _pre_tokenizer(pre)
        self._hf.decoder = decoders.ByteLevel()
        typed = list(zip(tokens, token_types))
        self._hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == _CONTROL])
        self._hf.add_tokens([AddedToken(t, special=False, normalized=False)
                             for t, ty in typed if ty == _USER_DEFINED])

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """Build from GGUF key/values; raise GGUFContractError naming ``source`` and the bad key."""
        def fail(key: str, expected: str, found: str) -> GGUFContractError:
            return GGUFContractError(source, key, expected, found)

        def get(key: str) -> Any:
            if key not in meta:
                raise fail(key, "the key to be present", "missing")
            return meta[key]

        def str_list(key: str) -> list[str]:
            value = get(key)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise fail(key, "an array of strings", type(value).__name__)
            return value

        def token_id(key: str, n_tokens: int) -> int:
            value = get(key)
            if not isinstance(value, int) or not 0 <= value < n_tokens:
                raise fail(key, f"a token id in [0, {n_tokens})", repr(value))
            return value

        model = get(_K.MODEL)
        if model != _MODEL:
            raise fail(_K.MODEL, f'"{_MODEL}" (byte-level BPE)', repr(model))
        pre = meta.get(_K.PRE)
        if pre is not None and pre not in _PRE_TOKENIZERS:
            raise fail(_K.PRE, f"one of {_PRE_TOKENIZERS}", repr(pre))

        tokens = str_list(_K.LIST)
        token_set = set(tokens)
        if len(token_set) != len(tokens):
            dup = next(t for t, n in Counter(tokens).items() if n > 1)
            raise fail(_K.LIST, "distinct tokens", f"{dup!r} more than once")
        missing_bytes = [c for c in _CHAR_TO_BYTE if c not in token_set]
        if missing_bytes:
            raise fail(_K.LIST, "all 256 byte-level tokens", f"{len(missing_bytes)} missing, e.g. {missing_bytes[0]!r}")

        merges = str_list(_K.MERGES)
        bad = next((i for i, m in enumerate(merges)
                    if len(parts := m.split(" ")) != 2 or not {*parts, "".join(parts)} <= token_set), None)
        if bad is not None:
            raise fail(_K.MERGES, 'entries "left right" whose parts and result are tokens',
                       f"entry {bad} = {merges[bad]!r}")

        types = get(_K.TOKEN_TYPE)
        if not isinstance(types, list) or len(types) != len(tokens):
            found = f"{len(types)} entries" if isinstance(types, list) else type(types).__name__
            raise fail(_K.TOKEN_TYPE, f"an array of {len(tokens)} entries (one per token in {_K.LIST})", found)
        if not all(isinstance(t, int) and t in _VALID_TYPES for t in types):
            raise fail(_K.TOKEN_TYPE, f"llama.cpp token types {sorted(_VALID_TYPES)}",
                       repr(next(t for t in types if not (isinstance(t, int) and t in _VALID_TYPES))))

        chat_template = meta.get(_K.CHAT_TEMPLATE)
        if chat_template is not None and not isinstance(chat_template, str):
            raise fail(_K.CHAT_TEMPLATE, "a string", type(chat_template).__name__)
        return cls(tokens, merges, types, token_id(_K.BOS_ID, len(tokens)), token_id(_K.EOS_ID, len(tokens)),
                   pre, chat_template)

    def to_metadata(self) -> dict[str, Any]:
        """The GGUF key/values this tokenizer was built from (what a GGUF writer must store)."""
        meta: dict[str, Any] = {
            _K.MODEL: _MODEL,
            _K.LIST: list(self._tokens),
            _K.MERGES: list(self._merges),
            _K.TOKEN_TYPE: list(self._types),
            _K.BOS_ID: self.bos_id,
            _K.EOS_ID: self.eos_id,
        }
        if self._pre is not None:
            meta[_K.PRE] = self._pre
        if self._chat_template is not None:
            meta[_K.CHAT_TEMPLATE] = self._chat_template
        return meta

    def write_to(self, writer: gguf.GGUFWriter) -> None:
        """Add the tokenizer key/values to ``writer`` with their GGUF value types."""
        writer.add_tokenizer_model(_MODEL)
        if self._pre is not None:
            writer.add_tokenizer_pre(self._pre)
        writer.add_token_list(self._tokens)
        writer.add_token_merges(self._merges)
        writer.add_token_types(self._types)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        if self._chat_template is not None:
            writer.add_chat_template(self._chat_template)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (ids are 0 .. vocab_size - 1)."""
        return len(self._tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as in the vocabulary (byte-level characters), or None."""
        return self._hf.token_to_id(token)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it (e.g. from the chat template) become their ids.

        ArgumentError for anything but Unicode text: bytes, or a str holding a lone surrogate (what Python makes
        of a non-UTF-8 byte in a command-line argument, or a JSON ``\\ud800`` escape), which `tokenizers` fails
        on with a bare TypeError.
        """
        if not isinstance(text, str):
            raise ArgumentError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ArgumentError(f"text holds a lone surrogate U+{ord(text[e.start]):04X} at index {e.start}, which is "
                                "no Unicode character (a byte that is not UTF-8?)") from None
        ids = self._hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD. ``skip_special`` drops control tokens."""
        return self._hf.decode([self._checked_id(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (part of a UTF-8 character for some tokens)."""
        return self._token_bytes[self._checked_id(token_id)]

    def incremental_decoder(self, *, skip_special: bool = False) -> IncrementalDecoder:
        """A fresh streaming decoder for one generated sequence."""
        return IncrementalDecoder(self, skip_special=skip_special)

    def _checked_id(self, token_id: int) -> int:
        """``token_id`` as an int, or TokenIdError when it is outside the vocabulary."""
        if not 0 <= int(token_id) < len(self._tokens):
            raise TokenIdError(f"token id {token_id} outside the vocabulary [0, {len(self._tokens)})")
        return int(token_id)

    def _is_control(self, token_id: int) -> bool:
        """Whether ``token_id`` is a control token (what ``skip_special`` drops)."""
        return self._types[token_id] == _CONTROL

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """The bytes each token stands for, following the `tokenizers` ByteLevel decoder: added tokens and
        tokens with characters outside the byte alphabet are their own UTF-8, others map char by char."""
        def to_bytes(token: str, ty: int) -> bytes:
            if ty in (_CONTROL, _USER_DEFINED) or any(c not in _CHAR_TO_BYTE for c in token):
                return token.encode("utf-8")
            return bytes(_CHAR_TO_BYTE[c] for c in token)
        return [to_bytes(t, ty) for t, ty in zip(self._tokens, self._types)]


class IncrementalDecoder:
    """Turns a stream of token ids into text, returning only newly completed characters.

    A multi-byte UTF-8 character split over several tokens comes out whole with the token that completes it;
    ``flush`` ends the stream (pending bytes of an unfinished character become U+FFFD). One per sequence.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer, self._skip_special = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        token_id = self._tokenizer._checked_id(token_id)
        if self._skip_special and self._tokenizer._is_control(token_id):
            return ""
        return self._utf8.decode(self._tokenizer._token_bytes[token_id])

    def flush(self) -> str:
        """End the stream and return whatever is still held back."""
        return self._utf8.decode(b"", final=True)


_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tokenizer turns text into numbers, and a language model "
    "turns those numbers into the next number. The model reads the prompt, thinks for a while, and answers.",
    "Speculative decoding lets a small drafter guess several tokens ahead; the target model checks them all "
    "in one pass and keeps the longest prefix it agrees with. When the guesses are good, generation is faster "
    "and the output is exactly the same as without the drafter.",
    "User: What is two plus two?\nAssistant: Two plus two is 4. 1234567890 tokens, 3.14159 and 2.71828.\n"
    "def add(a, b):\n    return a + b\n",
    "Le café est très chaud, déjà servi à la crème. Über den Wolken muss die Freiheit grenzenlos sein. "
    "¿Dónde está la estación? Ação, coração, São Paulo. Zażółć gęślą jaźń.",
    "Καλημέρα κόσμε. Η γλώσσα είναι ένα σύστημα επικοινωνίας. Ευχαριστώ πολύ.",
    "你好，世界。今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。日本語のテキストも少し：こんにちは、ありがとう。",
    "Emoji too: 🦊 the fox, 🚀 the rocket, 👍 thumbs up. 🦊🦊 two foxes!",
)


def build_tiny_tokenizer(vocab_size: int = 512, corpus: Iterable[str] = _TINY_CORPUS, *,
                         reserved: int = 0) -> Tokenizer:
    """A deterministic byte-level BPE of exactly ``vocab_size`` tokens for tiny models.

    Trained with `tokenizers`' BpeTrainer on ``corpus`` (default: a small built-in multilingual one, for the
    random test models), with the DeepSeek-V3 pre-tokenizer. Ids: 0 = BOS ``<｜begin▁of▁sentence｜>``, 1 = EOS
    ``<｜end▁of▁sentence｜>``, then the other chat-template tokens, the 256 byte tokens and the learned merges;
    the last ``reserved`` ids and any room the corpus leaves are unused ``[PADn]`` tokens (as llama.cpp's
    converter pads), e.g. for a drafter's MASK token that text never produces.
    """
    specials = [*CONTROL_TOKENS, *USER_DEFINED_TOKENS]
    minimum = len(specials) + len(_CHAR_TO_BYTE) + reserved
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is too small: the tiny tokenizer needs at least {minimum} "
                         f"({len(specials)} special tokens + 256 byte tokens + {reserved} reserved)")
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = _pre_tokenizer("deepseek-v3")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - reserved, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(corpus, trainer=trainer)
    trained = json.loads(hf.to_str())["model"]
    tokens = sorted(trained["vocab"], key=trained["vocab"].get)
    if tokens[:len(specials)] != specials or [trained["vocab"][t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError("BpeTrainer did not number the special tokens first and the vocabulary densely")
    merges = [m if isinstance(m, str) else " ".join(m) for m in trained["merges"]]  # older tokenizers: "a b"
    n_pad = vocab_size - len(tokens)
    types = ([_CONTROL] * len(CONTROL_TOKENS) + [_USER_DEFINED] * len(USER_DEFINED_TOKENS)
             + [_NORMAL] * (len(tokens) - len(specials)) + [_UNUSED] * n_pad)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    meta = {_K.MODEL: _MODEL, _K.PRE: "deepseek-v3", _K.LIST: tokens, _K.MERGES: merges, _K.TOKEN_TYPE: types,
            _K.BOS_ID: 0, _K.EOS_ID: 1}
    return Tokenizer.from_metadata(meta, source="<tiny tokenizer>")
