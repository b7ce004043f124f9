// Must not compile: Offload<NVMe> keeps its gradient shard in host memory, so Compute<Cuda> has no
// form of it (dispatch refuses the pair at run time too).
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<2>, zero::Offload<zero::NVMe>,
                         zero::Compute<zero::Cuda>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
