// Must not compile: Offload<CPU> while computing on the host.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<2>, zero::Offload<zero::CPU>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
