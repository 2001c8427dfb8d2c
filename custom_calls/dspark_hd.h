// Portable host/device helpers shared by the CPU (gcc), CUDA (nvcc) and HIP (hipcc) builds.
//
// DSPARK_HD marks functions compiled for both sides; dspark_mad() is the single multiply-add used by every
// accumulation, so that its rounding is the same in every instantiation (an explicit fused FMA on devices,
// a separate multiply and add on the host, which is compiled with -ffp-contract=off).
#pragma once
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DSPARK_HD __host__ __device__ inline
#else
#define DSPARK_HD inline
#endif

#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define DSPARK_DEVICE_PASS 1
#else
#define DSPARK_DEVICE_PASS 0
#endif

namespace dspark {

DSPARK_HD float bits_to_float(uint32_t u) {
  union { uint32_t u; float f; } v;
  v.u = u;
  return v.f;
}

// IEEE binary16 -> binary32, exact (subnormals, inf and NaN included): the hardware conversion on devices,
// bit manipulation on the host.
DSPARK_HD float half_to_float(uint16_t h) {
#if DSPARK_DEVICE_PASS
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32.
  const float mag = (float)man * 5.9604644775390625e-08f;
  return sign ? -mag : mag;
#endif
}

DSPARK_HD float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

DSPARK_HD uint16_t load_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

DSPARK_HD uint32_t load_u32(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// Little-endian load of n <= 8 bytes into a 64-bit word (bitstream formats).
DSPARK_HD uint64_t load_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

DSPARK_HD float dspark_mad(float a, float b, float c) {
#if DSPARK_DEVICE_PASS
  return __fmaf_rn(a, b, c);
#else
  return a * b + c;
#endif
}

// Element types read as float: float32, raw bfloat16 bits, raw binary16 bits.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
DSPARK_HD float to_float(float v) { return v; }
DSPARK_HD float to_float(bf16_t v) { return bf16_to_float(v.bits); }
DSPARK_HD float to_float(f16_t v) { return half_to_float(v.bits); }

}  // namespace dspark
