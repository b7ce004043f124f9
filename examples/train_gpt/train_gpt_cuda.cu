// train_gpt_cuda: train_gpt.cpp compiled by nvcc, which adds --device cuda (the engine on the
// GPU: Compute<Cuda>, CudaLocalComm). Everything else is train_gpt's; see the top of
// train_gpt.cpp for the flags.
#include <zero/engine/cuda_backend.cuh>  // before anything names Compute<Cuda>

#include "train_gpt.cpp"
