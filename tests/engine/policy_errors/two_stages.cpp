// Must not compile: two ZeroStage tags.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<1>, zero::ZeroStage<2>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
