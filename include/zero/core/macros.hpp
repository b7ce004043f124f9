#pragma once
// Portability macros shared by host (.hpp) and device (.cuh) code.

#if defined(__CUDACC__)
#define ZERO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZERO_HOST_DEVICE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ZERO_RESTRICT __restrict__
#else
#define ZERO_RESTRICT
#endif
