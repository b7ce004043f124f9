// Engine checkpoints: a run saved at N ranks and stage s, loaded at M ranks and stage s' (world
// sizes 1-8), and continued, equals the uninterrupted run (f64 SGD: 1e-10; f32 AdamW with its
// states resharded: rounding only); the same world size and stage resumes bit-exactly; `latest`
// and client state round-trip; a checkpoint from another optimizer is refused by name; GPT-2
// safetensors weights import sliced and export streamed from a live engine.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>

#include <zero/engine/engine_weights.hpp>
#include <zero/io/safetensors_writer.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "../support/worse.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;
using zero::parallel::LocalComm;
using zero::testing::per_rank;
using zero::testing::thrown_message;

namespace {

constexpr std::int64_t global_rows = 24;  // divisible by 1, 2, 3, 4, 6 and 8 ranks

// Rank's rows of step's global batch (a contiguous block of global_rows / world).
engine::MicroBatch rows_of(const GlobalBatch& b, int rank, int world) {
  const std::int64_t rows = global_rows / world;
  return {b.tokens.data() + rank * rows * seq, b.targets.data() + rank * rows * seq, rows, seq};
}

struct Segment {
  int world = 1, stage = 0;
  int first_step = 0, last_step = 0;  // trains steps [first_step, last_step)
  std::string load_tag, save_tag;     // empty: none
  int shard_size = 0;                 // hybrid sharding (EngineOptions::shard_size); 0: none
};

// Runs one segment of training and returns rank 0's view of every unit's master values.
template <class T, int S>
std::vector<double> run_stage(const Segment& seg, const std::filesystem::path& dir) {
  std::vector<double> out;
  std::vector<int> next_step(static_cast<std::size_t>(seg.world), -1);  // from the client state
  LocalComm::run(seg.world, [&](LocalComm& comm) {
    nn::GPT<T> model(tiny());
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    options.persistence_threshold = 0;
    options.shard_size = seg.shard_size;
    auto body = [&](auto& eng) {
      if (!seg.load_tag.empty()) {
        const auto client = eng.load_checkpoint(dir, seg.load_tag == "latest" ? "" : seg.load_tag);
        next_step[static_cast<std::size_t>(comm.rank())] =
            client.at("next_step").template get<int>();
      }
      for (int step = seg.first_step; step < seg.last_step; ++step) {
        const GlobalBatch b(global_rows, step, tiny().vocab_size);
        eng.forward(rows_of(b, comm.rank(), comm.size()));
        eng.backward();
        eng.step();
      }
      if (!seg.save_tag.empty()) {
        eng.save_checkpoint(dir, seg.save_tag, {{"next_step", seg.last_step}});
      }
      std::vector<double> mine;
      for (int u = 0; u < eng.num_units(); ++u) {
        for (auto v : eng.gather_unit_values(u)) mine.push_back(static_cast<double>(v));
      }
      if (comm.rank() == 0) out = mine;
    };
    if constexpr (std::is_same_v<T, double>) {
      engine::Engine<nn::GPT<double>, ZeroStage<S>> eng(
          model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(0.5, p, g); },
          options);
      body(eng);
    } else {
      Config cfg = adamw_config(S, 1, 1.0);
      cfg.train_micro_batch_size_per_gpu = global_rows / comm.size();
      engine::Engine<nn::GPT<float>, ZeroStage<S>> eng(model, comm, cfg, options);
      body(eng);
    }
  });
  if (!seg.load_tag.empty()) {
    for (int n : next_step) CHECK(n == seg.first_step);
  }
  return out;
}

template <class T>
std::vector<double> run(const Segment& seg, const std::filesystem::path& dir) {
  switch (seg.stage) {
    case 0:
      return run_stage<T, 0>(seg, dir);
    case 1:
      return run_stage<T, 1>(seg, dir);
    case 2:
      return run_stage<T, 2>(seg, dir);
    default:
      return run_stage<T, 3>(seg, dir);
  }
}

// Largest element difference; runs of different sizes throw, so the test prints why.
double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) {
    throw std::runtime_error("max_diff: " + std::to_string(a.size()) + " values against " +
                             std::to_string(b.size()));
  }
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) w = zero::testing::worse(w, std::fabs(a[i] - b[i]));
  return w;
}

}  // namespace

TEST_CASE("a checkpoint saved at N ranks and stage s resumes at M ranks and stage s' (f64)",
          "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-ckpt");
  const auto uninterrupted = run<double>({2, 3, 0, 4, "", ""}, tmp.path());
  const auto wrong = run<double>({2, 3, 0, 3, "", ""}, tmp.path());  // one step short
  for (const auto& [saved_world, saved_stage] :
       {std::pair{2, 3}, std::pair{3, 0}, std::pair{4, 2}, std::pair{1, 1}, std::pair{8, 1}}) {
    const std::string tag = "w" + std::to_string(saved_world) + "s" + std::to_string(saved_stage);
    run<double>({saved_world, saved_stage, 0, 2, "", tag}, tmp.path());
    for (const auto& [world, stage] : {std::pair{1, 0}, std::pair{2, 1}, std::pair{3, 2},
                                       std::pair{4, 3}, std::pair{6, 3}, std::pair{8, 2}}) {
      INFO("saved at " << saved_world << " ranks stage " << saved_stage << ", loaded at " << world
                       << " ranks stage " << stage);
      const auto resumed = run<double>({world, stage, 2, 4, tag, ""}, tmp.path());
      CHECK(max_diff(resumed, uninterrupted) < 1e-10);
      CHECK(max_diff(resumed, wrong) > 1e-4);  // negative control
    }
  }
}

TEST_CASE("a checkpoint saved under hybrid sharding resumes at plain layouts, and back",
          "[unit][engine][checkpoint]") {
  // Replica 0 of each shard saves it; a load reads the ranges each rank's shard group needs.
  zero::testing::TempDir tmp("engine-ckpt");
  const auto uninterrupted = run<double>({2, 3, 0, 4, "", ""}, tmp.path());
  run<double>({4, 3, 0, 2, "", "hybrid3", 2}, tmp.path());
  run<double>({6, 1, 0, 2, "", "hybrid1", 3}, tmp.path());
  run<double>({2, 2, 0, 2, "", "plain2"}, tmp.path());
  for (const Segment& resume :
       {Segment{2, 1, 2, 4, "hybrid3", ""}, Segment{3, 3, 2, 4, "hybrid3", ""},
        Segment{1, 0, 2, 4, "hybrid1", ""}, Segment{8, 2, 2, 4, "hybrid1", "", 4},
        Segment{4, 3, 2, 4, "plain2", "", 1}, Segment{6, 2, 2, 4, "plain2", "", 2}}) {
    INFO("loaded " << resume.load_tag << " at " << resume.world << " ranks stage " << resume.stage
                   << " shard size " << resume.shard_size);
    CHECK(max_diff(run<double>(resume, tmp.path()), uninterrupted) < 1e-10);
  }
  // AdamW's states too: the same hybrid layout resumes bit for bit, another within rounding.
  const auto adamw = run<float>({2, 3, 0, 4, "", ""}, tmp.path());
  run<float>({4, 2, 0, 2, "", "adamw_hybrid", 2}, tmp.path());
  const auto hybrid_whole = run<float>({4, 2, 0, 4, "", "", 2}, tmp.path());
  CHECK(max_diff(run<float>({4, 2, 2, 4, "adamw_hybrid", "", 2}, tmp.path()), hybrid_whole) == 0.0);
  CHECK(max_diff(run<float>({2, 3, 2, 4, "adamw_hybrid", ""}, tmp.path()), adamw) < 2e-5);
}

TEST_CASE(
    "AdamW states reshard across world sizes and stages, the same layout resumes "
    "bit-exactly",
    "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-ckpt");
  const auto uninterrupted = run<float>({2, 3, 0, 4, "", ""}, tmp.path());
  run<float>({2, 3, 0, 2, "", "mid"}, tmp.path());
  const auto same = run<float>({2, 3, 2, 4, "latest", ""}, tmp.path());
  CHECK(max_diff(same, uninterrupted) == 0.0);
  const auto other = run<float>({4, 1, 2, 4, "mid", ""}, tmp.path());
  CHECK(max_diff(other, uninterrupted) < 2e-5);
  const auto other0 = run<float>({1, 0, 2, 4, "mid", ""}, tmp.path());
  CHECK(max_diff(other0, uninterrupted) < 2e-5);
  const auto short_run = run<float>({2, 3, 0, 3, "", ""}, tmp.path());  // negative control
  CHECK(max_diff(other, short_run) > 1e-4);
}

TEST_CASE("a checkpoint from another optimizer is refused by name", "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-ckpt");
  run<double>({1, 1, 0, 1, "", "sgd"}, tmp.path());
  CHECK_THROWS_WITH(run<float>({1, 1, 1, 2, "sgd", ""}, tmp.path()),
                    Catch::Contains("exp_avg") || Catch::Contains("optimizer"));
}

TEST_CASE("a checkpoint of a larger model is refused, naming a tensor this model lacks",
          "[unit][engine][checkpoint]") {
  // 2 blocks saved, 1 loaded: every name of the smaller model matches, so each tensor alone
  // loads; the second block's were dropped without a word.
  zero::testing::TempDir tmp("engine-ckpt");
  auto engine_of = [](nn::GPT<float>& model, LocalComm& comm) {
    engine::EngineOptions options;
    options.activation_bytes = 32 << 20;
    return engine::Engine<nn::GPT<float>, ZeroStage<1>>(model, comm, adamw_config(1, 1, 1.0),
                                                        options);
  };
  LocalComm::run(2, [&](LocalComm& comm) {
    nn::GPTConfig two = tiny();
    two.num_layers = 2;
    nn::GPT<float> model(two);
    auto eng = engine_of(model, comm);
    eng.save_checkpoint(tmp.path(), "two", {});
  });
  const auto messages = per_rank<std::string>(2, [&](LocalComm& comm) {
    nn::GPTConfig one = tiny();
    one.num_layers = 1;
    nn::GPT<float> model(one);
    auto eng = engine_of(model, comm);
    return thrown_message([&] { (void)eng.load_checkpoint(tmp.path(), "two"); });
  });
  for (const std::string& m : messages) {
    CHECK_THAT(m, Catch::Contains("tensor(s) this model does not have") &&
                      Catch::Contains("transformer.h.1.") && Catch::Contains("Nothing was loaded"));
  }
  // Wider layers, the same names: refused from the index before any slice changes, so the
  // engine is left as it was and trains on (it zeroed its slices first and refused to train).
  const auto wider = per_rank<std::vector<std::string>>(2, [&](LocalComm& comm) {
    nn::GPTConfig narrow = tiny();
    narrow.num_layers = 2;
    narrow.channels = tiny().channels / 2;
    narrow.num_heads = 1;
    nn::GPT<float> model(narrow);
    auto eng = engine_of(model, comm);
    std::vector<std::vector<float>> before;
    for (int u = 0; u < eng.num_units(); ++u) before.push_back(eng.gather_unit_values(u));
    std::vector<std::string> seen{
        thrown_message([&] { (void)eng.load_checkpoint(tmp.path(), "two"); })};
    std::vector<std::vector<float>> after;
    for (int u = 0; u < eng.num_units(); ++u) after.push_back(eng.gather_unit_values(u));
    seen.push_back(after == before ? "unchanged" : "changed");
    seen.push_back(thrown_message([&] {
      const GlobalBatch b(global_rows, 0, narrow.vocab_size);
      eng.forward(rows_of(b, comm.rank(), comm.size()));
      eng.backward();
      (void)eng.step();
    }));
    return seen;
  });
  for (const auto& seen : wider) {
    REQUIRE(seen.size() == 3);
    CHECK_THAT(seen[0], Catch::Contains("has shape") &&
                            Catch::Contains("the model's parameter has") &&
                            Catch::Contains("failed on rank"));
    CHECK(seen[1] == "unchanged");
    CHECK(seen[2] == zero::testing::nothing_thrown);
  }
}

TEST_CASE("GPT-2 safetensors weights start training at any stage without a whole-model rank",
          "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-weights");
  const auto file = tmp.path() / "gpt2.safetensors";
  // The file: a single-process model initialised with another seed, in Hugging Face layout.
  nn::GPT<float> source(tiny());
  nn::LocalParameters<nn::GPT<float>> params(source, 99);
  std::vector<io::TensorDecl> decls;
  for (int u = 0; u < params.num_units(); ++u) {
    for (const auto& p : params.unit_specs(u)) {
      decls.push_back(io::gpt2::export_decl(p.name, DType::f32, p.shape));
    }
  }
  {
    io::SafetensorsWriter writer(file, decls);
    for (int u = 0; u < params.num_units(); ++u) {
      std::int64_t offset = 0;
      for (const auto& p : params.unit_specs(u)) {
        io::gpt2::export_tensor(
            writer, p.name, Tensor<const float>(params.unit_values(u).data() + offset, p.shape));
        offset += p.numel();
      }
    }
    writer.commit();
  }
  for (int world : {1, 2, 3}) {
    // Every rank's view of every unit after the import.
    const auto units = per_rank<std::vector<std::vector<float>>>(world, [&](LocalComm& comm) {
      nn::GPT<float> model(tiny());
      engine::EngineOptions options;
      options.persistence_threshold = 0;
      engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(
          model, comm, [](int, std::span<float>, std::span<const float>) {}, options);
      engine::load_gpt2_weights(eng, file);
      std::vector<std::vector<float>> mine;
      for (int u = 0; u < eng.num_units(); ++u) mine.push_back(eng.gather_unit_values(u));
      return mine;
    });
    for (const auto& mine : units) {
      REQUIRE(mine.size() == static_cast<std::size_t>(params.num_units()));
      for (int u = 0; u < params.num_units(); ++u) {
        const auto& got = mine[static_cast<std::size_t>(u)];
        const auto want = params.unit_values(u);
        REQUIRE(got.size() == static_cast<std::size_t>(want.numel()));
        CHECK(std::equal(got.begin(), got.end(), want.begin()));
      }
    }
  }
}

TEST_CASE("GPT-2 weights export streams from a live engine and loads at another layout",
          "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-export");
  const auto f32_file = tmp.path() / "f32.safetensors";
  const auto bf16_file = tmp.path() / "bf16.safetensors";
  std::vector<std::vector<float>> saved;  // rank 0's view of every unit after the export
  // Exported at 2 ranks, stage 3 (no rank holds more than one unit at a time).
  struct Exported {
    engine::WeightsExport written;
    std::size_t params = 0, largest = 0, total = 0;
  };
  const auto exported = per_rank<Exported>(2, [&](LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::EngineOptions options;
    options.persistence_threshold = 0;
    options.seed = 1234;
    engine::Engine<nn::GPT<float>, ZeroStage<3>> eng(
        model, comm, [](int, std::span<float>, std::span<const float>) {}, options);
    Exported mine;
    mine.written = engine::save_gpt2_weights(eng, f32_file);
    engine::save_gpt2_weights(eng, bf16_file, DType::bf16);
    for (int u = 0; u < eng.num_units(); ++u) {
      mine.params += eng.unit_specs(u).size();
      const auto v = eng.gather_unit_values(u);
      mine.largest = std::max(mine.largest, v.size() * sizeof(float));
      mine.total += v.size() * sizeof(float);
      if (comm.rank() == 0) saved.push_back(v);
    }
    return mine;
  });
  for (const auto& [written, params, largest, total] : exported) {
    CHECK(written.tensors == params);
    CHECK(written.peak_unit_bytes == largest);
    CHECK(written.peak_unit_bytes < total);
    CHECK(written.bytes == std::filesystem::file_size(f32_file));
  }
  // The file is in Hugging Face's layout: Conv1D weights [in, out], bf16 where asked.
  const io::SafetensorsReader f32_reader(f32_file), bf16_reader(bf16_file);
  const auto& attn = f32_reader.info("transformer.h.0.attn.c_attn.weight");
  CHECK(attn.shape == std::vector<std::int64_t>{tiny().channels, 3 * tiny().channels});
  CHECK(bf16_reader.info("transformer.wte.weight").dtype == DType::bf16);
  CHECK(!f32_reader.contains("lm_head.weight"));  // tied to wte
  // Loaded at 3 ranks, stage 1: the same values (f32 exactly, bf16 rounded once).
  struct Loaded {
    std::vector<std::vector<float>> f32, bf16;  // every unit after loading each file
  };
  const auto loaded = per_rank<Loaded>(3, [&](LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::EngineOptions options;
    options.seed = 7;  // a different start, overwritten by the file
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(
        model, comm, [](int, std::span<float>, std::span<const float>) {}, options);
    Loaded mine;
    engine::load_gpt2_weights(eng, f32_file);
    for (int u = 0; u < eng.num_units(); ++u) mine.f32.push_back(eng.gather_unit_values(u));
    engine::load_gpt2_weights(eng, bf16_file);
    for (int u = 0; u < eng.num_units(); ++u) mine.bf16.push_back(eng.gather_unit_values(u));
    return mine;
  });
  for (const Loaded& mine : loaded) {
    REQUIRE(mine.f32.size() == saved.size());
    REQUIRE(mine.bf16.size() == saved.size());
    for (std::size_t u = 0; u < saved.size(); ++u) CHECK(mine.f32[u] == saved[u]);
    std::size_t exact = 0, total = 0;
    for (std::size_t u = 0; u < saved.size(); ++u) {
      const auto& got = mine.bf16[u];
      const auto& want = saved[u];
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        REQUIRE(got[i] == static_cast<float>(bf16(want[i])));
        exact += got[i] == want[i];
      }
      total += got.size();
    }
    CHECK(exact < total / 2);  // the bf16 file really is rounded (LayerNorm ones are exact)
  }
}

TEST_CASE("A failed GPT-2 weights export raises on every rank and leaves no file",
          "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-export-fail");
  const auto file = tmp.path() / "missing-dir" / "model.safetensors";
  struct Outcome {
    bool raised = false, io_error_escaped = false;
    std::string message;
    std::size_t unit0_after = 0;
  };
  const auto outcome = per_rank<Outcome>(2, [&](LocalComm& comm) {
    nn::GPT<float> model(tiny());
    engine::Engine<nn::GPT<float>, ZeroStage<2>> eng(
        model, comm, [](int, std::span<float>, std::span<const float>) {}, {});
    Outcome mine;
    try {
      engine::save_gpt2_weights(eng, file);
    } catch (const CheckpointError& e) {
      mine.raised = true;
      mine.message = e.what();
    } catch (const IoError&) {
      mine.io_error_escaped = true;
    }
    // The engine is still usable: the collectives stayed matched.
    mine.unit0_after = eng.gather_unit_values(0).size();
    return mine;
  });
  for (const Outcome& mine : outcome) {
    if (mine.io_error_escaped) FAIL("an IoError escaped instead of a CheckpointError");
    CHECK(mine.raised);
    CHECK(mine.unit0_after > 0);
  }
  CHECK_THAT(outcome[1].message, Catch::Contains("rank 0 could not write"));
  CHECK(!std::filesystem::exists(file));
  CHECK(!std::filesystem::exists(file.parent_path()));
}

namespace {

// A 2-rank stage-2 float GPT engine of optimizer type (AdamW, or Adam with L2 decay) on comm.
template <class Fn>
void with_adam_engine(LocalComm& comm, bool l2, Fn&& fn) {
  nn::GPT<float> model(tiny());
  Config cfg = adamw_config(2, 1, 1.0);
  if (l2) {
    cfg.optimizer->type = "Adam";
    cfg.optimizer->params["adam_w_mode"] = {0.0};
  }
  engine::Engine<nn::GPT<float>, ZeroStage<2>> eng(model, comm, cfg, tiny_options());
  fn(eng);
}

}  // namespace

TEST_CASE(
    "a load refused before any slice changes leaves the engine as it was, one that fails on one "
    "rank fails on every rank, which then refuse to train",
    "[unit][engine][checkpoint]") {
  zero::testing::TempDir tmp("engine-ckpt-fail");
  // Saved by Adam with L2 decay: the same state names as AdamW, so every slice would load.
  LocalComm::run(2, [&](LocalComm& comm) {
    with_adam_engine(comm, true, [&](auto& eng) {
      train_steps(eng, comm, 0, 1, 1);
      eng.save_checkpoint(tmp.path(), "adam");
    });
  });
  const auto refused = per_rank<std::vector<std::string>>(2, [&](LocalComm& comm) {
    std::vector<std::string> seen;
    with_adam_engine(comm, false, [&](auto& eng) {
      const auto before = train_steps(eng, comm, 0, 1, 1);
      try {
        eng.load_checkpoint(tmp.path(), "adam");
        seen.push_back("loaded");
      } catch (const CheckpointError& e) {
        seen.push_back(e.what());
      }
      // Nothing changed, and the engine trains on.
      std::vector<std::vector<float>> after;
      for (int u = 0; u < eng.num_units(); ++u) after.push_back(eng.gather_unit_values(u));
      seen.push_back(after == before ? "unchanged" : "changed");
      train_steps(eng, comm, 1, 2, 1);
      seen.push_back("trained");
    });
    return seen;
  });
  for (const auto& seen : refused) {
    REQUIRE(seen.size() == 3);
    CHECK_THAT(seen[0], Catch::Contains("saved with optimizer Adam") &&
                            Catch::Contains("this engine runs AdamW"));
    CHECK(seen[1] == "unchanged");
    CHECK(seen[2] == "trained");
  }

  // Rank 1 alone reads the end of unit 0 (its shard), whose last segment is corrupted: rank 0
  // reads its own slices without error, yet both throw rank 1's error (before, rank 0 went on to
  // the regather and waited there for rank 1), and both then refuse to train.
  LocalComm::run(2, [&](LocalComm& comm) {
    with_adam_engine(comm, false, [&](auto& eng) {
      train_steps(eng, comm, 0, 1, 1);
      eng.save_checkpoint(tmp.path(), "adamw");
    });
  });
  {
    const nn::GPT<float> model(tiny());
    const std::string last = model.unit_params(0).back().name;
    const checkpoint::Reader reader(tmp.path(), "adamw");
    const auto& s = reader.tensor(last).segments.back();
    const auto shard =
        tmp.path() / "adamw" / reader.index().files[static_cast<std::size_t>(s.file)].name;
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(s.byte_end - 1));
    const char c = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(s.byte_end - 1));
    f.put(c);
  }
  const auto broken = per_rank<std::vector<std::string>>(
      2,
      [&](LocalComm& comm) {
        std::vector<std::string> seen;
        with_adam_engine(comm, false, [&](auto& eng) {
          train_steps(eng, comm, 0, 1, 1);
          seen.push_back(thrown_message([&] { eng.load_checkpoint(tmp.path(), "adamw"); }));
          seen.push_back(thrown_message([&] { train_steps(eng, comm, 1, 2, 1); }));
        });
        return seen;
      },
      parallel::CommOptions{.timeout_s = 20});
  for (const auto& seen : broken) {
    REQUIRE(seen.size() == 2);
    INFO(seen[0] << "\n" << seen[1]);
    CHECK_THAT(seen[0],
               Catch::Contains("failed part-way on rank 1") && Catch::Contains("corrupted"));
    CHECK_THAT(seen[1], Catch::Contains("load a checkpoint to continue"));
  }
}

TEST_CASE("a checkpoint that one rank cannot open fails on every rank and changes nothing",
          "[unit][engine][checkpoint]") {
  // Rank 1 looks for the tag in a directory where it is not (a file system that shows a rank
  // the new tag late, a directory local to its node): its Reader fails, rank 0's opens. Before,
  // rank 1 left the load while rank 0 went on to wait for it in the load's agreement.
  zero::testing::TempDir tmp("engine-ckpt-open");
  LocalComm::run(2, [&](LocalComm& comm) {
    with_adam_engine(comm, false, [&](auto& eng) {
      train_steps(eng, comm, 0, 1, 1);
      eng.save_checkpoint(tmp.path(), "adamw");
    });
  });
  const auto seen_by = per_rank<std::vector<std::string>>(
      2,
      [&](LocalComm& comm) {
        std::vector<std::string> seen;
        with_adam_engine(comm, false, [&](auto& eng) {
          const auto dir = comm.rank() == 0 ? tmp.path() : tmp.path() / "elsewhere";
          seen.push_back(thrown_message([&] { eng.load_checkpoint(dir, "adamw"); }));
          seen.push_back(thrown_message([&] { train_steps(eng, comm, 0, 1, 1); }));
        });
        return seen;
      },
      parallel::CommOptions{.timeout_s = 20});
  REQUIRE(seen_by[0].size() == 2);
  REQUIRE(seen_by[1].size() == 2);
  CHECK_THAT(seen_by[0][0],
             Catch::Contains("could not be opened on rank 1") && Catch::Contains("elsewhere"));
  CHECK_THAT(seen_by[1][0], Catch::Contains("elsewhere"));  // its own error
  for (const auto& seen : seen_by) {
    CHECK(seen[1] == zero::testing::nothing_thrown);  // nothing changed: training goes on
  }
}

TEST_CASE("load_gpt2_weights that fails on one rank after another replaced its slices stops both",
          "[unit][engine][checkpoint]") {
  // Rank 1 cannot open its file (it changed nothing); rank 0 replaced every slice of its own.
  // Both throw, and both refuse to train: a rank that failed before touching anything must
  // still not go on with the others' mix.
  zero::testing::TempDir tmp("engine-weights-fail");
  const auto file = tmp.path() / "w.safetensors";
  LocalComm::run(2, [&](LocalComm& comm) {
    with_adam_engine(comm, false, [&](auto& eng) { engine::save_gpt2_weights(eng, file); });
  });
  const auto seen_by = per_rank<std::vector<std::string>>(2, [&](LocalComm& comm) {
    std::vector<std::string> seen;
    with_adam_engine(comm, false, [&](auto& eng) {
      const auto from = comm.rank() == 0 ? file : tmp.path() / "missing";
      seen.push_back(thrown_message([&] { engine::load_gpt2_weights(eng, from); }));
      seen.push_back(thrown_message([&] { train_steps(eng, comm, 0, 1, 1); }));
    });
    return seen;
  });
  for (const auto& seen : seen_by) {
    REQUIRE(seen.size() == 2);
    INFO(seen[0] << "\n" << seen[1]);
    CHECK_THAT(seen[0], Catch::Contains("failed part-way on rank 1") && Catch::Contains("missing"));
    CHECK_THAT(seen[1], Catch::Contains("load a checkpoint to continue"));
  }
}
