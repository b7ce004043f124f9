// train_llama_cuda: train_llama.cpp compiled by nvcc, which adds --device cuda (the engine on the
// GPU: Compute<Cuda>, bf16, CudaLocalComm or NcclComm). Everything else is train_llama's; see the
// top of train_llama.cpp for the flags.
#include <zero/engine/cuda_backend.cuh>  // before anything names Compute<Cuda>

#include "train_llama.cpp"
