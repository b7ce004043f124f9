// Must not compile: offloading without partitioned optimizer states.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<0>, zero::Offload<zero::NVMe>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
