// Maps the few CUDA runtime/intrinsic names the GPU kernels use onto HIP, so gpu_ffi.cu compiles with nvcc
// and with hipcc (HIP_PLATFORM=amd). A "warp" here is always 32 logical lanes (on wave64 AMD GPUs a
// wavefront holds two of them; the shuffles are width-32).
#pragma once

#if defined(__HIPCC__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
typedef hipStream_t gpuStream_t;
typedef hipError_t gpuError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define DSPARK_GPU_PLATFORM_SUFFIX Rocm
__device__ __forceinline__ float gpu_shfl_xor(float v, int mask) { return __shfl_xor(v, mask, 32); }
__device__ __forceinline__ void gpu_syncwarp() { __builtin_amdgcn_wave_barrier(); }
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
typedef cudaStream_t gpuStream_t;
typedef cudaError_t gpuError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define DSPARK_GPU_PLATFORM_SUFFIX Cuda
__device__ __forceinline__ float gpu_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ void gpu_syncwarp() { __syncwarp(); }
#endif
