// mHC arithmetic shared by the CPU and GPU kernels (fp32 throughout; quant_hc.md §3, model/hc.py).
//
// Per token: mix = (flat(X) · fnᵀ) · rsqrt(mean(flat²) + norm_eps) is computed by the caller; hc_gates
// turns the mix into the pre/post gates and the Sinkhorn-normalised comb; hc_collapse and hc_post_elem are
// the per-element sums. Every loop has a fixed order, so a token's result never depends on other tokens.
#pragma once
#include <math.h>

#include "dspark_hd.h"

namespace dspark {

DSPARK_HD float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

// mix [M=(2+n)n], base [M], scale [3] -> pre [n], post [n], comb [n*n] (row j = source, column k = destination).
DSPARK_HD void hc_gates(const float* mix, const float* base, const float* scale, int n, int iters, float eps,
                        float* pre, float* post, float* comb) {
  for (int j = 0; j < n; ++j) {
    pre[j] = sigmoidf(mix[j] * scale[0] + base[j]) + eps;
    post[j] = 2.0f * sigmoidf(mix[n + j] * scale[1] + base[n + j]);
  }
  const float* lg = mix + 2 * n;
  const float* lb = base + 2 * n;
  for (int j = 0; j < n; ++j) {  // row softmax, then + eps
    float mx = -INFINITY;
    for (int k = 0; k < n; ++k) mx = fmaxf(mx, lg[j * n + k] * scale[2] + lb[j * n + k]);
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) {
      comb[j * n + k] = expf(lg[j * n + k] * scale[2] + lb[j * n + k] - mx);
      sum += comb[j * n + k];
    }
    for (int k = 0; k < n; ++k) comb[j * n + k] = comb[j * n + k] / sum + eps;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {  // rows (iterations 2..iters), then columns (every iteration)
      for (int j = 0; j < n; ++j) {
        float s = 0.0f;
        for (int k = 0; k < n; ++k) s += comb[j * n + k];
        for (int k = 0; k < n; ++k) comb[j * n + k] /= s + eps;
      }
    }
    for (int k = 0; k < n; ++k) {
      float s = 0.0f;
      for (int j = 0; j < n; ++j) s += comb[j * n + k];
      for (int j = 0; j < n; ++j) comb[j * n + k] /= s + eps;
    }
  }
}

// u[d] = Σ_j pre[j] · X[j, d], summed in j order. X is the token's [n, D] streams.
template <class XT>
DSPARK_HD float hc_collapse(const XT* x, const float* pre, int n, int64_t D, int64_t d) {
  float acc = pre[0] * to_float(x[d]);
  for (int j = 1; j < n; ++j) acc = dspark_mad(pre[j], to_float(x[j * D + d]), acc);
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
