// A tour of zero's core types: initialise a parameter the way ZeRO-3 does (each "rank" fills
// only the slice it owns from the per-name counter-based RNG), check the slices equal a
// single-process initialisation, store it in bf16, and take scratch memory from an arena.
//
//   ./core_tour [ranks] [elements]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <zero/zero.hpp>

#include "cli_number.hpp"

int main(int argc, char** argv) try {
  const int ranks =
      argc > 1 ? static_cast<int>(zero::examples::parse_integer("ranks", argv[1], 1, 1024)) : 4;
  const std::int64_t numel =
      argc > 2 ? zero::examples::parse_integer("elements", argv[2], 1, std::int64_t{1} << 40)
               : 768 * 2304;
  const std::string name = "transformer.h.0.attn.c_attn.weight";
  const zero::CounterRng rng(zero::CounterRng::key_for(/*seed=*/1234, name));
  std::printf("zero %s: initialising %s (%lld elements) over %d ranks\n", zero::version_string,
              name.c_str(), static_cast<long long>(numel), ranks);

  // Flat buffer padded so it splits evenly over the ranks, as the engine stores every unit.
  const std::int64_t shard = (numel + ranks - 1) / ranks;
  std::vector<zero::Buffer<float>> shards;
  for (int r = 0; r < ranks; ++r) {
    shards.emplace_back(static_cast<std::size_t>(shard));
    const std::int64_t begin = std::min(numel, r * shard);
    const std::int64_t count = std::min(numel, begin + shard) - begin;
    zero::fill_normal(shards.back().view().slice(0, count), rng, begin, 0.0, 0.02);
    std::printf("  rank %d owns elements [%lld, %lld)\n", r, static_cast<long long>(begin),
                static_cast<long long>(begin + count));
  }

  zero::Buffer<float> whole(static_cast<std::size_t>(numel));
  zero::fill_normal(whole.view(), rng, 0, 0.0, 0.02);
  std::int64_t mismatches = 0;
  double sum_sq = 0, bf16_err = 0;
  for (std::int64_t i = 0; i < numel; ++i) {
    const float v = shards[static_cast<std::size_t>(i / shard)].view().at(i % shard);
    mismatches += v != whole.view().at(i);
    sum_sq += double(v) * v;
    const float rounded = static_cast<float>(zero::bf16(v));
    bf16_err = std::max(bf16_err, std::fabs(double(rounded - v)) / std::fabs(double(v) + 1e-30));
  }
  std::printf("sharded init equals single-process init: %s (%lld mismatches)\n",
              mismatches == 0 ? "yes" : "NO", static_cast<long long>(mismatches));
  std::printf(
      "std of the weights: %.5f (asked 0.02); largest relative bf16 rounding error: %.2e "
      "(bound 2^-8 = %.2e: 8 significant bits)\n",
      std::sqrt(sum_sq / double(numel)), bf16_err, std::ldexp(1.0, -8));

  zero::Arena<> scratch(1 << 20, "scratch");
  auto a = scratch.allocate<zero::bf16>({64, 768});
  auto b = scratch.allocate<float>({64});
  std::printf("arena: %zu of %zu bytes used after a [64, 768] bf16 and a [64] f32 view (%s, %s)\n",
              scratch.used_bytes(), scratch.capacity_bytes(), a.shape().to_string().c_str(),
              b.shape().to_string().c_str());
  return mismatches == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "core_tour: %s\nusage: core_tour [ranks >= 1] [elements >= 1]\n", e.what());
  return 2;
}
