// Must not compile: there is no ZeRO stage 4.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<4>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
