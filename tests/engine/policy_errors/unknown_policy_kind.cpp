// Must not compile: a policy tag whose kind the engine does not read would be ignored silently.
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
struct bucket_policy {};
struct Buckets {
  using kind = bucket_policy;
};
using Eng = zero::Engine<zero::nn::GPT<float>, zero::ZeroStage<1>, Buckets>;
int main() {
  return sizeof(Eng) > 0 ? 0 : 1;
}
