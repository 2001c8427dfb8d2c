"""Bad command-line inputs of scripts/generate.py end in a clear error naming the flag and file, before any
model loads (dsparkjax/cli_inputs.py; issue 41)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsparkjax.cli_inputs import CliInputError, check_output_path, parse_prompt_ids, read_prompts_file, sampling_flags
from dsparkjax.decoding.sampling import SamplingParams

GENERATE = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"


def test_prompts_file_reads_text_and_jsonl(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("héllo\n\n  \nworld\n", encoding="utf-8")
    assert [p.text for p in read_prompts_file(str(text))] == ["héllo", "world"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n', encoding="utf-8")
    prompts = read_prompts_file(str(jsonl))
    assert prompts[0].text == "a" and prompts[1].messages is not None


@pytest.mark.parametrize("content, match", [
    (b"", "holds no prompts"),
    (b"\n  \n\t\n", "holds no prompts"),
    (b"ok\n\xff\xfe bad\n", r"not UTF-8 text \(byte 0xff at offset 3, line 2\)"),
    (b'{"prompt": "a"}\n{"prompt": 3}\n', r'p\.txt:2: "prompt" must be a string'),
    (b'{"prompt": "a"\n', r"p\.txt:1: malformed JSON"),
])
def test_prompts_file_refuses_bad_content(tmp_path, content, match):
    path = tmp_path / "p.txt"
    path.write_bytes(content)
    with pytest.raises(CliInputError, match=match) as err:
        read_prompts_file(str(path))
    assert "--prompts_file" in str(err.value) and str(path) in str(err.value)


def test_prompts_file_refuses_missing_paths(tmp_path):
    with pytest.raises(CliInputError, match=r"--prompts_file .*nope\.txt: no such file"):
        read_prompts_file(str(tmp_path / "nope.txt"))
    with pytest.raises(CliInputError, match="--prompts_file .*: not a regular file"):
        read_prompts_file(str(tmp_path))
    with pytest.raises(CliInputError, match="--prompts_file is empty"):
        read_prompts_file("")


def test_prompt_ids_parse():
    assert parse_prompt_ids("1,2,3") == [1, 2, 3]
    assert parse_prompt_ids(" 7 , 0 ") == [7, 0]


@pytest.mark.parametrize("value, match", [
    ("", "no token ids"),
    (" ", "no token ids"),
    ("1,,2", r"item 2 \(''\)"),
    ("1,2,", r"item 3 \(''\)"),
    ("1.5", r"item 1 \('1\.5'\)"),
    ("3,-1", r"item 2 \('-1'\)"),
    ("1;2", r"item 1 \('1;2'\)"),
    ("abc", r"item 1 \('abc'\)"),
    ("١", r"item 1"),  # a non-ASCII digit
])
def test_prompt_ids_refuse_malformed_values(value, match):
    with pytest.raises(CliInputError, match=match) as err:
        parse_prompt_ids(value)
    assert str(err.value).startswith(f"--prompt_ids {value!r}")


def test_output_path_checks(tmp_path):
    check_output_path(str(tmp_path / "out.jsonl"))  # new file in an existing directory
    (tmp_path / "old.jsonl").write_text("x")
    check_output_path(str(tmp_path / "old.jsonl"))  # overwriting an existing file
    with pytest.raises(CliInputError, match=r"--output .*missing/out\.jsonl: directory .*missing does not exist"):
        check_output_path(str(tmp_path / "missing" / "out.jsonl"))
    with pytest.raises(CliInputError, match="--output .*: is a directory"):
        check_output_path(str(tmp_path))
    with pytest.raises(CliInputError, match="--output is empty"):
        check_output_path("")


def test_sampling_flags():
    assert sampling_flags(0.7, 40, 0.9, 0.05, 3) == (SamplingParams(0.7, 40, 0.9, 0.05), 3)
    for args, match in [((-1.0, 0, 1.0, 0.0, 0), "--temperature must be a finite number >= 0"),
                        ((1.0, -2, 1.0, 0.0, 0), "--top_k must be an integer >= 0"),
                        ((1.0, 0, 1.5, 0.0, 0), r"--top_p must be in \(0, 1\]"),
                        ((1.0, 0, 1.0, 2.0, 0), r"--min_p must be in \[0, 1\]"),
                        ((1.0, 0, 1.0, 0.0, -1), r"--seed must be an integer in \[0, 2\*\*32\)")]:
        with pytest.raises(CliInputError, match=match):
            sampling_flags(*args)


@pytest.mark.parametrize("flags, expected", [
    (["--prompts_file={tmp}/missing.txt"], "error: --prompts_file {tmp}/missing.txt: no such file"),
    (["--prompts_file={tmp}/empty.txt"], "error: --prompts_file {tmp}/empty.txt: holds no prompts"),
    (["--prompt_ids=1,x"], "error: --prompt_ids '1,x': item 2 ('x') is not a non-negative integer token id"),
    (["--prompt_ids=1", "--output={tmp}/no/such/dir/out.jsonl"],
     "error: --output {tmp}/no/such/dir/out.jsonl: directory {tmp}/no/such/dir does not exist"),
    (["--prompt_ids=1", "--temperature=0.7", "--top_p=0"], "error: --top_p must be in (0, 1] (1: off), got 0.0"),
    (["--prompt_ids=1", "--max_new_tokens=0"], "flag --max_new_tokens=0: 0 is not a positive integer"),
    (["--prompt_ids=1", "--q=0"], "flag --q=0: --q must be 'adaptive' or an integer >= 1"),
    (["--prompt_ids=1", "--q=wide"], "flag --q=wide: --q must be 'adaptive' or an integer >= 1"),
])
def test_generate_script_refuses_bad_inputs_before_loading(tmp_path, flags, expected):
    """Exit status 1, one clear line, no traceback, and nothing loaded or generated (so it is quick)."""
    (tmp_path / "empty.txt").write_bytes(b"")
    args = [f.format(tmp=tmp_path) for f in flags]
    proc = subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert expected.format(tmp=tmp_path) in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
