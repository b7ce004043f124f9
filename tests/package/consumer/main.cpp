// Uses a little of everything a downstream program would: dtypes, tensors, the RNG, errors.
#include <cstdio>

#include <zero/zero.hpp>

int main() {
  zero::Buffer<float> weights(1024);
  const zero::CounterRng rng(zero::CounterRng::key_for(1234, "transformer.wte.weight"));
  zero::fill_normal(weights.view(), rng, 0, 0.0, 0.02);
  const zero::bf16 half(weights.view().at(0));
  try {
    (void)weights.view().reshape({7, 7});
    return 1;
  } catch (const zero::ShapeError&) {
  }
  int parts = 0;
#if defined(ZERO_WITH_BLAS)
  ++parts;
#endif
#if defined(ZERO_WITH_MPI)
  ++parts;
#endif
  std::printf("consumer ok: zero %s, bf16 %g, %d optional parts\n", zero::version_string,
              static_cast<double>(static_cast<float>(half)), parts);
  return 0;
}
