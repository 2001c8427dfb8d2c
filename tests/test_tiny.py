"""The tiny target + drafter generator (dsparkjax.tiny): deterministic, a quick CLI, contract-valid files; the DS4
presets it writes at full size for the benchmarks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dsparkjax.config import check_drafter_fits_target, deepseek_v4_flash, dspark_flash, tiny_drafter, tiny_target
from dsparkjax.errors import DsparkError
from dsparkjax.ggufio import open_drafter, open_target
from dsparkjax.tiny import tiny_pair, write_tiny_pair

REPO = Path(__file__).resolve().parents[1]


def _f32(cfg):
    """`cfg` with its floats as float32 stores them (GGUF metadata floats are F32)."""
    def cast(v):
        return float(np.float32(v)) if isinstance(v, float) else tuple(map(cast, v)) if isinstance(v, tuple) else v
    return dataclasses.replace(cfg, **{f.name: cast(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})


def test_tiny_pair_is_deterministic(tiny_params):
    again = tiny_pair(0)
    assert again[0] == tiny_params[0] and again[2] == tiny_params[2]
    for mine, theirs in ((again[1], tiny_params[1]), (again[3], tiny_params[3])):
        assert list(mine) == list(theirs)
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)
    other = tiny_pair(1)
    assert not np.array_equal(other[1]["token_embd.weight"], tiny_params[1]["token_embd.weight"])
    assert not np.array_equal(other[3]["dflash.fc.weight"], tiny_params[3]["dflash.fc.weight"])


def test_same_seed_writes_identical_files(tiny_files, tmp_path):
    again = write_tiny_pair(str(tmp_path / "again"), seed=0)
    other = write_tiny_pair(str(tmp_path / "other"), seed=1)
    for first, second, third in zip(tiny_files, again, other):
        assert Path(first).read_bytes() == Path(second).read_bytes()
        assert Path(first).read_bytes() != Path(third).read_bytes()


def test_written_pair_satisfies_both_contracts(tiny_files, tiny_params):
    tcfg, tparams, dcfg, dparams = tiny_params
    tfile, read_t = open_target(tiny_files[0])
    dfile, read_d = open_drafter(tiny_files[1], read_t)  # with the compatibility check
    assert _f32(read_t) == _f32(tcfg) and _f32(read_d) == _f32(dcfg)
    assert set(tfile.tensors) == set(tparams) and set(dfile.tensors) == set(dparams)
    assert "tokenizer.ggml.tokens" in tfile.metadata and len(tfile.metadata["tokenizer.ggml.tokens"]) == 512
    np.testing.assert_array_equal(dfile.array("dflash.fc.weight"), dparams["dflash.fc.weight"])
    table = "blk.0.ffn_gate_tid2eid.weight"
    np.testing.assert_array_equal(tfile.array(table), tparams[table])


def test_tiny_config_covers_every_mechanism(tiny_params):
    tcfg, tparams, dcfg, _ = tiny_params
    assert tcfg == tiny_target() and dcfg == tiny_drafter(tcfg)
    assert set(tcfg.layer_types) == {"swa", "csa", "hca"}
    assert 0 < tcfg.num_hash_layers < tcfg.num_layers
    assert max(dcfg.capture_layer_ids) == tcfg.num_layers - 1
    for i in range(tcfg.num_hash_layers):  # each token routes to distinct experts
        table = tparams[f"blk.{i}.ffn_gate_tid2eid.weight"]
        assert table.min() >= 0 and table.max() < tcfg.n_routed_experts
        assert all(len(set(row)) == len(row) for row in table.tolist())


def test_cli_writes_the_same_pair_in_seconds(tiny_files, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dsparkjax.tiny", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 30, f"python -m dsparkjax.tiny took {elapsed:.1f} s"
    for name, reference in zip(("target.gguf", "draft.gguf"), tiny_files):
        path = tmp_path / name
        assert f"wrote {path}" in proc.stdout
        assert path.read_bytes() == Path(reference).read_bytes()
    _, tcfg = open_target(str(tmp_path / "target.gguf"))
    open_drafter(str(tmp_path / "draft.gguf"), tcfg)


def test_ds4_presets_keep_the_first_layers():
    """`deepseek_v4_flash(n)` is the real config's first n layers (the DS4-sized benchmark model) and
    `dspark_flash(n)` the drafter that reads its last three; the full model is 43 layers of 3 hash-routed, 2 SWA,
    then CSA and HCA in turn."""
    full = deepseek_v4_flash()
    assert full.num_layers == 43 and dspark_flash().capture_layer_ids == (40, 41, 42)
    cut = deepseek_v4_flash(8)
    assert [cut.layer_type(i) for i in range(8)] == [full.layer_type(i) for i in range(8)] == \
        ["swa", "swa", "csa", "hca", "csa", "hca", "csa", "hca"]
    assert cut.num_hash_layers == 3 and len(cut.swiglu_limit) == len(cut.swiglu_limit_shared) == 8
    check_drafter_fits_target(dspark_flash(8), cut, "draft.gguf")
    with pytest.raises(DsparkError, match="43 layers"):
        deepseek_v4_flash(44)
