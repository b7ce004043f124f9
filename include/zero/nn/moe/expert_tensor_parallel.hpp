#pragma once
// ExpertTensorParallel: how a tensor-parallel group of tp ranks splits a mixture's experts,
// Megatron's expert_tensor_parallel_size (zero's moe.expert_tensor_parallel_size):
//   hidden   (= tp, Megatron's default) every expert split as a GPT MLP is: each tp rank holds
//            H/tp hidden units of every expert of its ep rank; c_proj's partial sums are
//            all-reduced over tp;
//   experts  (= 1) whole experts, the tp ranks holding different ones: the experts split over
//            ep x tp ranks (MoE parallel folding: the tp ranks act as more expert-parallel
//            ranks), each tp rank running its experts on the tokens routed to them, their
//            outputs summed over tp. Fewer, larger GEMMs than `hidden` for small experts.

#include <cstdint>
#include <string_view>

#include <zero/core/error.hpp>

namespace zero::nn {

/// How a tensor-parallel group splits the experts (see the file comment).
enum class ExpertTensorParallel : unsigned char {
  hidden,   ///< expert_tensor_parallel_size = tp: each expert's hidden units split over tp
  experts,  ///< expert_tensor_parallel_size = 1: whole experts, different ones on each tp rank
};

/// "hidden" or "experts".
constexpr std::string_view name_of(ExpertTensorParallel s) {
  return s == ExpertTensorParallel::experts ? "experts" : "hidden";
}

/// The split a config's moe.expert_tensor_parallel_size asks for at tensor-parallel size tp: 0
/// (unset) or tp, each expert split over tp; 1, whole experts. ConfigError naming the key for
/// any other size (Megatron allows others; here an expert is split over all of tp or none of it).
inline ExpertTensorParallel expert_tensor_parallel_of(std::int64_t size, std::int64_t tp) {
  expect<ConfigError>(size == 0 || size == 1 || size == tp,
                      "moe.expert_tensor_parallel_size = ", size,
                      " with tensor_parallel.tp_size = ", tp,
                      ": expected 1 (whole experts, split over the tp ranks as more "
                      "expert-parallel ranks) or ",
                      tp, " (each expert's hidden units split over tp)");
  return size == 1 && tp > 1 ? ExpertTensorParallel::experts : ExpertTensorParallel::hidden;
}

}  // namespace zero::nn
