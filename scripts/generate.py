"""Batched generation from the command line: plain (AR) or DSpark speculative, greedy or sampled.

    python scripts/generate.py                         # speculative, on the embedded tiny pair
    python scripts/generate.py --target T.gguf --draft D.gguf --prompt "Hello" --prompt "Bonjour"
    python scripts/generate.py --mode ar --verify fast --prompts_file prompts.jsonl --output out.jsonl
    python scripts/generate.py --temperature 0.7 --top_p 0.95 --seed 1 --verify lossless

Prompts are text (tokenized with the target's own tokenizer; `--chat` applies the DeepSeek-V4 template) or
token ids (`--prompt_ids 1,2,3`). Prints each sequence's text, tok/s, steps and matched/offered, the mean
accepted length, and with `--output` writes one JSON object per sequence.
"""

from __future__ import annotations

import json
import sys
import time

from absl import flags, logging

from dsparkjax import chat, cli_inputs, runtime
from dsparkjax.decoding.generate import generate
from dsparkjax.pair import load_pair
from dsparkjax.errors import DsparkError

DEFAULT_PROMPTS = (  # the embedded pair writes Python (it was trained on the standard library)
    "import os\nimport sys\n\n\ndef main(",
    "class Parser:\n    def __init__(self, text):\n",
    "    for i in range(len(items)):\n",
)

_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: the embedded tiny target).")
_DRAFT = flags.DEFINE_string("draft", None, "DSpark drafter GGUF (default: the embedded tiny drafter).")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A text prompt (repeatable).")
_PROMPT_IDS = flags.DEFINE_multi_string("prompt_ids", [], "A prompt as comma-separated token ids (repeatable).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "Prompts file: one per line, or JSONL with chat messages.")
flags.DEFINE_alias("prompts-file", "prompts_file")
_CHAT = flags.DEFINE_bool("chat", False, "Apply the DeepSeek-V4 chat template to text prompts.")
_THINKING = flags.DEFINE_bool("thinking", False, "With --chat: open a thinking block in the generation prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per prompt.", lower_bound=1)
_MODE = flags.DEFINE_enum("mode", "spec", ["spec", "ar"], "Speculative (with the drafter) or plain decoding.")
_VERIFY = flags.DEFINE_enum("verify", "exact", ["exact", "fast", "lossless"],
                            "exact: token-identical to AR (greedy or sampled with the same seed); fast: per-q "
                            "programs; lossless: when sampling, the target's distribution with more accepted.")
_Q = flags.DEFINE_string("q", "adaptive", "Verify width: 'adaptive' or a fixed 1..block_size+1.")
# its upper bound is the drafter's, known once it loads; the form is checked before anything loads
flags.register_validator("q", lambda q: q == "adaptive" or (q.isascii() and q.isdigit() and int(q) >= 1),
                         "--q must be 'adaptive' or an integer >= 1")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_QAT = flags.DEFINE_bool("simulate_qat", True, "FP8 KV / FP4 indexer rounding of the official model.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample from the most likely tokens holding this mass (1: all).")
_MIN_P = flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p times the most likely one's probability.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed: prompt i samples with seed + i.")
_OUTPUT = flags.DEFINE_string("output", None, "Write one JSON object per sequence to this file.")


def _prompt_inputs() -> tuple[list[chat.Prompt], list[tuple[str, list[int]]]]:
    """Text prompts and (shown, ids) id prompts from the flags, checked before any model loads.

    The demo prompts run only when no prompt flag is given at all.
    """
    texts = [chat.Prompt(text=t) for t in _PROMPT.value]
    if _PROMPTS_FILE.value is not None:
        texts += cli_inputs.read_prompts_file(_PROMPTS_FILE.value)
    id_prompts = [(ids, cli_inputs.parse_prompt_ids(ids)) for ids in _PROMPT_IDS.value]
    if not texts and not id_prompts:
        texts = [chat.Prompt(text=t) for t in DEFAULT_PROMPTS]
    return texts, id_prompts


def _prompts(tokenizer, texts: list[chat.Prompt], id_prompts: list[tuple[str, list[int]]]
             ) -> list[tuple[str, list[int]]]:
    """(display text, token ids) per prompt: the text prompts tokenized, then the id prompts."""
    if texts and tokenizer is None:
        raise DsparkError("text prompts need a tokenizer in the target GGUF; pass --prompt_ids instead")
    prompts: list[tuple[str, list[int]]] = []
    for p in texts:
        rendered = p.render(chat_template=_CHAT.value or p.messages is not None, thinking=_THINKING.value)
        prompts.append((rendered, tokenizer.encode(rendered, add_bos=not (_CHAT.value or p.messages))))
    return prompts + id_prompts


def _banner(index: int, ids: list[int]) -> str:
    return f"=== prompt {index + 1} ({len(ids)} tokens), then the generated text ==="


def _generated(text: str) -> str:
    """The generated part of a sequence, in bold on a terminal (the text reads on from its prompt)."""
    return f"\033[1m{text}\033[0m" if sys.stdout.isatty() else text


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # keep library INFO logs (gguf writer, jax backends) off the output
    texts, id_prompts = _prompt_inputs()
    if _OUTPUT.value is not None:
        cli_inputs.check_output_path(_OUTPUT.value)
    params, seed = cli_inputs.sampling_flags(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _MIN_P.value,
                                             _SEED.value)
    runtime.configure()  # before JAX starts: device memory for a full-size model, the compilation cache
    if _MODE.value == "spec" and _TARGET.value is not None and not _DRAFT.value:
        raise DsparkError("--mode spec needs --draft")
    target, drafter, _, _ = load_pair(_TARGET.value, _DRAFT.value, progress=True, dtype=_DTYPE.value,
                                      simulate_qat=_QAT.value)
    prompts = _prompts(target.tokenizer, texts, id_prompts)
    tok = target.tokenizer
    decoders = [tok.incremental_decoder() if tok else None for _ in prompts]
    streamed = [""] * len(prompts)

    def on_token(index: int, token: int) -> None:
        piece = decoders[index].push(token) if decoders[index] else f" {token}"
        streamed[index] += piece
        if len(prompts) == 1:
            print(_generated(piece), end="", flush=True)

    if len(prompts) == 1:
        print(_banner(0, prompts[0][1]))
        print(prompts[0][0], end="", flush=True)
    start = time.perf_counter()
    results = generate(target, [ids for _, ids in prompts], drafter=drafter, max_new_tokens=_MAX_NEW.value,
                       verify=_VERIFY.value, width=_Q.value, on_token=on_token, mode=_MODE.value,
                       temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       min_p=params.min_p, seed=seed, progress=True)
    elapsed = time.perf_counter() - start
    for i, dec in enumerate(decoders):
        if dec is not None:
            streamed[i] += dec.flush()
    print()
    total = sum(len(r.token_ids) for r in results)
    rows = []
    for i, ((shown, ids), r, text) in enumerate(zip(prompts, results, streamed)):
        rate = f"{r.matched}/{r.offered}" if r.offered else "-"
        if len(prompts) > 1:  # a single prompt's text was streamed above
            print(_banner(i, ids))
            print(shown + _generated(text))
        print(f"--- {len(r.token_ids)} tokens, {r.tok_per_s:.1f} tok/s, {r.steps} steps, matched/offered {rate}, "
              f"stop: {r.stop_reason}")
        rows.append(dict(prompt=shown, prompt_ids=ids, text=text, token_ids=r.token_ids, matched=r.matched,
                         offered=r.offered, steps=r.steps, tok_per_s=r.tok_per_s, stop_reason=r.stop_reason,
                         mean_accepted=r.mean_accepted))
    steps = sum(r.steps for r in results)
    mean_accepted = (sum(r.matched for r in results) + steps) / max(steps, 1)
    print(f"mode={_MODE.value} verify={_VERIFY.value} q={_Q.value}: {total} tokens in {elapsed:.2f}s "
          f"({total / elapsed:.1f} tok/s incl. compile), mean accepted length {mean_accepted:.2f} tokens/step")
    if _OUTPUT.value is not None:
        with open(_OUTPUT.value, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    cli_inputs.run_main(main)
