// Must not compile: an argument that is not a policy tag.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
using Eng = zero::Engine<zero::nn::GPT<float>, int>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
