// Compile-only: the whole engine over the CUDA backend (Compute<Cuda>) instantiates under nvcc,
// every member of it, so a change to the backend seam (buffers, streams, the flow's kernels, the
// units' kernel set and arenas, the host copies) that the engine no longer fits stops CI here
// even on machines without a GPU. Stage 1 is instantiated member by member; stages 2-3 refuse
// some members with static_asserts (the split backward), so stage 3 is instantiated through its
// public calls below. ZeRO-Offload (Offload<CPU>) is instantiated member by member at stage 1
// as well; test_engine_cuda.cu trains it on a GPU.
#include <zero/engine/cuda_backend.cuh>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>

template class zero::engine::Engine<zero::nn::GPT<zero::bf16>, zero::ZeroStage<1>,
                                    zero::Precision<zero::bf16>, zero::Compute<zero::Cuda>>;
template class zero::engine::Engine<zero::nn::GPT<zero::bf16>, zero::ZeroStage<1>,
                                    zero::Precision<zero::bf16>, zero::Offload<zero::CPU>,
                                    zero::Compute<zero::Cuda>>;

namespace zero::test {
// Stage 3's micro-step and update, instantiated (never called).
void engine_cuda_stage3(
    zero::Engine<nn::GPT<bf16>, ZeroStage<3>, Precision<bf16>, Compute<Cuda>>& engine,
    const engine::MicroBatch& batch) {
  engine.forward(batch);
  engine.backward();
  engine.step();
  (void)engine.gather_unit_values(0);
}
}  // namespace zero::test
