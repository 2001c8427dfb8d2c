// Block decoders of every packed weight format the kernels read, shared by the CPU and GPU code.
//
// A format is a struct with kBlock (weights per block), kBytes (bytes per block) and
//   decode8(blk, g, w): the 8 weights g*8 .. g*8+7 of the block at `blk`, as float32, exactly as the
//   format's reference dequantizer (ggml / lucebox CPU reference) computes them.
// Byte layouts: quant_hc.md §1.2 (ROCm ids 100-107), §4.2-4.3 (Q8_0, Q2_K, IQ2_XXS) and FmtQ4_K's comment below.
// Weight rows are consecutive blocks along K; blocks are not aligned, so every multi-byte field is read bytewise.
#pragma once
#include <cstdint>

#include "dspark_hd.h"
#include "iq2xxs_grid.h"

namespace dspark {

enum GgmlType : int32_t {
  kF32 = 0, kF16 = 1, kQ8_0 = 8, kQ2_K = 10, kQ4_K = 12, kIQ2_XXS = 16, kBF16 = 30,
  kRocmFP4 = 100, kRocmFP4Fast = 101, kRocmFP6 = 102, kRocmFP8 = 103, kRocmFP3 = 104, kRocmFP2 = 107,
};

// ---- dense float weights (handled as pseudo-blocks of 8, so K must be a multiple of 8) ----
struct FmtF32 {
  static constexpr int kBlock = 8, kBytes = 32;
  DSPARK_HD static void decode8(const uint8_t* b, int, float w[8]) {
    for (int j = 0; j < 8; ++j) w[j] = bits_to_float(load_u32(b + 4 * j));
  }
};
struct FmtF16 {
  static constexpr int kBlock = 8, kBytes = 16;
  DSPARK_HD static void decode8(const uint8_t* b, int, float w[8]) {
    for (int j = 0; j < 8; ++j) w[j] = half_to_float(load_u16(b + 2 * j));
  }
};
struct FmtBF16 {
  static constexpr int kBlock = 8, kBytes = 16;
  DSPARK_HD static void decode8(const uint8_t* b, int, float w[8]) {
    for (int j = 0; j < 8; ++j) w[j] = bf16_to_float(load_u16(b + 2 * j));
  }
};

// ---- ggml Q8_0: half d; int8 qs[32]; w = d * q ----
struct FmtQ8_0 {
  static constexpr int kBlock = 32, kBytes = 34;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const float d = half_to_float(load_u16(b));
    for (int j = 0; j < 8; ++j) w[j] = d * (float)(int8_t)b[2 + 8 * g + j];
  }
};

// ---- ggml Q2_K: scales[16] @0, qs[64] @16, half d @80, half dmin @82; w = (d*sc)*q - dmin*m ----
struct FmtQ2_K {
  static constexpr int kBlock = 256, kBytes = 84;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const int i0 = 8 * g, n = i0 >> 7, shift = 2 * ((i0 >> 5) & 3), l0 = i0 & 31;
    const uint8_t sc = b[8 * n + 2 * (shift >> 1) + (l0 >= 16)];
    const float d = half_to_float(load_u16(b + 80)), dmin = half_to_float(load_u16(b + 82));
    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    const uint8_t* q = b + 16 + 32 * n + l0;
    for (int j = 0; j < 8; ++j) w[j] = dl * (float)((q[j] >> shift) & 3) - ml;
  }
};

// ---- ggml Q4_K: half d @0, half dmin @2, scales[12] @4, qs[128] @16; 8 sub-blocks of 32 weights ----
// Sub-block j's 6-bit scale and min: j < 4 the low 6 bits of scales[j] and scales[j + 4]; j >= 4 the nibbles of
// scales[j + 4] (scale low, min high) with the top two bits of scales[j - 4] and scales[j] above them.
DSPARK_HD void q4k_scale_min(const uint8_t* scales, int j, uint32_t& sc, uint32_t& m) {
  if (j < 4) {
    sc = scales[j] & 63u;
    m = scales[j + 4] & 63u;
  } else {
    sc = (scales[j + 4] & 15u) | ((uint32_t)(scales[j - 4] >> 6) << 4);
    m = (uint32_t)(scales[j + 4] >> 4) | ((uint32_t)(scales[j] >> 6) << 4);
  }
}

// Sub-block j's codes are the low (j even) or high (j odd) nibbles of qs[32·(j / 2) ..]; w = (d·sc)·q - dmin·m.
struct FmtQ4_K {
  static constexpr int kBlock = 256, kBytes = 144;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const int j = g >> 2, shift = 4 * (j & 1);
    uint32_t sc, m;
    q4k_scale_min(b + 4, j, sc, m);
    const float dl = half_to_float(load_u16(b)) * (float)sc, ml = half_to_float(load_u16(b + 2)) * (float)m;
    const uint8_t* q = b + 16 + 32 * (j >> 1) + 8 * (g & 3);
    for (int k = 0; k < 8; ++k) w[k] = dl * (float)((q[k] >> shift) & 15) - ml;
  }
};

// ---- ggml IQ2_XXS: half d; 8 x (u32 grid indices, u32 signs/scale) ----
#if defined(__CUDACC__) || defined(__HIPCC__)
__device__ const uint64_t kIq2xxsGridDevice[256] = {DSPARK_IQ2XXS_GRID_VALUES};
#endif
constexpr uint64_t kIq2xxsGridHost[256] = {DSPARK_IQ2XXS_GRID_VALUES};  // constexpr: device tables derive from it

DSPARK_HD uint64_t iq2xxs_grid(int i) {
#if DSPARK_DEVICE_PASS
  return kIq2xxsGridDevice[i];
#else
  return kIq2xxsGridHost[i];
#endif
}

// ksigns_iq2xs[i] = i | parity(i) << 7: 7 stored sign bits, the 8th makes the count of negatives even.
DSPARK_HD constexpr uint32_t iq2_sign_byte(uint32_t i) {
  uint32_t p = i ^ (i >> 4);
  p ^= p >> 2;
  p ^= p >> 1;
  return i | ((p & 1u) << 7);
}

struct FmtIQ2_XXS {
  static constexpr int kBlock = 256, kBytes = 66;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const int ib32 = g >> 2, l = g & 3;
    const uint8_t* q = b + 2 + 8 * ib32;
    const uint32_t a1 = load_u32(q + 4);
    const float db = half_to_float(load_u16(b)) * (0.5f + (float)(a1 >> 28)) * 0.25f;
    const uint64_t grid = iq2xxs_grid(q[l]);
    const uint32_t signs = iq2_sign_byte((a1 >> (7 * l)) & 127u);
    for (int j = 0; j < 8; ++j) {
      const float v = db * (float)((grid >> (8 * j)) & 0xFF);
      w[j] = (signs >> j) & 1u ? -v : v;
    }
  }
};

// ---- lucebox ROCmFP4 / ROCmFPX (quant_hc.md §1) ----
// UE4M3 "half" scale byte: (8+M)*2^(E-11), or M*2^-10 when E == 0; bytes > 0x7E are invalid and give 0.
DSPARK_HD float rocm_scale(uint8_t e) {
  if (e > 0x7E) return 0.0f;
  const uint32_t E = (e >> 3) & 15u, M = e & 7u;
  if (E == 0) return (float)M * (1.0f / 1024.0f);
  return bits_to_float(((E + 119u) << 23) | (M << 20));
}

// Codebook10 sign-magnitude nibble: {0,1,2,3,4,6,8,10}, bit 3 = sign.
DSPARK_HD float fp4_level(uint32_t c) {
  const int m3 = (int)(c & 7u), mag = m3 <= 4 ? m3 : 2 * m3 - 4;
  return (float)((c & 8u) ? -mag : mag);
}

// FP4 (100: one scale per 16) and FP4_FAST (101: one scale per 32): qs[16] nibbles, low = j, high = j+16.
template <int kScales>
struct FmtRocmFP4 {
  static constexpr int kBlock = 32, kBytes = 16 + kScales;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const int hi = g >> 1;  // groups 0,1 are low nibbles (elements 0..15), 2,3 high nibbles (16..31)
    const float s = rocm_scale(b[16 + (kScales == 2 ? hi : 0)]);
    const uint8_t* q = b + 8 * (g & 1);
    for (int j = 0; j < 8; ++j) w[j] = fp4_level(hi ? (q[j] >> 4) : (q[j] & 15u)) * s;
  }
};

// Bitstream formats: element i at bits [nb*i, nb*i+nb) of qs, LSB first; so the 8 elements of group g are
// exactly the nb bytes qs[nb*g .. nb*g+nb). Two scales (elements 0..15, 16..31) follow qs.
template <int kBits, class Level>
struct FmtRocmBits {
  static constexpr int kBlock = 32, kBytes = 4 * kBits + 2;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const float s = rocm_scale(b[4 * kBits + (g >> 1)]);
    const uint64_t v = load_le(b + kBits * g, kBits);
    for (int j = 0; j < 8; ++j) w[j] = Level::of((uint32_t)(v >> (kBits * j)) & ((1u << kBits) - 1u)) * s;
  }
};
struct LevelFP2 {  // {-1, 0, 1, 2}
  DSPARK_HD static float of(uint32_t c) { return (float)((int)c - 1); }
};
struct LevelFP3 {  // {0, 1, 2, 4}, bit 2 = sign
  DSPARK_HD static float of(uint32_t c) {
    const int mag = (c & 3u) == 3u ? 4 : (int)(c & 3u);
    return (float)((c & 4u) ? -mag : mag);
  }
};
struct LevelFP6 {  // 0..31, bit 5 = sign
  DSPARK_HD static float of(uint32_t c) {
    const int mag = (int)(c & 31u);
    return (float)((c & 32u) ? -mag : mag);
  }
};
using FmtRocmFP2 = FmtRocmBits<2, LevelFP2>;
using FmtRocmFP3 = FmtRocmBits<3, LevelFP3>;
using FmtRocmFP6 = FmtRocmBits<6, LevelFP6>;

// FP8 (103): int8 qs[32], one scale byte @32.
struct FmtRocmFP8 {
  static constexpr int kBlock = 32, kBytes = 33;
  DSPARK_HD static void decode8(const uint8_t* b, int g, float w[8]) {
    const float s = rocm_scale(b[32]);
    for (int j = 0; j < 8; ++j) w[j] = (float)(int8_t)b[8 * g + j] * s;
  }
};

// Calls f(Fmt{}) for the format of `ggml_type`; returns false (without calling f) for unsupported types.
template <class F>
bool visit_format(int32_t ggml_type, F&& f) {
  switch (ggml_type) {
    case kF32: f(FmtF32{}); return true;
    case kF16: f(FmtF16{}); return true;
    case kBF16: f(FmtBF16{}); return true;
    case kQ8_0: f(FmtQ8_0{}); return true;
    case kQ2_K: f(FmtQ2_K{}); return true;
    case kQ4_K: f(FmtQ4_K{}); return true;
    case kIQ2_XXS: f(FmtIQ2_XXS{}); return true;
    case kRocmFP4: f(FmtRocmFP4<2>{}); return true;
    case kRocmFP4Fast: f(FmtRocmFP4<1>{}); return true;
    case kRocmFP6: f(FmtRocmFP6{}); return true;
    case kRocmFP8: f(FmtRocmFP8{}); return true;
    case kRocmFP3: f(FmtRocmFP3{}); return true;
    case kRocmFP2: f(FmtRocmFP2{}); return true;
    default: return false;
  }
}

}  // namespace dspark
