// Maps the few CUDA runtime/intrinsic names the GPU kernels use onto HIP, so gpu_ffi.cu compiles with nvcc
// and with hipcc (HIP_PLATFORM=amd). A "warp" here is always 32 logical lanes (on wave64 AMD GPUs a
// wavefront holds two of them; the shuffles are width-32).
//
// gpu_copy_async(dst, src_global, bytes) copies 4, 8 or 16 bytes from global to shared memory at
// dst = gpu_smem(pointer) + offset: asynchronously on CUDA (cp.async, sm_80+; visible after gpu_copy_wait<n>
// left at most n of this thread's committed groups pending, plus a warp barrier), synchronously on HIP. dst is
// the 32-bit shared-window address on CUDA, so a run of copies converts its pointer once and takes constant
// offsets; the pointer itself on HIP.
#pragma once
#include <cstdint>

#if defined(__HIPCC__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
typedef hipStream_t gpuStream_t;
typedef hipError_t gpuError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define DSPARK_GPU_PLATFORM_SUFFIX Rocm
#define gpuGetDevice hipGetDevice
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeSharedMemPerBlockOptin
#define gpuDevAttrMaxSharedMemoryPerMultiprocessor hipDeviceAttributeMaxSharedMemoryPerMultiprocessor
#define gpuFuncSetAttribute hipFuncSetAttribute
#define gpuFuncAttributes hipFuncAttributes
#define gpuFuncGetAttributes hipFuncGetAttributes
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
__device__ __forceinline__ float gpu_shfl_xor(float v, int mask) { return __shfl_xor(v, mask, 32); }
__device__ __forceinline__ void gpu_syncwarp() { __builtin_amdgcn_wave_barrier(); }
__device__ __forceinline__ bool gpu_any(bool pred) { return __any(pred); }
// The 32 logical lanes' votes (on wave64 the half of the wavefront this lane is in).
__device__ __forceinline__ uint32_t gpu_ballot(bool pred) { return (uint32_t)(__ballot(pred) >> (__lane_id() & 32)); }
__device__ __forceinline__ int gpu_dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
  return c;
}
// Byte k of the result is byte sel[4k+2..4k] of the eight bytes {b, a} (a the low word): selector nibbles
// must be below 8 (CUDA's prmt would read their top bit as a sign-replicate flag; __byte_perm masks it off
// with one more instruction per call).
__device__ __forceinline__ uint32_t gpu_byte_select(uint32_t a, uint32_t b, uint32_t sel) { return __byte_perm(a, b, sel); }
typedef uint8_t* gpu_smem_t;
__device__ __forceinline__ gpu_smem_t gpu_smem(void* p) { return static_cast<uint8_t*>(p); }
__device__ __forceinline__ void gpu_copy_async(gpu_smem_t dst, const void* src, int bytes) {
  if (bytes == 16) *reinterpret_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  else if (bytes == 8) *reinterpret_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  else *reinterpret_cast<uint32_t*>(dst) = *static_cast<const uint32_t*>(src);
}
__device__ __forceinline__ void gpu_copy_commit() {}
// Programmatic dependent launch is CUDA's (sm_90+); on HIP a kernel starts after the one before it, so these do nothing.
__device__ __forceinline__ void gpu_launch_dependents() {}
__device__ __forceinline__ void gpu_wait_for_predecessor() {}
template <int n>
__device__ __forceinline__ void gpu_copy_wait() {}
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
typedef cudaStream_t gpuStream_t;
typedef cudaError_t gpuError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define DSPARK_GPU_PLATFORM_SUFFIX Cuda
#define gpuGetDevice cudaGetDevice
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrMaxSharedMemoryPerBlockOptin cudaDevAttrMaxSharedMemoryPerBlockOptin
#define gpuDevAttrMaxSharedMemoryPerMultiprocessor cudaDevAttrMaxSharedMemoryPerMultiprocessor
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributes cudaFuncAttributes
#define gpuFuncGetAttributes cudaFuncGetAttributes
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
__device__ __forceinline__ float gpu_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ void gpu_syncwarp() { __syncwarp(); }
__device__ __forceinline__ bool gpu_any(bool pred) { return __any_sync(0xffffffffu, pred); }
__device__ __forceinline__ uint32_t gpu_ballot(bool pred) { return __ballot_sync(0xffffffffu, pred); }
__device__ __forceinline__ int gpu_dp4a(int a, int b, int c) { return __dp4a(a, b, c); }
__device__ __forceinline__ uint32_t gpu_byte_select(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
typedef uint32_t gpu_smem_t;
__device__ __forceinline__ gpu_smem_t gpu_smem(void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void gpu_copy_async(gpu_smem_t dst, const void* src, int bytes) {
  if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else if (bytes == 8) asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void gpu_copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int n>
__device__ __forceinline__ void gpu_copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(n)); }
// Programmatic dependent launch (sm_90+): gpu_launch_dependents lets the next kernel on the stream, if launched
// with launch_dependent (gpu_ffi.cu), start before this one ends; that kernel's gpu_wait_for_predecessor returns
// once this one has ended and its writes are visible. Both do nothing when built for older GPUs (and
// launch_dependent then launches in order).
__device__ __forceinline__ void gpu_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void gpu_wait_for_predecessor() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#endif
