// The arithmetic of the GPU integer matvec (gpu_i8_matvec.cuh), compiled for the device and for the host:
// the int8-limb form of the activations, the sub-block decoders of Q8_0, Q2_K, Q4_K and IQ2_XXS to int8 words, the
// exact int32 dot products and the fp32 steps that follow them. The GPU kernels call it per lane; the CPU
// plugin's model of that path (cpu_i8_model.h) calls the same functions in the kernels' order, so the CPU
// tests check the GPU path's numerics and the GPU tests compare its outputs bit for bit.
//
// Each primitive is the device intrinsic on the device and its exact host equivalent on the host (the CPU
// plugin is compiled with -ffp-contract=off, so a float multiply or add rounds once, as the intrinsics do).
// Device builds include gpu_vendor.h first (gpu_dp4a, gpu_byte_select).
#pragma once
#include <cmath>
#include <cstdint>

#include "dspark_hd.h"
#include "quant_formats.h"

namespace dspark {
namespace i8math {

// ---- primitives ----
DSPARK_HD float f32_fma(float a, float b, float c) {
#if DSPARK_DEVICE_PASS
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
DSPARK_HD float f32_mul(float a, float b) {
#if DSPARK_DEVICE_PASS
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DSPARK_HD float f32_add(float a, float b) {
#if DSPARK_DEVICE_PASS
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DSPARK_HD float f32_sub(float a, float b) {
#if DSPARK_DEVICE_PASS
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DSPARK_HD float i2f_rn(int i) {  // round to nearest even
#if DSPARK_DEVICE_PASS
  return __int2float_rn(i);
#else
  return (float)i;
#endif
}
DSPARK_HD uint32_t float_bits(float f) {
#if DSPARK_DEVICE_PASS
  return __float_as_uint(f);
#else
  union { float f; uint32_t u; } v;
  v.f = f;
  return v.u;
#endif
}
DSPARK_HD int count_leading_zeros(int x) {  // x != 0
#if DSPARK_DEVICE_PASS
  return __clz(x);
#else
  return __builtin_clz((unsigned)x);
#endif
}
// The 64-bit word {hi, lo} shifted right by sh (< 32), low half.
DSPARK_HD uint32_t funnel_shift_right(uint32_t lo, uint32_t hi, uint32_t sh) {
#if DSPARK_DEVICE_PASS
  return __funnelshift_r(lo, hi, sh);
#else
  return (uint32_t)((((uint64_t)hi << 32) | lo) >> sh);
#endif
}
// c + Σ_k a_k·b_k over the four signed bytes of a and b.
DSPARK_HD int dp4a(int a, int b, int c) {
#if DSPARK_DEVICE_PASS
  return gpu_dp4a(a, b, c);
#else
  for (int i = 0; i < 4; ++i) c += (int)(int8_t)(uint8_t)(a >> (8 * i)) * (int)(int8_t)(uint8_t)(b >> (8 * i));
  return c;
#endif
}
// Byte k of the result is byte sel[4k+2..4k] (selector nibbles below 8) of the eight bytes {b, a}.
DSPARK_HD uint32_t byte_select(uint32_t a, uint32_t b, uint32_t sel) {
#if DSPARK_DEVICE_PASS
  return gpu_byte_select(a, b, sel);
#else
  const uint64_t pool = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= (uint32_t)((pool >> (8 * ((sel >> (4 * k)) & 7u))) & 0xFFu) << (8 * k);
  return r;
#endif
}

// ---- activations ----
// The block exponent e of a largest magnitude m (bits of a finite float > 0): 2^(e-1) <= m < 2^e, as frexpf
// gives it, from the bits (subnormals included).
DSPARK_HD int block_exponent(uint32_t m) {
  return m >= 0x00800000u ? (int)(m >> 23) - 126 : -117 - count_leading_zeros((int)m);
}

// 2^n as a float from its bits: pow2_normal for -126 <= n <= 127; exp2_int for any n >= -149 (subnormal below
// -126) and 0 below, which is ldexpf(1, n) exactly.
DSPARK_HD float pow2_normal(int n) { return bits_to_float((uint32_t)(n + 127) << 23); }
DSPARK_HD float exp2_int(int n) {
  return n >= -126 ? pow2_normal(n) : bits_to_float(n >= -149 ? 1u << (n + 149) : 0u);
}

// Limbs of eight activations of one sub-block whose largest magnitude is below 2^e: byte k of limbs[l][h] is limb
// l of element 4h + k (limb 0 the most significant). X = rint(x · 2^(22-e)) as ldexpf would scale it: 22 - e
// lies in [-106, 171], so the scale is one multiply by a normal power of two and, past 2^127, a second exact
// scale-up, folded into an fma onto 1.5·2^23: with |X| <= 2^22 the sum lies in [2^23, 2^24], where the float's
// bits minus those of 1.5·2^23 are X, rounded to nearest even as __float2int_rn would (one integer subtraction
// instead of a conversion). Y = X + 0x808080 lies in [0, 2^24) and its bytes are the balanced base-256 digits
// of X plus 128 (the digits are unique), so limb l is byte 2 - l of Y with its top bit flipped. `xsum` gets
// Σ X (|Σ X| <= 2^25), which only formats with mins use (unused, it costs nothing).
DSPARK_HD void limbs8(const float v[8], int e, uint32_t limbs[3][2], int& xsum) {
  const int n = 22 - e, n1 = n < 127 ? n : 127;
  const float f1 = pow2_normal(n1), f2 = pow2_normal(n - n1);
  uint32_t y[8];
#pragma unroll
  for (int k = 0; k < 8; ++k)
    y[k] = float_bits(f32_fma(f32_mul(v[k], f1), f2, 12582912.0f)) - (0x4B400000u - 0x808080u);
  xsum = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) xsum += (int)(y[k] - 0x808080u);
#pragma unroll
  for (int l = 0; l < 3; ++l) {
    const uint32_t pick = (uint32_t)(2 - l) | (uint32_t)(6 - l) << 4;  // byte 2 - l of the first and second word
#pragma unroll
    for (int h = 0; h < 2; ++h)
      limbs[l][h] = byte_select(byte_select(y[4 * h], y[4 * h + 1], pick),
                                byte_select(y[4 * h + 2], y[4 * h + 3], pick), 0x5410) ^ 0x80808080u;
  }
}

// ---- sub-block decoders: 32 weights of a chunk as 8 words of int8, and the sub-block's scale ----
// A chunk is a row's bytes from a block boundary on, 4-byte aligned, with at least 4 readable bytes past the
// last block (the Q8_0 decoder reads one word more); `sub` counts its sub-blocks of 32 weights.
//
// IQ2_XXS decodes 8 weights with two byte permutes: byte k of the result is byte c_k of the pool
// {8, 25, 43, -8, -25, -43} where c_k = grid code (0, 1, 2 for the magnitudes 8, 25, 43) + 3 · sign bit. The
// selector nibbles c_0..c_7 are the sum of two table words, one per grid index (its codes) and one per stored
// sign pattern (3 where a weight is negative). Both tables are replicated 16 times (copy = lane % 16, 4-byte
// entries: a warp's lookups take at most two shared-memory wavefronts): grid[256][16] at byte 0,
// sign[128][16] at byte kGridBytes.
constexpr int kGridBytes = 256 * 16 * 4;
constexpr int kSignBytes = 128 * 16 * 4;
constexpr uint32_t kPoolLo = 0xF82B1908u;  // bytes 8, 25, 43, -8
constexpr uint32_t kPoolHi = 0x0000D5E7u;  // bytes -25, -43

struct Tables {
  const uint8_t* base;  // the tables, plus this lane's copy offset (lane % 16) * 4
  // kPoolLo, held in a register for the permutes: the GPU kernels load it from memory, because ptxas otherwise
  // re-creates the constant before nearly every permute (22 of the IQ2_XXS MoE kernel's 390 instructions per
  // sub-block of four rows).
  uint32_t pool_lo;
};

// The N 4-byte words at byte offset o of p, at any alignment: N + 1 aligned loads, funnel-shifted (staged
// records sit at odd offsets: Q8_0's 34-byte and IQ2_XXS's 66-byte blocks).
template <int N>
DSPARK_HD void words_at(const uint8_t* p, uint32_t o, uint32_t* out) {
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(p + (o & ~3u));
  const uint32_t sh = (o & 3u) * 8u;
  uint32_t w[N + 1];
#pragma unroll
  for (int i = 0; i <= N; ++i) w[i] = wp[i];
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = funnel_shift_right(w[i], w[i + 1], sh);
}

// IQ2_XXS weights 8l..8l+7 of a sub-block as two words of int8, from the byte offsets (entry · 64) of their
// grid index's and stored sign pattern's table entries.
DSPARK_HD void iq2_group(const Tables& tab, uint32_t grid_at, uint32_t sign_at, uint32_t& lo, uint32_t& hi) {
  // nibbles at most 2 + 3: the sum never carries into the next nibble
  const uint32_t sel = *reinterpret_cast<const uint32_t*>(tab.base + grid_at) +
                       *reinterpret_cast<const uint32_t*>(tab.base + kGridBytes + sign_at);
  lo = byte_select(tab.pool_lo, kPoolHi, sel);  // reads selector bits 0..15
  hi = byte_select(tab.pool_lo, kPoolHi, sel >> 16);
}
// An IQ2_XXS sub-block's scale from its block's d and its second word (the 4-bit scale in bits 28..31).
DSPARK_HD float iq2_scale(float d, uint32_t a1) { return f32_mul(f32_mul(d, f32_add(0.5f, (float)(a1 >> 28))), 0.25f); }

// A decoder gives a sub-block's weights and its Scale; `add` puts the sub-block's product into acc: v is
// sub_block_value, xs the activation scale 2^(e_b-22), sum0 and sum1 the half sums of X (kSums formats only).
// Formats without mins scale by one float.
struct ScaleOnly {
  using Scale = float;
  static constexpr bool kSums = false;
  DSPARK_HD static float add(float d, float xs, float v, int, int, float acc) { return f32_fma(f32_mul(d, xs), v, acc); }
};

template <class Fmt>
struct Sub;

template <>
struct Sub<FmtQ8_0> : ScaleOnly {  // half d @0; int8 qs[32] @2: one block per sub-block
  static constexpr int bytes_of(int subs) { return subs * 34; }
  static constexpr int kTableBytes = 0;
  DSPARK_HD static float decode(const uint8_t* chunk, int sub, uint32_t q[8], const Tables&) {
    const uint32_t b = 34u * (uint32_t)sub;
    const float d = half_to_float(*reinterpret_cast<const uint16_t*>(chunk + b));
    words_at<8>(chunk, b + 2u, q);
    return d;
  }
};

template <>
struct Sub<FmtIQ2_XXS> : ScaleOnly {  // half d @0; 8 x (u8 grid index[4], u32 signs|scale) @2: 8 sub-blocks per block
  static constexpr int bytes_of(int subs) { return subs / 8 * 66; }
  static constexpr int kTableBytes = kGridBytes + kSignBytes;
  DSPARK_HD static float decode(const uint8_t* chunk, int sub, uint32_t q[8], const Tables& tab) {
    const uint32_t blk = 66u * (uint32_t)(sub >> 3);
    uint32_t rec[2];  // the 4 grid indices, then the signs and the scale
    words_at<2>(chunk, blk + 2u + 8u * (uint32_t)(sub & 7), rec);
    const uint32_t idx = rec[0], a1 = rec[1];
    const float d = half_to_float(*reinterpret_cast<const uint16_t*>(chunk + blk));
#pragma unroll
    for (int l = 0; l < 4; ++l)  // byte offsets of entry (index · 16 + copy) · 4: the index lands in bits 6..
      iq2_group(tab, (l == 0 ? idx << 6 : idx >> (8 * l - 6)) & 0x3FC0u, (l == 0 ? a1 << 6 : a1 >> (7 * l - 6)) & 0x1FC0u,
                q[2 * l], q[2 * l + 1]);
    return iq2_scale(d, a1);
  }
};

// Q2_K's sub-block s of a block holds weights 32s..32s+31: 2-bit codes at bits 2·(s % 4) of qs[32·(s / 4) + l],
// the two 16-weight halves scaled by the nibbles sc (low) and m (high) of scales[2s] and scales[2s + 1]:
// w = d·sc·q - dmin·m. Decoded as q·sc per byte (at most 45: one 32-bit multiply of the masked codes, no byte
// carries into the next), with d, dmin and the two mins for `add`.
template <>
struct Sub<FmtQ2_K> {  // scales[16] @0, qs[64] @16, half d @80, half dmin @82: 8 sub-blocks per block
  static constexpr int bytes_of(int subs) { return subs / 8 * 84; }
  static constexpr int kTableBytes = 0;
  static constexpr bool kSums = true;
  struct Scale {
    float d, dmin;
    int m0, m1;
  };
  DSPARK_HD static Scale decode(const uint8_t* chunk, int sub, uint32_t q[8], const Tables&) {
    const uint32_t blk = 84u * (uint32_t)(sub >> 3), s = (uint32_t)sub & 7u;  // blocks are 4-byte aligned
    const uint32_t* qs = reinterpret_cast<const uint32_t*>(chunk + blk + 16u + 32u * (s >> 2));
    const uint32_t sm = *reinterpret_cast<const uint16_t*>(chunk + blk + 2u * s), shift = 2u * (s & 3u);
    const uint32_t sc0 = sm & 15u, sc1 = (sm >> 8) & 15u;
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = ((qs[i] >> shift) & 0x03030303u) * (i < 4 ? sc0 : sc1);
    const uint32_t dd = *reinterpret_cast<const uint32_t*>(chunk + blk + 80u);
    return {half_to_float((uint16_t)dd), half_to_float((uint16_t)(dd >> 16)), (int)((sm >> 4) & 15u), (int)(sm >> 12)};
  }
  // |m0·ΣX_0 + m1·ΣX_1| <= 2 · 15 · 16 · 2^22 < 2^31: exact in int32, rounded once to fp32.
  DSPARK_HD static float add(const Scale& s, float xs, float v, int sum0, int sum1, float acc) {
    const float mins = i2f_rn(s.m0 * sum0 + s.m1 * sum1);
    return f32_fma(-f32_mul(s.dmin, xs), mins, f32_fma(f32_mul(s.d, xs), v, acc));
  }
};

// Q4_K's sub-block s of a block holds weights 32s..32s+31: 4-bit codes in the low (s even) or high nibbles of
// qs[32·(s / 2) + l], one 6-bit scale sc and min m per sub-block: w = d·sc·q - dmin·m. Decoded as the codes
// themselves (q·sc reaches 945, past int8), the sub-block's scale d·sc and min dmin·m as floats, both exact
// (an 11-bit mantissa times a 6-bit integer), for `add`.
template <>
struct Sub<FmtQ4_K> {  // half d @0, half dmin @2, scales[12] @4, qs[128] @16: 8 sub-blocks per block
  static constexpr int bytes_of(int subs) { return subs / 8 * 144; }
  static constexpr int kTableBytes = 0;
  static constexpr bool kSums = true;
  struct Scale {
    float dsc, dmin_m;
  };
  DSPARK_HD static Scale decode(const uint8_t* chunk, int sub, uint32_t q[8], const Tables&) {
    const uint32_t blk = 144u * (uint32_t)(sub >> 3), s = (uint32_t)sub & 7u;  // blocks are 4-byte aligned
    const uint32_t* qs = reinterpret_cast<const uint32_t*>(chunk + blk + 16u + 32u * (s >> 1));
    const uint32_t shift = 4u * (s & 1u);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (qs[i] >> shift) & 0x0F0F0F0Fu;
    uint32_t sc, m;
    q4k_scale_min(chunk + blk + 4u, (int)s, sc, m);
    const uint32_t dd = *reinterpret_cast<const uint32_t*>(chunk + blk);
    return {f32_mul(half_to_float((uint16_t)dd), (float)sc), f32_mul(half_to_float((uint16_t)(dd >> 16)), (float)m)};
  }
  // |ΣX_0 + ΣX_1| <= 32 · 2^22: exact in int32, rounded once to fp32 (times m it could pass 2^31).
  DSPARK_HD static float add(const Scale& s, float xs, float v, int sum0, int sum1, float acc) {
    return f32_fma(-f32_mul(s.dmin_m, xs), i2f_rn(sum0 + sum1), f32_fma(f32_mul(s.dsc, xs), v, acc));
  }
};

// Selector words of the IQ2_XXS tables: nibble k of grid word i is the code of byte k of grid entry i (its
// magnitude 8, 25 or 43 as 0, 1, 2); nibble k of sign word i is 3 where bit k of iq2_sign_byte(i) is set.
struct Iq2Selectors {
  uint32_t grid[256], sign[128];
};
constexpr Iq2Selectors make_iq2_selectors() {
  Iq2Selectors t{};
  for (int i = 0; i < 256; ++i)
    for (int k = 0; k < 8; ++k) {
      const uint32_t m = (uint32_t)(kIq2xxsGridHost[i] >> (8 * k)) & 0xFFu;
      t.grid[i] |= (m == 8 ? 0u : m == 25 ? 1u : 2u) << (4 * k);
    }
  for (uint32_t i = 0; i < 128; ++i)
    for (int k = 0; k < 8; ++k)
      if ((iq2_sign_byte(i) >> k) & 1u) t.sign[i] |= 3u << (4 * k);
  return t;
}

// Calls f(Fmt{}) for the formats of the integer path and returns its result; false for other formats.
template <class F>
bool visit_i8_format(int32_t type, F&& f) {
  if (type == kQ8_0) return f(FmtQ8_0{});
  if (type == kQ2_K) return f(FmtQ2_K{});
  if (type == kQ4_K) return f(FmtQ4_K{});
  if (type == kIQ2_XXS) return f(FmtIQ2_XXS{});
  return false;
}

// ---- the sub-block's product ----
// The top limb's dot product starts from the bits of 1.5·2^23 (kBiasedZero), so a sum |i| < 2^22 lands in the
// mantissa of 1.5·2^23 + i and one subtraction gives i as a float, exactly.
constexpr int kBiasedZero = 0x4B400000;
DSPARK_HD float unbias(int biased) { return f32_sub(bits_to_float((uint32_t)biased), 12582912.0f); }

// v = Σ_j w_j·X_j of one sub-block in fp32, from its weights q (8 words of int8) and the activation limbs xw
// (3 limbs x 8 words): three exact int32 dot products, |I_l| <= 32 * 128 * 128 = 2^19, so I1·256 + I2 is exact
// in int32 and its conversion rounds it once, as an fma(I1, 256, I2) of the exact floats would.
DSPARK_HD float sub_block_value(const uint32_t q[8], const int xw[3][8]) {
  int I[3] = {kBiasedZero, 0, 0};
#pragma unroll
  for (int l = 0; l < 3; ++l)
#pragma unroll
    for (int j = 0; j < 8; ++j) I[l] = dp4a((int)q[j], xw[l][j], I[l]);
  return f32_fma(unbias(I[0]), 65536.0f, i2f_rn(I[1] * 256 + I[2]));
}

}  // namespace i8math
}  // namespace dspark
