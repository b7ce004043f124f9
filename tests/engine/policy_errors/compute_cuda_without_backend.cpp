// Must not compile: Compute<Cuda> has no engine backend in this build.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<1>, zero::Compute<zero::Cuda>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
