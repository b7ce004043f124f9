// DataLoader: the ranks' micro-batches concatenated in rank order are the single-process global
// batch at every world size 1..8; targets are inputs shifted by one; shuffling is a seeded
// permutation per epoch independent of world size; save/restore continues identically.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/data/data_loader.hpp>
#include <zero/data/permutation.hpp>

using namespace zero;
using namespace zero::data;

namespace {
/// Tokens whose value is their position (mod a prime), so any misplaced window shows.
std::shared_ptr<const TokenFile> counting_tokens(std::int64_t count) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i)
    ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 7919) % 65521);
  return std::make_shared<const TokenFile>(TokenFile::from_tokens(std::move(ids), "counting"));
}

/// The concatenation, in rank order, of every rank's micro-batches of step.
std::vector<std::int32_t> union_of_ranks(const std::shared_ptr<const TokenFile>& tokens,
                                         LoaderConfig config, std::int64_t step, bool targets) {
  std::vector<std::int32_t> all;
  for (int rank = 0; rank < config.world_size; ++rank) {
    config.rank = rank;
    DataLoader loader(tokens, config);
    for (int m = 0; m < config.micro_batches; ++m) {
      const Batch b = loader.micro_batch(step, m);
      const auto& part = targets ? b.targets : b.inputs;
      all.insert(all.end(), part.begin(), part.end());
    }
  }
  return all;
}
}  // namespace

TEST_CASE("CounterPermutation is a bijection determined by its key", "[unit][data]") {
  for (std::uint64_t n : {1ull, 2ull, 3ull, 5ull, 16ull, 17ull, 100ull, 1000ull, 4099ull}) {
    const CounterPermutation p(n, 1234);
    std::vector<char> hit(n, 0);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t x = p(i);
      REQUIRE(x < n);
      hit[x] = 1;
    }
    CHECK(std::count(hit.begin(), hit.end(), 1) == static_cast<std::ptrdiff_t>(n));
  }
  const CounterPermutation a(1000, 1), b(1000, 1), c(1000, 2);
  int same_ab = 0, same_ac = 0, fixed = 0;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    same_ab += a(i) == b(i);
    same_ac += a(i) == c(i);
    fixed += a(i) == i;
  }
  CHECK(same_ab == 1000);
  CHECK(same_ac < 20);  // independent keys agree on ~1 index in expectation
  CHECK(fixed < 20);    // and the permutation is far from the identity
}

TEST_CASE("the ranks' micro-batches add up to the global batch at world sizes 1 to 8",
          "[unit][data]") {
  const std::int64_t T = 8, B = 840;                           // 840 = lcm(1..8)
  const auto tokens = counting_tokens(B * T * 2 + 1 + 3 * T);  // 2 epochs' worth and a bit
  for (bool shuffle : {false, true}) {
    LoaderConfig base;
    base.global_batch = B;
    base.seq_len = T;
    base.shuffle = shuffle;
    base.seed = 7;
    const DataLoader reference(tokens, base);
    REQUIRE(reference.steps_per_epoch() == 2);
    for (std::int64_t step : {0, 1, 2, 5}) {  // steps 2 and 5 are in later epochs
      const Batch global = reference.global_batch(step);
      for (int world = 1; world <= 8; ++world) {
        for (int micro : {1, 2, 3, 5, 7}) {
          if ((B / world) % micro != 0) continue;
          INFO("shuffle " << shuffle << " step " << step << " world " << world << " micro "
                          << micro);
          LoaderConfig c = base;
          c.world_size = world;
          c.micro_batches = micro;
          CHECK(union_of_ranks(tokens, c, step, false) == global.inputs);
          CHECK(union_of_ranks(tokens, c, step, true) == global.targets);
          if (world > 1 && micro == 1) {
            // Negative control: the same rows in another rank order are not the global batch.
            LoaderConfig last = c;
            last.rank = world - 1;
            const Batch tail = DataLoader(tokens, last).micro_batch(step, 0);
            std::vector<std::int32_t> rotated(tail.inputs);
            const auto head = union_of_ranks(tokens, c, step, false);
            rotated.insert(rotated.end(), head.begin(),
                           head.end() - static_cast<std::ptrdiff_t>(tail.inputs.size()));
            CHECK(rotated != global.inputs);
          }
        }
      }
    }
  }
}

TEST_CASE("batches are shifted windows of the token stream", "[unit][data]") {
  const std::int64_t T = 5;
  const auto tokens = counting_tokens(4 * T + 1);
  LoaderConfig c;
  c.global_batch = 2;
  c.seq_len = T;
  DataLoader loader(tokens, c);
  CHECK(loader.samples() == 4);
  const Batch step1 = loader.global_batch(1);  // unshuffled: samples 2 and 3
  for (std::int64_t r = 0; r < 2; ++r) {
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t position = (2 + r) * T + t;
      CHECK(step1.inputs[static_cast<std::size_t>(r * T + t)] == (*tokens)[position]);
      CHECK(step1.targets[static_cast<std::size_t>(r * T + t)] == (*tokens)[position + 1]);
    }
  }
  CHECK(step1.input_tensor().shape() == Shape{2, T});
  CHECK(loader.global_batch(2).inputs == loader.global_batch(0).inputs);  // epoch 2, no shuffle
}

TEST_CASE("shuffling visits every sample once per epoch, per seed, independent of world size",
          "[unit][data]") {
  const std::int64_t T = 4, B = 6;
  const auto tokens = counting_tokens(40 * T + 1);  // 40 samples: 6 steps per epoch, 4 left out
  LoaderConfig c;
  c.global_batch = B;
  c.seq_len = T;
  c.shuffle = true;
  c.seed = 99;
  const DataLoader loader(tokens, c);
  std::vector<std::int64_t> epoch0, epoch1;
  for (std::int64_t step = 0; step < loader.steps_per_epoch(); ++step) {
    for (std::int64_t row = 0; row < B; ++row) {
      epoch0.push_back(loader.sample_index(step, row));
      epoch1.push_back(loader.sample_index(step + loader.steps_per_epoch(), row));
    }
  }
  CHECK(std::set<std::int64_t>(epoch0.begin(), epoch0.end()).size() == epoch0.size());
  CHECK(*std::max_element(epoch0.begin(), epoch0.end()) < 40);
  CHECK(epoch0 != epoch1);  // a new order each epoch
  std::vector<std::int64_t> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted != epoch0);  // actually shuffled

  LoaderConfig other = c;
  other.seed = 100;
  const DataLoader reseeded(tokens, other);
  CHECK(reseeded.global_batch(0).inputs != loader.global_batch(0).inputs);
  other = c;
  other.world_size = 3;
  other.rank = 2;
  const DataLoader rank2(tokens, other);
  CHECK(rank2.sample_index(3, 5) == loader.sample_index(3, 5));
}

TEST_CASE("a saved loader state continues identically, also at another world size",
          "[unit][data]") {
  const std::int64_t T = 6, B = 12;
  const auto tokens = counting_tokens(50 * T + 1);
  LoaderConfig c;
  c.global_batch = B;
  c.seq_len = T;
  c.world_size = 2;
  c.rank = 1;
  c.micro_batches = 3;
  c.shuffle = true;
  c.seed = 5;
  DataLoader running(tokens, c);
  for (int i = 0; i < 7; ++i) running.next();  // stop mid-step: step 2, micro 1
  const nlohmann::json saved = running.state().to_json();
  CHECK(saved.at("step") == 2);
  CHECK(saved.at("micro") == 1);
  CHECK(LoaderState::from_json(saved) == running.state());

  DataLoader resumed(tokens, c);
  resumed.restore(LoaderState::from_json(nlohmann::json::parse(saved.dump())));
  for (int i = 0; i < 20; ++i) {  // crosses the epoch boundary at step 4
    const Batch a = running.next(), b = resumed.next();
    CHECK(a.step == b.step);
    CHECK(a.micro == b.micro);
    CHECK(a.inputs == b.inputs);
    CHECK(a.targets == b.targets);
  }

  // At a step boundary the state restores at another world size and micro-batch count, and
  // the new ranks together read the same next global batch.
  DataLoader boundary(tokens, c);
  boundary.next_step();
  boundary.next_step();
  const LoaderState at_step2 = boundary.state();
  LoaderConfig wider = c;
  wider.world_size = 4;
  wider.micro_batches = 1;
  std::vector<std::int32_t> joined;
  for (int rank = 0; rank < 4; ++rank) {
    wider.rank = rank;
    DataLoader l(tokens, wider);
    l.restore(at_step2);
    const Batch b = l.next();
    CHECK(b.step == 2);
    joined.insert(joined.end(), b.inputs.begin(), b.inputs.end());
  }
  CHECK(joined == DataLoader(tokens, c).global_batch(2).inputs);

  // Mid-step states and changed data settings are refused with the setting named.
  DataLoader mismatch(tokens, wider);
  CHECK_THROWS_WITH(mismatch.restore(LoaderState::from_json(saved)),
                    Catch::Contains("world_size (mid-step)"));
  LoaderConfig reseeded = c;
  reseeded.seed = 6;
  DataLoader other_seed(tokens, reseeded);
  CHECK_THROWS_WITH(other_seed.restore(running.state()),
                    Catch::Contains("seed = 5") && Catch::Contains("seed = 6"));
  CHECK_THROWS_WITH(LoaderState::from_json(nlohmann::json{{"step", 1}}),
                    Catch::Contains("missing key 'micro'"));
  // An integer the field cannot hold is refused, not converted.
  const auto edited = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = saved;
    j[key] = value;
    return j;
  };
  CHECK_THROWS_WITH(LoaderState::from_json(edited("step", 2.5)),
                    Catch::Contains("key 'step' must be an integer") && Catch::Contains("2.5"));
  CHECK_THROWS_WITH(LoaderState::from_json(edited("seed", -1)),
                    Catch::Contains("key 'seed' must be an integer in [0, "));
  CHECK_THROWS_WITH(LoaderState::from_json(edited("world_size", std::int64_t{1} << 40)),
                    Catch::Contains("key 'world_size'"));
  CHECK_THROWS_WITH(LoaderState::from_json(edited("shuffle", 1)),
                    Catch::Contains("key 'shuffle' has the wrong type"));
  CHECK(LoaderState::from_json(edited("step", 3)).step == 3);

  // Another file of the same size (the next shard of a corpus) is refused: only its count
  // was compared. A state saved before the fingerprint was kept still restores.
  std::vector<std::int32_t> other_ids(static_cast<std::size_t>(tokens->size()), 3);
  const auto other = std::make_shared<const TokenFile>(
      TokenFile::from_tokens(std::move(other_ids), "the next shard"));
  DataLoader other_file(other, c);
  CHECK_THROWS_WITH(other_file.restore(at_step2), Catch::Contains("fingerprint"));
  nlohmann::json older = at_step2.to_json();
  older.erase("fingerprint");
  DataLoader same_file(tokens, c);
  CHECK_NOTHROW(same_file.restore(LoaderState::from_json(older)));
  CHECK(same_file.next().step == 2);
}

TEST_CASE("loader configuration errors say what does not divide", "[unit][data]") {
  const auto tokens = counting_tokens(100);
  LoaderConfig c;
  c.global_batch = 10;
  c.seq_len = 4;
  c.world_size = 4;
  CHECK_THROWS_AS(DataLoader(tokens, c), ConfigError);
  CHECK_THROWS_WITH(DataLoader(tokens, c),
                    Catch::Contains("global_batch 10 is not divisible by world_size 4"));
  c.world_size = 2;
  c.micro_batches = 2;
  CHECK_THROWS_WITH(DataLoader(tokens, c),
                    Catch::Contains("5 rows per rank") && Catch::Contains("micro_batches 2"));
  c.micro_batches = 1;
  c.rank = 2;
  CHECK_THROWS_WITH(DataLoader(tokens, c), Catch::Contains("rank 2 is outside world_size 2"));
  c.rank = 0;
  c.global_batch = 30;  // 99 / 4 = 24 samples
  CHECK_THROWS_WITH(DataLoader(tokens, c),
                    Catch::Contains("'counting'") && Catch::Contains("24 samples") &&
                        Catch::Contains("fewer than one global batch of 30"));
  c.global_batch = 4;
  c.vocab_size = 1000;  // the counting tokens go up to 65520
  DataLoader strict(tokens, c);
  CHECK_THROWS_WITH(strict.next(), Catch::Contains("outside the vocabulary [0, 1000)"));
  c.vocab_size = 0;
  DataLoader loader(tokens, c);
  loader.next();
  CHECK_NOTHROW(loader.next_step());  // micro_batches = 1: every next() ends a step
  // A bad step and a bad row are told apart (a negative step was blamed on the row's range).
  CHECK_THROWS_WITH(loader.sample_index(-1, 0),
                    Catch::Contains("step -1 is negative") && !Catch::Contains("row"));
  CHECK_THROWS_WITH(loader.sample_index(0, 4),
                    Catch::Contains("row 4 is outside [0, global_batch 4)"));
}

TEST_CASE("DataLoader batches are also named micro-batch inputs", "[unit][data]") {
  LoaderConfig c;
  c.global_batch = 4;
  c.seq_len = 5;
  c.micro_batches = 2;
  DataLoader loader(counting_tokens(200), c);
  const Batch b = loader.next();
  const nn::Inputs in = b.named_inputs();
  const auto tokens = in.get<std::int32_t>("tokens");
  const auto targets = in.get<std::int32_t>("targets");
  CHECK(tokens.shape() == Shape{2, 5});
  CHECK(tokens.data() == b.inputs.data());
  CHECK(targets.data() == b.targets.data());
  CHECK(targets.at(3) == tokens.at(4));  // targets are the inputs shifted by one
  CHECK_THROWS_AS(in.get<float>("tokens"), nn::InputError);
}
