#pragma once
// Umbrella header: everything in namespace zero that compiles with a host compiler alone and
// needs no optional part (MPI, CUDA, liburing): the engine, zero::dispatch and the policy tags
// included. Communicators are in <parallel/comm/...> (LocalComm, MpiComm), optimizers in
// <optim/...>.

#include <zero/config.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/data/byte_tokenizer.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/token_file.hpp>
#include <zero/engine/dispatch.hpp>
#include <zero/engine/engine.hpp>
#include <zero/engine/partition.hpp>
#include <zero/io/gpt2_layout.hpp>
#include <zero/io/safetensors.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/policies/compute.hpp>
#include <zero/policies/offload.hpp>
#include <zero/policies/policy_list.hpp>
#include <zero/policies/precision.hpp>
#include <zero/policies/zero_stage.hpp>
#include <zero/version.hpp>
