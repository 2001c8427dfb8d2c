// Argument checking and dispatch shared by the CPU and GPU FFI handlers (host code only).
//
// Every op takes an explicit leading token axis T. Shapes are validated here once, so the CPU and GPU
// handlers agree on what is accepted; errors name the argument at fault.
#pragma once
#include <cstdint>
#include <string>

#include "hc_math.h"
#include "quant_formats.h"
#include "xla/ffi/api/ffi.h"

namespace dspark {
namespace ffi = xla::ffi;

// Problem size of qmatmul (E = 1) and qmatmul_id (E experts, k selected per token).
struct QDims {
  int64_t T = 0, K = 0, N = 0, row_bytes = 0, E = 1, k = 1;
  int block = 0, block_bytes = 0;
};

inline ffi::Error arg_error(const std::string& msg) { return ffi::Error::InvalidArgument("dsparkjax: " + msg); }

// x [T, K] (f32 | bf16), w [N, row_bytes] or [E, N, row_bytes] (u8), optional ids [T, k] (s32).
inline ffi::Error check_qdims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, int32_t ggml_type, bool moe,
                              QDims* d) {
  if (!visit_format(ggml_type, [&](auto fmt) {
        d->block = decltype(fmt)::kBlock;
        d->block_bytes = decltype(fmt)::kBytes;
      }))
    return arg_error("unsupported ggml_type " + std::to_string(ggml_type));
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16)
    return arg_error("x must be float32 or bfloat16");
  if (w.element_type() != ffi::DataType::U8) return arg_error("w_packed must be uint8");
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2) return arg_error("x must be [T, K]");
  if (wd.size() != (moe ? 3u : 2u)) return arg_error(moe ? "w_packed must be [E, N, row_bytes]" : "w_packed must be [N, row_bytes]");
  d->T = xd[0];
  d->K = xd[1];
  d->E = moe ? wd[0] : 1;
  d->N = wd[wd.size() - 2];
  d->row_bytes = wd[wd.size() - 1];
  if (d->K % d->block != 0)
    return arg_error("K=" + std::to_string(d->K) + " is not a multiple of the block size " + std::to_string(d->block));
  if (d->row_bytes != d->K / d->block * d->block_bytes)
    return arg_error("w_packed row has " + std::to_string(d->row_bytes) + " bytes, expected " +
                     std::to_string(d->K / d->block * d->block_bytes) + " for K=" + std::to_string(d->K));
  return ffi::Error::Success();
}

inline ffi::Error check_ids(const ffi::AnyBuffer& ids, QDims* d) {
  const auto idd = ids.dimensions();
  if (ids.element_type() != ffi::DataType::S32 || idd.size() != 2 || idd[0] != d->T)
    return arg_error("ids must be int32 [T, k] with the T of x");
  d->k = idd[1];
  return ffi::Error::Success();
}

// `groups` of a qmatmul_id call: 0, or G > 0 for a grouped projection, whose ids are p mod G for slot p of T = G · T'
// rows, one id each (the GPU may then take the tensor-core kernel, which does not read them).
inline ffi::Error check_groups(const QDims& d, int32_t groups) {
  if (groups < 0 || (groups > 0 && (d.E != groups || d.k != 1 || d.T % groups != 0)))
    return arg_error("qmatmul_id: groups = " + std::to_string(groups) + " needs E = groups, ids [T, 1] and T a multiple "
                     "of groups (got E = " + std::to_string(d.E) + ", k = " + std::to_string(d.k) + ", T = " +
                     std::to_string(d.T) + ")");
  return ffi::Error::Success();
}

// HC sizes: streams [T, n, D] (f32 | bf16), fn [M, n*D] or [L, M, n*D] (f32 | f16 | bf16), base [M], scale [3].
struct HcDims {
  int64_t T = 0, n = 0, D = 0, M = 0;
  int64_t L = 1;  // HC-pre: the layers of a stacked fn
};

inline bool is_float_type(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline ffi::Error check_hc_streams(const ffi::AnyBuffer& streams, HcDims* d) {
  const auto sd = streams.dimensions();
  if (sd.size() != 3 || !is_float_type(streams.element_type())) return arg_error("streams must be float [T, n, D]");
  d->T = sd[0];
  d->n = sd[1];
  d->D = sd[2];
  if (d->n < 1 || d->n > kMaxHc) return arg_error("hc stream count n must be in 1..8");
  return ffi::Error::Success();
}

// HC-pre's workspace [T, C, M + 1] (float32), C = hc_mix_chunks(n·D): the GPU's mix kernel sums each token's
// flattened streams in C chunks of kHcMixChunk values, one float per chunk for each of the M mix rows and one for
// the sum of squares (the plugins export the number, DsparkHcMixChunk, for ffi.py to size it). The CPU keeps a
// token's M mix values at the front of its [C, M + 1] slice.
constexpr int64_t kHcMixChunk = 2048;
inline int64_t hc_mix_chunks(int64_t F) { return (F + kHcMixChunk - 1) / kHcMixChunk; }

// HC-pre's fn is [M, n·D], or a stack [L, M, n·D] of which the call reads layer `layer` (int32 [], clamped into
// [0, L) as XLA's dynamic-slice clamps) in place: a scanned body's layer, not sliced out for each call.
inline ffi::Error check_hc_pre(const ffi::AnyBuffer& streams, const ffi::AnyBuffer& fn, const ffi::AnyBuffer& layer,
                               const ffi::AnyBuffer& base, const ffi::AnyBuffer& scale,
                               const ffi::AnyBuffer& workspace, HcDims* d) {
  if (auto e = check_hc_streams(streams, d); e.failure()) return e;
  const auto fd = fn.dimensions();
  const size_t r = fd.size();
  d->M = (2 + d->n) * d->n;
  d->L = r == 3 ? fd[0] : 1;
  if ((r != 2 && r != 3) || d->L < 1 || fd[r - 2] != d->M || fd[r - 1] != d->n * d->D ||
      !is_float_type(fn.element_type()))
    return arg_error("fn must be float [(2+n)*n, n*D] or a stack of them [L, (2+n)*n, n*D]");
  if (layer.element_type() != ffi::DataType::S32 || layer.element_count() != 1)
    return arg_error("hc_pre layer must be int32 []");
  if (base.element_type() != ffi::DataType::F32 || (int64_t)base.element_count() != d->M) return arg_error("base must be float32 [(2+n)*n]");
  if (scale.element_type() != ffi::DataType::F32 || scale.element_count() != 3) return arg_error("scale must be float32 [3]");
  if (workspace.element_type() != ffi::DataType::F32 ||
      (int64_t)workspace.element_count() != d->T * hc_mix_chunks(d->n * d->D) * (d->M + 1))
    return arg_error("hc_pre workspace must be float32 [T, ceil(n*D/" + std::to_string(kHcMixChunk) + "), (2+n)*n + 1]");
  return ffi::Error::Success();
}

// HC-post: block_out [T, D] (float), streams [T, n, D] (float), post [T, n] and comb [T, n, n] (float32).
inline ffi::Error check_hc_post(const ffi::AnyBuffer& block_out, const ffi::AnyBuffer& streams,
                                const ffi::AnyBuffer& post, const ffi::AnyBuffer& comb, HcDims* d) {
  if (auto e = check_hc_streams(streams, d); e.failure()) return e;
  const auto bd = block_out.dimensions();
  if (bd.size() != 2 || bd[0] != d->T || bd[1] != d->D || !is_float_type(block_out.element_type()))
    return arg_error("block_out must be float [T, D] matching streams");
  if (post.element_type() != ffi::DataType::F32 || (int64_t)post.element_count() != d->T * d->n)
    return arg_error("post must be float32 [T, n]");
  if (comb.element_type() != ffi::DataType::F32 || (int64_t)comb.element_count() != d->T * d->n * d->n)
    return arg_error("comb must be float32 [T, n, n]");
  return ffi::Error::Success();
}

// RMSNorm: x [T, K] (f32 | bf16), w [K] (f32), y [T, K] (f32).
struct NormDims {
  int64_t T = 0, K = 0;
};

inline ffi::Error check_rms_norm(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& y,
                                 NormDims* d) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16))
    return arg_error("rms_norm: x must be float32 or bfloat16 [T, K]");
  d->T = xd[0];
  d->K = xd[1];
  if (w.element_type() != ffi::DataType::F32 || (int64_t)w.element_count() != d->K)
    return arg_error("rms_norm: w must be float32 [K] with the K of x");
  if (y.element_type() != ffi::DataType::F32 || (int64_t)y.element_count() != d->T * d->K)
    return arg_error("rms_norm: y must be float32 [T, K]");
  return ffi::Error::Success();
}

// Grouped float products (the invariant step's attention products): x [G, M, K] (f32), w [G, N, K], or [G, K, N]
// when `transposed` is 1 (f32 | bf16 | f16), or a stack [L, G, ...] of such of which the call reads layer `layer`
// (int32 [], clamped into [0, L) as XLA's dynamic-slice clamps) in place, y [G, M, N] (f32):
// y[g, m, n] = Σ_k x[g, m, k] · w[g][n, k] (or w[g][k, n]), each output one multiply-add chain over k = 0, 1, ...,
// K - 1 (dspark_mad), so its bits depend on K alone: not on G, M, N or how a device tiles the call.
struct GroupedDims {
  int64_t G = 0, M = 0, N = 0, K = 0;
  int64_t L = 1;  // the layers of a stacked w
};

inline ffi::Error check_grouped_matmul(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& layer,
                                       const ffi::AnyBuffer& y, int32_t transposed, GroupedDims* d) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 3 || x.element_type() != ffi::DataType::F32)
    return arg_error("grouped_matmul: x must be float32 [G, M, K]");
  if (transposed != 0 && transposed != 1)
    return arg_error("grouped_matmul: transposed must be 0 (w [G, N, K]) or 1 (w [G, K, N]), got " +
                     std::to_string(transposed));
  d->G = xd[0];
  d->M = xd[1];
  d->K = xd[2];
  const size_t r = wd.size(), lead = r - 3;  // lead 1: a stack of layers
  if ((r != 3 && r != 4) || !is_float_type(w.element_type()) || wd[lead] != d->G ||
      wd[lead + (transposed ? 1 : 2)] != d->K || (lead == 1 && wd[0] < 1))
    return arg_error(transposed ? "grouped_matmul: w must be float [G, K, N] (or a stack [L, G, K, N]) with the G "
                                  "and K of x"
                                : "grouped_matmul: w must be float [G, N, K] (or a stack [L, G, N, K]) with the G "
                                  "and K of x");
  d->L = lead == 1 ? wd[0] : 1;
  d->N = wd[lead + (transposed ? 2 : 1)];
  if (layer.element_type() != ffi::DataType::S32 || layer.element_count() != 1)
    return arg_error("grouped_matmul: layer must be int32 []");
  if (y.element_type() != ffi::DataType::F32 || (int64_t)y.element_count() != d->G * d->M * d->N)
    return arg_error("grouped_matmul: y must be float32 [G, M, N]");
  return ffi::Error::Success();
}

// Calls f(T{}) with T = float, bf16_t or f16_t for the buffer's element type.
template <class F>
void visit_float(ffi::DataType t, F&& f) {
  if (t == ffi::DataType::BF16) f(bf16_t{});
  else if (t == ffi::DataType::F16) f(f16_t{});
  else f(float{});
}

// The tensor-core mode of a GPU matmul call, the `mma` attribute (dsparkjax/kernels/policy.py, KernelPolicy.mma):
// kOff leaves every call to the matvec, kAuto takes the calls where tuning.h says the MMA kernel pays, kForce
// every call of two or more tokens it can serve (how the tests reach it on small shapes). The CPU checks it only.
enum class MmaMode : int32_t { kOff = 0, kAuto = 1, kForce = 2 };

inline ffi::Error check_mma(int32_t mma, MmaMode* mode) {
  if (mma < 0 || mma > 2) return arg_error("mma must be 0 (off), 1 (auto) or 2 (force), got " + std::to_string(mma));
  *mode = static_cast<MmaMode>(mma);
  return ffi::Error::Success();
}

// The handlers' calling convention (arguments and attributes); ffi.py refuses a plugin of another one. Bump it
// whenever a handler's binding changes. 2: the matmuls take the `mma` attribute. 3: HC-pre and indexer_topk take
// a layer operand. 4: grouped_matmul.
constexpr int32_t kPluginAbi = 4;

}  // namespace dspark

// What ffi.py reads from a plugin before registering its handlers: the FFI API version the handlers were
// compiled against (checked against the runtime's), the handlers' calling convention (kPluginAbi) and HC-pre's
// mix chunk (sizes the workspace).
extern "C" __attribute__((visibility("default"))) int32_t DsparkFfiApiMajor();
extern "C" __attribute__((visibility("default"))) int32_t DsparkFfiApiMinor();
extern "C" __attribute__((visibility("default"))) int64_t DsparkHcMixChunk();
extern "C" __attribute__((visibility("default"))) int32_t DsparkPluginAbi();
#define DSPARK_DEFINE_PLUGIN_INFO                                       \
  extern "C" int32_t DsparkFfiApiMajor() { return XLA_FFI_API_MAJOR; } \
  extern "C" int32_t DsparkFfiApiMinor() { return XLA_FFI_API_MINOR; } \
  extern "C" int64_t DsparkHcMixChunk() { return dspark::kHcMixChunk; } \
  extern "C" int32_t DsparkPluginAbi() { return dspark::kPluginAbi; }
