// The GPU integer matvec (gpu_i8_matvec.cuh) computed on the CPU, bit for bit: the same arithmetic
// (i8_math.h) in the same order, so that the CPU tests check that path's numerics against numpy and the GPU
// tests compare the device's outputs with it exactly.
//
// The order it reproduces, per output (row, token): lane L of the row's warp sums the sub-blocks b = L mod 32
// in K order, each as acc = Sub<Fmt>::add(scale, 2^(e_b-22), sub_block_value(...), half sums, acc) from 0; the 32
// lane sums are then added by the warp's butterfly (pairs L and L ^ 16, then ^ 8, ^ 4, ^ 2, ^ 1; fp32 addition
// is commutative, so that tree is one fixed expression). The activations are staged per token and sub-block as
// the kernels stage them: the largest magnitude as an integer max over |bits| (a NaN or inf gives a NaN scale
// and zero limbs), then limbs8 per 8 elements and the two half sums.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "i8_math.h"

namespace dspark {
namespace i8model {
using namespace i8math;

// The IQ2_XXS selector tables as the kernels lay them out in shared memory (16 copies of each 4-byte entry).
struct HostTables {
  alignas(16) uint8_t bytes[kGridBytes + kSignBytes];
  HostTables() {
    constexpr Iq2Selectors sel = make_iq2_selectors();
    auto* grid = reinterpret_cast<uint32_t*>(bytes);
    auto* sign = reinterpret_cast<uint32_t*>(bytes + kGridBytes);
    for (int i = 0; i < 256 * 16; ++i) grid[i] = sel.grid[i / 16];
    for (int i = 0; i < 128 * 16; ++i) sign[i] = sel.sign[i / 16];
  }
};
inline const Tables& host_tables() {
  static const HostTables t;
  static const Tables tab{t.bytes, kPoolLo};
  return tab;
}

// One token's activations as the kernels stage them: limb words [sub-block][limb][8], the scale 2^(e_b-22) and
// the two half sums of X per sub-block.
struct StagedToken {
  std::vector<int> words;  // (sb * 3 + l) * 8 + j: limb l of elements 4j..4j+3
  std::vector<float> scales;
  std::vector<int> sums;  // sb * 2 + h: Σ X over elements 16h..16h+15
};

template <class XT>
void stage_token(const XT* x, int64_t K, StagedToken& s) {
  const int64_t nsub = K / 32;
  s.words.assign(nsub * 24, 0);
  s.scales.assign(nsub, 0.0f);
  s.sums.assign(nsub * 2, 0);
  for (int64_t sb = 0; sb < nsub; ++sb) {
    float v[4][8];
    uint32_t m = 0;
    for (int q = 0; q < 4; ++q)
      for (int k = 0; k < 8; ++k) {
        v[q][k] = to_float(x[sb * 32 + 8 * q + k]);
        const uint32_t a = float_bits(v[q][k]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
      }
    if (m >= 0x7F800000u) {
      s.scales[sb] = bits_to_float(0x7fc00000u);
    } else if (m > 0) {
      const int e = block_exponent(m);
      s.scales[sb] = exp2_int(e - 22);
      for (int q = 0; q < 4; ++q) {
        uint32_t limbs[3][2];
        int xsum = 0;
        limbs8(v[q], e, limbs, xsum);
        for (int l = 0; l < 3; ++l)
          for (int h = 0; h < 2; ++h) s.words[(sb * 3 + l) * 8 + 2 * q + h] = (int)limbs[l][h];
        s.sums[sb * 2 + q / 2] += xsum;
      }
    }
  }
}

// The warp's butterfly over 32 lane sums.
inline float lane_tree(float c[32]) {
  for (int w = 16; w >= 1; w >>= 1)
    for (int L = 0; L < w; ++L) c[L] = f32_add(c[L], c[L + w]);
  return c[0];
}

// y[t][n] for rows [0, N) of w (row_bytes a multiple of 4, as the integer path requires) and T tokens of x.
template <class Fmt, class XT>
void qmatmul(const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes, const XT* x, int64_t T, float* y) {
  using D = Sub<Fmt>;
  const int64_t nsub = K / 32;
  std::vector<StagedToken> tokens(T);
  for (int64_t t = 0; t < T; ++t) stage_token(x + t * K, K, tokens[t]);
  // a row as the kernels stage it: 4-byte aligned, with readable bytes past its end
  std::vector<uint32_t> row((row_bytes + 8) / 4, 0u);
  std::vector<float> chains(T * 32);
  for (int64_t n = 0; n < N; ++n) {
    std::memcpy(row.data(), w + n * row_bytes, row_bytes);
    const auto* chunk = reinterpret_cast<const uint8_t*>(row.data());
    std::fill(chains.begin(), chains.end(), 0.0f);
    for (int64_t sb = 0; sb < nsub; ++sb) {
      uint32_t q[8];
      const typename D::Scale scale = D::decode(chunk, (int)sb, q, host_tables());
      for (int64_t t = 0; t < T; ++t) {
        const StagedToken& s = tokens[t];
        int xw[3][8];
        std::memcpy(xw, &s.words[sb * 24], sizeof(xw));
        float& acc = chains[t * 32 + sb % 32];
        const float v = sub_block_value(q, xw);
        acc = D::add(scale, s.scales[sb], v, s.sums[sb * 2], s.sums[sb * 2 + 1], acc);
      }
    }
    for (int64_t t = 0; t < T; ++t) y[t * N + n] = lane_tree(&chains[t * 32]);
  }
}

}  // namespace i8model
}  // namespace dspark
