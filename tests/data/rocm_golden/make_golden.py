"""Write golden.npz: inputs and the bytes lucebox's C reference quantizer makes of them, for all 6 ROCm types.

Usage: python tests/data/rocm_golden/make_golden.py LUCEBOX_CHECKOUT [OUT.npz]

LUCEBOX_CHECKOUT is a Luce-Org/lucebox work tree (README.md names the commit). The script compiles its
`ggml/rocmfp4/rocmfp4.c` and `ggml/rocmfpx/rocmfpx.c` with gcc into a scratch shared library, next to two
small stand-in headers written below (the few ggml names those files use), and calls the unweighted
`*_quantize_row_*_ref` functions through ctypes. Not imported by the tests: they read only golden.npz.
"""

from __future__ import annotations

import ctypes
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

LLAMA_CPP = "server/deps/llama.cpp/ggml"
GGML_H = """#pragma once
#include <stdint.h>
#include <stddef.h>
#define GGML_API
#define GGML_RESTRICT restrict
#define GGML_UNUSED(x) (void)(x)
typedef uint16_t ggml_fp16_t;
enum ggml_type { GGML_TYPE_Q4_0_ROCMFP4 = 100, GGML_TYPE_Q4_0_ROCMFP4_FAST = 101 };
static inline size_t ggml_row_size(enum ggml_type t, int64_t ne) { return (size_t)(ne / 32) * (t == 100 ? 18 : 17); }
static inline float ggml_fp16_to_fp32(ggml_fp16_t x) { (void)x; return 0.0f; } /* only the vec_dot uses it */
"""
GGML_COMMON_H = """#pragma once
#include "ggml.h"
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;
#define QK8_0 32
"""
# (name in golden.npz = GGMLType name, C function, bytes per block)
FUNCTIONS = [
    ("Q4_0_ROCMFP4", "rocmfp4_quantize_row_q4_0_ref", 18),
    ("Q4_0_ROCMFP4_FAST", "rocmfp4_quantize_row_q4_0_fast_ref", 17),
    ("Q6_0_ROCMFPX", "rocmfpx_quantize_row_fp6_ref", 26),
    ("Q8_0_ROCMFPX", "rocmfpx_quantize_row_fp8_ref", 33),
    ("Q3_0_ROCMFPX", "rocmfpx_quantize_row_fp3_ref", 14),
    ("Q2_0_ROCMFP2", "rocmfpx_quantize_row_fp2_ref", 10),
]
BLOCKS_PER_FAMILY = 32


def build_reference(checkout: pathlib.Path, scratch: pathlib.Path) -> ctypes.CDLL:
    """Compile the two C files of `checkout` into scratch/libref.so (plain x86-64: no FMA contraction)."""
    ggml = checkout / LLAMA_CPP
    (scratch / "include").mkdir()
    (scratch / "include" / "ggml.h").write_text(GGML_H)
    (scratch / "src").mkdir()
    (scratch / "src" / "ggml-common.h").write_text(GGML_COMMON_H)
    for sub in ("rocmfp4", "rocmfpx"):  # rocmfp4.c includes "../src/ggml-common.h" relative to itself
        (scratch / sub).mkdir()
        for f in (ggml / sub).glob(f"{sub}.[ch]"):
            (scratch / sub / f.name).write_bytes(f.read_bytes())
    lib = scratch / "libref.so"
    cmd = ["gcc", "-O2", "-std=c11", "-fPIC", "-shared", f"-I{scratch / 'include'}",
           str(scratch / "rocmfp4" / "rocmfp4.c"), str(scratch / "rocmfpx" / "rocmfpx.c"), "-o", str(lib), "-lm"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def reference_bytes(lib: ctypes.CDLL, function: str, type_size: int, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.zeros(x.size // 32 * type_size, np.uint8)
    pointer = ctypes.c_void_p
    getattr(lib, function)(x.ctypes.data_as(pointer), out.ctypes.data_as(pointer), ctypes.c_int64(x.size))
    return out.reshape(-1, type_size)


def scale_table() -> np.ndarray:
    """float64[127]: the UE4M3-half scale of bytes 0..126 (quant_hc.md §1.1)."""
    e = np.arange(127)
    return np.where(e >> 3 == 0, (e & 7) * 2.0**-10, (8 + (e & 7)) * 2.0 ** ((e >> 3) - 11))


def families(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Named float32[n, 32] input families: random data and the edge cases of quant_hc.md §1.3."""
    s = scale_table()
    e = rng.integers(1, 127, (n, 1))
    fam = {
        "gaussian": rng.standard_normal((n, 32)),
        "heavy_tailed": rng.standard_t(2, (n, 32)),
        "magnitudes_1e-8_1e8": rng.standard_normal((n, 32)) * 10.0 ** rng.uniform(-8, 8, (n, 1)),
        # x = k/2 * scale(e): every element sits on a code threshold or a level at some scale
        "half_step_ties": rng.choice(np.arange(-40, 41) * 0.5, (n, 32)) * s[e],
        "f16_valued": rng.standard_normal((n, 32)).astype(np.float16),
        "sparse": rng.standard_normal((n, 32)) * (rng.random((n, 32)) < 0.1),
        "all_negative": -np.abs(rng.standard_normal((n, 32))),
        "subnormal_1e-40": rng.standard_normal((n, 32)) * 1e-40,
        "subnormal_steps": rng.integers(-300, 301, (n, 32)) * 2.0**-149,
        # max|x| / 127 rounds to 0 in fp32 (max|x| < 63.5 * 2^-149): FP8 keeps scale byte 0
        "fp8_underflow": rng.integers(-63, 64, (n, 32)) * 2.0**-149,
        "saturating_1e2_1e5": rng.standard_normal((n, 32)) * 10.0 ** rng.uniform(2, 5, (n, 1)),
        # squared errors overflow fp32 at every scale; FP2 codes of huge x*inv
        "huge_1e15_1e38": rng.standard_normal((n, 32)) * 10.0 ** rng.uniform(15, 38, (n, 1)),
        "zeros_and_negative_zeros": np.where(rng.random((n, 32)) < 0.5, 0.0, -0.0),
    }
    mid = (s[e] + s[np.minimum(e + 1, 126)]) / 2 * rng.choice([127, 10, 4, 2, 31], (n, 1))
    x = rng.uniform(-1, 1, (n, 32)) * mid
    x[:, 0] = mid[:, 0]  # max|x| / QMAX lands midway between two scales
    fam["max_between_scales"] = x
    x = np.zeros((n, 32))
    x[np.arange(n), rng.integers(0, 32, n)] = rng.standard_normal(n) * 10.0 ** rng.uniform(-45, 38, n)
    fam["single_nonzero_1e-45_1e38"] = x
    x = rng.standard_normal((n, 32))
    mask = rng.random((n, 32)) < 0.15
    x[mask] = rng.choice([np.nan, np.inf, -np.inf, -0.0], mask.sum())
    fam["nan_inf"] = x
    bits = rng.integers(0, 2**32, (n, 32), dtype=np.uint64).astype(np.uint32).view(np.float32)
    fam["random_bit_patterns"] = bits
    return {k: np.asarray(v, np.float32) for k, v in fam.items()}


def main(checkout: str, out: str) -> None:
    rng = np.random.default_rng(20261206)
    fam = families(rng, BLOCKS_PER_FAMILY)
    inputs = np.concatenate(list(fam.values()))
    names = np.repeat(np.array(list(fam)), [len(v) for v in fam.values()])
    with tempfile.TemporaryDirectory() as scratch:
        lib = build_reference(pathlib.Path(checkout), pathlib.Path(scratch))
        expected = {name: reference_bytes(lib, fn, size, inputs) for name, fn, size in FUNCTIONS}
    np.savez_compressed(out, inputs=inputs, family=names, **expected)


if __name__ == "__main__":
    here = pathlib.Path(__file__).parent
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(here / "golden.npz"))
