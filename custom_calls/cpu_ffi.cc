// CPU FFI handlers: packed quantized matmul (dense and MoE-by-id) and mHC pre/post.
//
// Accumulation order (batch invariance): for each output (token, row) the K axis is walked block by block,
// 8 weights at a time, into 8 lane accumulators that are summed by a fixed tree at the end. Tokens are
// processed in chunks of up to kCols against one decoded group of weights, but each token keeps its own
// accumulators, so a row's bits do not depend on T or on the other tokens of the call.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_i8_model.h"
#include "cpu_indexer.h"
#include "ffi_common.h"
#include "hc_math.h"

namespace dspark {
namespace {

constexpr int kCols = 8;  // tokens sharing one decode of a weight group

DSPARK_HD float tree8(const float a[8]) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// y[c][n] = Σ_k W[n, k] · x[c][k] for rows n in [0, N) of `w` and ncols <= kCols token columns.
template <class Fmt, class XT>
void rows_dot(const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes, const XT* const* x, float* const* y,
              int64_t y_stride, int ncols) {
  const int64_t nblocks = K / Fmt::kBlock;
  for (int64_t n = 0; n < N; ++n) {
    float acc[kCols][8] = {};
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < nblocks; ++b) {
      for (int g = 0; g < Fmt::kBlock / 8; ++g) {
        float wv[8];
        Fmt::decode8(row + b * Fmt::kBytes, g, wv);
        const int64_t k0 = b * Fmt::kBlock + 8 * g;
        for (int c = 0; c < ncols; ++c)
          for (int j = 0; j < 8; ++j) acc[c][j] = dspark_mad(wv[j], to_float(x[c][k0 + j]), acc[c][j]);
      }
    }
    for (int c = 0; c < ncols; ++c) y[c][n * y_stride] = tree8(acc[c]);
  }
}

template <class XT>
ffi::Error qmatmul_typed(const QDims& d, int32_t ggml_type, const XT* x, const uint8_t* w, float* y) {
  visit_format(ggml_type, [&](auto fmt) {
    using Fmt = decltype(fmt);
    for (int64_t t0 = 0; t0 < d.T; t0 += kCols) {
      const XT* xs[kCols];
      float* ys[kCols];
      const int nc = (int)std::min<int64_t>(kCols, d.T - t0);
      for (int c = 0; c < nc; ++c) {
        xs[c] = x + (t0 + c) * d.K;
        ys[c] = y + (t0 + c) * d.N;
      }
      rows_dot<Fmt>(w, d.N, d.K, d.row_bytes, xs, ys, 1, nc);
    }
  });
  return ffi::Error::Success();
}

ffi::Error QMatmulCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, int32_t ggml_type,
                      int32_t mma) {
  QDims d;
  MmaMode mode;
  if (auto e = check_qdims(x, w, ggml_type, false, &d); e.failure()) return e;
  if (auto e = check_mma(mma, &mode); e.failure()) return e;
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  if (x.element_type() == ffi::DataType::BF16)
    return qmatmul_typed(d, ggml_type, static_cast<const bf16_t*>(x.untyped_data()), wp, yp);
  return qmatmul_typed(d, ggml_type, static_cast<const float*>(x.untyped_data()), wp, yp);
}

// The GPU integer path's arithmetic on the CPU (cpu_i8_model.h), for the formats that path serves and rows it
// can stage (a multiple of 4 bytes): the CPU tests' check of its numerics, and the GPU tests' exact oracle.
ffi::Error QMatmulI8ModelCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, int32_t ggml_type) {
  QDims d;
  if (auto e = check_qdims(x, w, ggml_type, false, &d); e.failure()) return e;
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  const void* xp = x.untyped_data();
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  ffi::Error result = ffi::Error::Success();
  const bool served = i8math::visit_i8_format(ggml_type, [&](auto fmt) {
    using Fmt = decltype(fmt);
    if (d.row_bytes % 4 != 0)
      result = arg_error("the integer path needs rows of a multiple of 4 bytes, got " + std::to_string(d.row_bytes));
    else if (bf16) i8model::qmatmul<Fmt>(wp, d.N, d.K, d.row_bytes, static_cast<const bf16_t*>(xp), d.T, yp);
    else i8model::qmatmul<Fmt>(wp, d.N, d.K, d.row_bytes, static_cast<const float*>(xp), d.T, yp);
    return true;
  });
  if (!served)
    return arg_error("the integer-path model serves Q8_0, Q2_K, Q4_K and IQ2_XXS, not ggml type " +
                     std::to_string(ggml_type));
  return result;
}

// MoE: y[t, j, :] = W[ids[t, j]] · x[t]. Each distinct expert is decoded once per chunk of kCols (t, j) pairs;
// ids outside [0, E) give zero rows.
template <class XT>
ffi::Error qmatmul_id_typed(const QDims& d, int32_t ggml_type, const XT* x, const uint8_t* w, const int32_t* ids,
                            float* y) {
  const int64_t P = d.T * d.k;
  std::vector<char> done(P, 0);
  std::vector<int64_t> pairs;
  visit_format(ggml_type, [&](auto fmt) {
    using Fmt = decltype(fmt);
    for (int64_t p = 0; p < P; ++p) {
      if (done[p]) continue;
      const int32_t e = ids[p];
      pairs.clear();
      for (int64_t q = p; q < P; ++q)
        if (ids[q] == e) {
          pairs.push_back(q);
          done[q] = 1;
        }
      if (e < 0 || e >= d.E) {
        for (int64_t q : pairs) std::memset(y + q * d.N, 0, sizeof(float) * d.N);
        continue;
      }
      for (size_t c0 = 0; c0 < pairs.size(); c0 += kCols) {
        const XT* xs[kCols];
        float* ys[kCols];
        const int nc = (int)std::min<size_t>(kCols, pairs.size() - c0);
        for (int c = 0; c < nc; ++c) {
          xs[c] = x + (pairs[c0 + c] / d.k) * d.K;
          ys[c] = y + pairs[c0 + c] * d.N;
        }
        rows_dot<Fmt>(w + e * d.N * d.row_bytes, d.N, d.K, d.row_bytes, xs, ys, 1, nc);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error QMatmulIdCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> y,
                        int32_t ggml_type, int32_t groups, int32_t mma) {
  QDims d;
  MmaMode mode;
  if (auto e = check_qdims(x, w, ggml_type, true, &d); e.failure()) return e;
  if (auto e = check_mma(mma, &mode); e.failure()) return e;
  if (auto e = check_ids(ids, &d); e.failure()) return e;
  if (auto e = check_groups(d, groups); e.failure()) return e;  // the ids say the same: the CPU reads them
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const auto* ip = static_cast<const int32_t*>(ids.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  if (x.element_type() == ffi::DataType::BF16)
    return qmatmul_id_typed(d, ggml_type, static_cast<const bf16_t*>(x.untyped_data()), wp, ip, yp);
  return qmatmul_id_typed(d, ggml_type, static_cast<const float*>(x.untyped_data()), wp, ip, yp);
}

// Σ a[i]·b[i] over 8 lane accumulators with a fixed final tree (len is any size; the tail goes to lane 0..).
template <class AT, class BT>
float dot8(const AT* a, const BT* b, int64_t len) {
  float acc[8] = {};
  for (int64_t i = 0; i < len; ++i) acc[i & 7] = dspark_mad(to_float(a[i]), to_float(b[i]), acc[i & 7]);
  return tree8(acc);
}

ffi::Error HcPreCpu(ffi::AnyBuffer streams, ffi::AnyBuffer fn, ffi::AnyBuffer layer, ffi::AnyBuffer base,
                    ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> u, ffi::Result<ffi::AnyBuffer> post,
                    ffi::Result<ffi::AnyBuffer> comb, ffi::Result<ffi::AnyBuffer> workspace, int32_t iters,
                    float hc_eps, float norm_eps) {
  HcDims d;
  if (auto e = check_hc_pre(streams, fn, layer, base, scale, *workspace, &d); e.failure()) return e;
  const int64_t l = std::clamp<int64_t>(*static_cast<const int32_t*>(layer.untyped_data()), 0, d.L - 1);
  const int n = (int)d.n;
  const int64_t F = d.n * d.D;
  const auto* bp = static_cast<const float*>(base.untyped_data());
  const auto* sp = static_cast<const float*>(scale.untyped_data());
  auto* up = static_cast<float*>(u->untyped_data());
  auto* pp = static_cast<float*>(post->untyped_data());
  auto* cp = static_cast<float*>(comb->untyped_data());
  auto* mp = static_cast<float*>(workspace->untyped_data());
  const int64_t slice = hc_mix_chunks(F) * (d.M + 1);  // a token's workspace; its mix goes at the front
  visit_float(streams.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    const auto* xp = static_cast<const XT*>(streams.untyped_data());
    visit_float(fn.element_type(), [&](auto ft) {
      using FT = decltype(ft);
      const auto* fp = static_cast<const FT*>(fn.untyped_data()) + l * d.M * F;
      for (int64_t t = 0; t < d.T; ++t) {
        const XT* xt_ = xp + t * F;
        const float rs = 1.0f / std::sqrt(dot8(xt_, xt_, F) / (float)F + norm_eps);
        float* m = mp + t * slice;
        for (int64_t r = 0; r < d.M; ++r) m[r] = dot8(xt_, fp + r * F, F) * rs;
        float pre[kMaxHc];
        hc_gates(m, bp, sp, n, iters, hc_eps, pre, pp + t * n, cp + t * n * n);
        for (int64_t i = 0; i < d.D; ++i)
          up[t * d.D + i] = hc_collapse(pre, n, [&](int j) { return to_float(xt_[j * d.D + i]); });
      }
    });
  });
  return ffi::Error::Success();
}

ffi::Error HcPostCpu(ffi::AnyBuffer block_out, ffi::AnyBuffer streams, ffi::AnyBuffer post, ffi::AnyBuffer comb,
                     ffi::Result<ffi::AnyBuffer> out) {
  HcDims d;
  if (auto e = check_hc_post(block_out, streams, post, comb, &d); e.failure()) return e;
  const int n = (int)d.n;
  const auto* pp = static_cast<const float*>(post.untyped_data());
  const auto* cp = static_cast<const float*>(comb.untyped_data());
  auto* op = static_cast<float*>(out->untyped_data());
  visit_float(streams.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    visit_float(block_out.element_type(), [&](auto ft) {
      using FT = decltype(ft);
      const auto* xp = static_cast<const XT*>(streams.untyped_data());
      const auto* fp = static_cast<const FT*>(block_out.untyped_data());
      for (int64_t t = 0; t < d.T; ++t)
        for (int k = 0; k < n; ++k)
          for (int64_t i = 0; i < d.D; ++i)
            op[(t * n + k) * d.D + i] =
                hc_post_elem(fp + t * d.D, xp + t * n * d.D, pp + t * n, cp + t * n * n, n, d.D, k, i);
    });
  });
  return ffi::Error::Success();
}

// RMSNorm of each row alone: y = (x · r) · w, r = 1 / sqrt(Σx² / K + eps), the Σ over 8 lanes and a fixed tree.
ffi::Error RmsNormCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, float eps) {
  NormDims d;
  if (auto e = check_rms_norm(x, w, *y, &d); e.failure()) return e;
  const auto* wp = static_cast<const float*>(w.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  visit_float(x.element_type(), [&](auto xt) {
    using XT = decltype(xt);
    const auto* xp = static_cast<const XT*>(x.untyped_data());
    for (int64_t t = 0; t < d.T; ++t) {
      const XT* row = xp + t * d.K;
      const float r = 1.0f / std::sqrt(dot8(row, row, d.K) / (float)d.K + eps);
      for (int64_t i = 0; i < d.K; ++i) yp[t * d.K + i] = to_float(row[i]) * r * wp[i];
    }
  });
  return ffi::Error::Success();
}

// Grouped float products: each output one dspark_mad chain over k in order (ffi_common.h), 8 outputs at a time so the
// chains overlap.
ffi::Error GroupedMatmulCpu(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> y,
                            int32_t transposed) {
  GroupedDims d;
  if (auto e = check_grouped_matmul(x, w, layer, *y, transposed, &d); e.failure()) return e;
  const int64_t l = std::clamp<int64_t>(*static_cast<const int32_t*>(layer.untyped_data()), 0, d.L - 1);
  const auto* xp = static_cast<const float*>(x.untyped_data());
  auto* yp = static_cast<float*>(y->untyped_data());
  constexpr int kOuts = 8;
  visit_float(w.element_type(), [&](auto wt) {
    using WT = decltype(wt);
    const auto* wp = static_cast<const WT*>(w.untyped_data()) + l * d.G * d.N * d.K;
    // w[g] element (n, k): [N, K] rows, or [K, N] when transposed
    const int64_t n_stride = transposed ? 1 : d.K, k_stride = transposed ? d.N : 1;
    for (int64_t g = 0; g < d.G; ++g) {
      const WT* wg = wp + g * d.N * d.K;
      for (int64_t m = 0; m < d.M; ++m) {
        const float* xr = xp + (g * d.M + m) * d.K;
        float* yr = yp + (g * d.M + m) * d.N;
        for (int64_t n0 = 0; n0 < d.N; n0 += kOuts) {
          const int outs = (int)std::min<int64_t>(kOuts, d.N - n0);
          float acc[kOuts] = {};
          for (int64_t k = 0; k < d.K; ++k)
            for (int j = 0; j < outs; ++j)
              acc[j] = dspark_mad(xr[k], to_float(wg[(n0 + j) * n_stride + k * k_stride]), acc[j]);
          for (int j = 0; j < outs; ++j) yr[n0 + j] = acc[j];
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dspark

namespace ffi = xla::ffi;
#define DSPARK_EXPORT extern "C" __attribute__((visibility("default")))

DSPARK_EXPORT XLA_FFI_Error* DsparkQMatmulCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkQMatmulCpu, dspark::QMatmulCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("ggml_type").Attr<int32_t>("mma"));

DSPARK_EXPORT XLA_FFI_Error* DsparkQMatmulI8ModelCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkQMatmulI8ModelCpu, dspark::QMatmulI8ModelCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("ggml_type"));

DSPARK_EXPORT XLA_FFI_Error* DsparkQMatmulIdCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkQMatmulIdCpu, dspark::QMatmulIdCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int32_t>("ggml_type").Attr<int32_t>("groups")
                                  .Attr<int32_t>("mma"));

DSPARK_EXPORT XLA_FFI_Error* DsparkHcPreCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkHcPreCpu, dspark::HcPreCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("iters").Attr<float>("hc_eps").Attr<float>("norm_eps"));

DSPARK_EXPORT XLA_FFI_Error* DsparkHcPostCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkHcPostCpu, dspark::HcPostCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

DSPARK_EXPORT XLA_FFI_Error* DsparkIndexerTopkCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkIndexerTopkCpu, dspark::IndexerTopkCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

DSPARK_EXPORT XLA_FFI_Error* DsparkRmsNormCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkRmsNormCpu, dspark::RmsNormCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));

DSPARK_EXPORT XLA_FFI_Error* DsparkGroupedMatmulCpu(XLA_FFI_CallFrame*);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkGroupedMatmulCpu, dspark::GroupedMatmulCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("transposed"));

DSPARK_DEFINE_PLUGIN_INFO
