// mHC arithmetic shared by the CPU and GPU kernels (fp32 throughout; quant_hc.md §3, model/hc.py).
//
// Per token: mix = (flat(X) · fnᵀ) · rsqrt(mean(flat²) + norm_eps) is computed by the caller; the hc_*_gate,
// hc_comb_start and hc_sinkhorn_elem functions turn the mix into the pre/post gates and the Sinkhorn-normalised
// comb one element at a time (hc_gates strings them together serially); hc_collapse and hc_post_elem are the
// per-element sums. Every loop has a fixed order, so a token's result never depends on other tokens.
#pragma once
#include <math.h>

#include "dspark_hd.h"

namespace dspark {

constexpr int kMaxHc = 8;  // the Sinkhorn state lives in fixed-size arrays of kMaxHc^2 floats

DSPARK_HD float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// The gates and the Sinkhorn comb, one element at a time, so that the GPU can give each element its own
// thread while the CPU loops over them: the sums run in the same order either way, so both give the serial
// result bit for bit. mix and base hold [pre n | post n | comb n*n] logits; scale holds their three scales.
DSPARK_HD float hc_pre_gate(const float* mix, const float* base, const float* scale, float eps, int j) {
  return sigmoidf(dspark_mad(mix[j], scale[0], base[j])) + eps;
}

DSPARK_HD float hc_post_gate(const float* mix, const float* base, const float* scale, int n, int j) {
  return 2.0f * sigmoidf(dspark_mad(mix[n + j], scale[1], base[n + j]));
}

// comb[j, k] before Sinkhorn: row j's softmax over k of the scaled logits, + eps.
DSPARK_HD float hc_comb_start(const float* mix, const float* base, const float* scale, int n, float eps, int j,
                              int k) {
  const float* lg = mix + 2 * n + j * n;
  const float* lb = base + 2 * n + j * n;
  float mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = fmaxf(mx, dspark_mad(lg[i], scale[2], lb[i]));
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += expf(dspark_mad(lg[i], scale[2], lb[i]) - mx);
  return expf(dspark_mad(lg[k], scale[2], lb[k]) - mx) / sum + eps;
}

// Sum of n comb entries from `first`, `stride` apart (a row: stride 1; a column: stride n), in order.
DSPARK_HD float hc_line_sum(const float* comb, int first, int stride, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += comb[first + i * stride];
  return s;
}

// Element e = j*n + k of one Sinkhorn half-step: comb[j, k] divided by its row's (rows) or column's sum + eps.
DSPARK_HD float hc_sinkhorn_elem(const float* comb, int n, float eps, bool rows, int e) {
  const int j = e / n, k = e % n;
  const float s = rows ? hc_line_sum(comb, j * n, 1, n) : hc_line_sum(comb, k, n, n);
  return comb[e] / (s + eps);
}

// Half-step h of a Sinkhorn run of `iters` iterations: columns in every iteration, rows before them in
// iterations 2..iters, so half-steps go columns, rows, columns, ... (2*iters - 1 of them).
DSPARK_HD int hc_sinkhorn_half_steps(int iters) { return iters > 0 ? 2 * iters - 1 : 0; }
DSPARK_HD bool hc_sinkhorn_rows(int h) { return h % 2 == 1; }

// mix [M=(2+n)n], base [M], scale [3] -> pre [n], post [n], comb [n*n] (row j = source, column k = destination),
// serially (the CPU kernel).
DSPARK_HD void hc_gates(const float* mix, const float* base, const float* scale, int n, int iters, float eps,
                        float* pre, float* post, float* comb) {
  for (int j = 0; j < n; ++j) {
    pre[j] = hc_pre_gate(mix, base, scale, eps, j);
    post[j] = hc_post_gate(mix, base, scale, n, j);
  }
  const int nn = n * n;
  for (int e = 0; e < nn; ++e) comb[e] = hc_comb_start(mix, base, scale, n, eps, e / n, e % n);
  float next[kMaxHc * kMaxHc];
  for (int h = 0; h < hc_sinkhorn_half_steps(iters); ++h) {
    for (int e = 0; e < nn; ++e) next[e] = hc_sinkhorn_elem(comb, n, eps, hc_sinkhorn_rows(h), e);
    for (int e = 0; e < nn; ++e) comb[e] = next[e];
  }
}

// u[d] = Σ_j pre[j] · X[j, d], summed in j order; stream(j) gives X[j, d] as a float. The loop runs to kMaxHc
// with a guard so that it unrolls: the GPU kernel's stream(j) reads a register array, which a loop bounded by
// the runtime n would put in local memory.
template <class Stream>
DSPARK_HD float hc_collapse(const float* pre, int n, Stream stream) {
  float acc = pre[0] * stream(0);
#pragma unroll
  for (int j = 1; j < kMaxHc; ++j)
    if (j < n) acc = dspark_mad(pre[j], stream(j), acc);
  return acc;
}

// X'[k, d] = post[k] · F[d] + Σ_j comb[j, k] · X[j, d].
template <class XT, class FT>
DSPARK_HD float hc_post_elem(const FT* f, const XT* x, const float* post, const float* comb, int n, int64_t D,
                             int k, int64_t d) {
  float acc = comb[k] * to_float(x[d]);
  for (int j = 1; j < n; ++j) acc = dspark_mad(comb[j * n + k], to_float(x[j * D + d]), acc);
  return dspark_mad(post[k], to_float(f[d]), acc);
}

}  // namespace dspark
