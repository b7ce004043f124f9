// Must not compile: a bf16 engine over an f32 model.
#include <parallel/comm/local_comm.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<3>, zero::Precision<zero::bf16>>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
