// The flops profiler: GPT's counted forward FLOPs against the closed form 6N + 6LCT per token
// (training; the forward is a third), the exact per-layer sum, and the report and JSON of an
// engine step (latencies measured, n/a for a model whose units do not count FLOPs).
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/hand_written_gpt.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/profile/flops_profile.hpp>
#include <zero/profile/mfu.hpp>

#include "../support/per_rank.hpp"

using namespace zero;

namespace {

nn::GPTConfig shape(std::int64_t layers, std::int64_t channels, std::int64_t seq,
                    std::int64_t vocab, std::int64_t heads) {
  nn::GPTConfig c;
  c.num_layers = layers;
  c.channels = channels;
  c.max_seq_len = seq;
  c.vocab_size = vocab;
  c.num_heads = heads;
  c.dropout = 0;
  return c;
}

// Runs one forward of model (batch rows of cfg.max_seq_len tokens) so its units know their shapes.
template <class Model>
void forward_once(Model& model, const nn::GPTConfig& cfg, std::int64_t batch) {
  nn::LocalParameters<Model> params(model, 7);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch * cfg.max_seq_len));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>((i * 31 + 5) % static_cast<std::size_t>(cfg.vocab_size));
  }
  Arena<> arena(std::size_t{256} << 20);
  nn::StepContext<float> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.targets = tokens.data();
  ctx.batch = batch;
  ctx.seq_len = cfg.max_seq_len;
  model.forward(ctx);
}

}  // namespace

TEST_CASE("GPT's forward FLOPs: exact per-layer sum, and a third of 6N + 6LCT per token",
          "[unit][profile]") {
  const std::int64_t L = 4, C = 256, T = 256, V = 1024, H = 4, B = 2;
  const nn::GPTConfig cfg = shape(L, C, T, V, H);
  nn::GPT<float> model(cfg);
  for (int u = 0; u < model.num_units(); ++u) CHECK_FALSE(model.unit_forward_flops(u));
  forward_once(model, cfg, B);

  nn::FlopCount total;
  for (int u = 0; u < model.num_units(); ++u) {
    const auto f = model.unit_forward_flops(u);
    REQUIRE(f);
    total += *f;
  }
  // Exact: the matrix products (qkv, projection, MLP, tied head) and causal attention (T(T+1)/2
  // scores per sequence and head, two head_dim products each), plus the elementwise ops.
  const std::int64_t R = B * T, scores = B * H * T * (T + 1) / 2;
  const std::int64_t macs = L * (12 * R * C * C + B * C * T * (T + 1)) + R * C * V;
  const std::int64_t elementwise = R * C                                    // position add
                                   + L * (5 * R * C + scores + R * C        // attention half
                                          + 5 * R * C + 4 * R * C + R * C)  // MLP half
                                   + 5 * R * C + R * V;                     // ln_f, softmax
  CHECK(total.macs == macs);
  CHECK(total.flops == 2 * macs + elementwise);

  // The closed form per token for training is 6N + 6LCT; the forward is a third of it. The
  // count differs from it only by what the closed form approximates (position table, biases
  // and norms counted as 2 FLOPs per parameter, elementwise ops): 1.8% at this size.
  const auto N = static_cast<double>(cfg.num_parameters());
  const double closed_forward = static_cast<double>(R) * (6 * N + 6.0 * L * C * T) / 3.0;
  const double counted = static_cast<double>(total.flops);
  CHECK(std::abs(counted / closed_forward - 1) < 0.025);
  // Negative control: counting the full T x T attention (12LCT) misses by 9%.
  const double full_attention = static_cast<double>(R) * (6 * N + 12.0 * L * C * T) / 3.0;
  CHECK(std::abs(counted / full_attention - 1) > 0.05);
}

TEST_CASE("MFU's closed form and the datasheet peaks by card name", "[unit][profile]") {
  // GPT-2 124M (124,439,808 parameters with the position table) at T = 1024.
  CHECK(profile::gpt_flops_per_token(124439808, 12, 768, 1024) ==
        6.0 * 124439808 + 6.0 * 12 * 768 * 1024);
  // cudaDeviceProp::name of each board: the PCIe and NVL boards are not the SXM module's rate.
  CHECK(profile::datasheet_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA H200") == 989.4);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA GH200 480GB") == 989.4);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA H100 PCIe") == 756.0);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA H800 PCIe") == 756.0);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA H100 NVL") == 835.0);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA H200 NVL") == 835.0);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0);
  CHECK(profile::datasheet_bf16_tflops("NVIDIA GeForce RTX 4090") == 0.0);
}

TEST_CASE("Flops profile of an engine step: summary, units, JSON, n/a without FLOP counts",
          "[unit][profile]") {
  const nn::GPTConfig cfg = shape(2, 32, 16, 64, 2);
  const std::int64_t B = 2;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(B * cfg.max_seq_len));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i % 64);
  auto run = [&]<class Model>(std::type_identity<Model>) {
    return testing::per_rank<profile::FlopsProfile>(1, [&](parallel::LocalComm& comm) {
      Model model(cfg);
      engine::Engine<Model, ZeroStage<1>> eng(
          model, comm, [](int, std::span<float> p, std::span<const float> g) {
            for (std::size_t i = 0; i < p.size(); ++i) p[i] -= 0.01f * g[i];
          });
      const engine::MicroBatch batch{tokens.data(), tokens.data(), B, cfg.max_seq_len};
      eng.timers().enable();
      eng.timers().reset();
      for (int m = 0; m < 2; ++m) {  // two steps of one micro-step
        eng.forward(batch);
        eng.backward();
        eng.step();
      }
      return profile::collect_flops_profile(eng, model, 2, B);
    })[0];
  };
  const profile::FlopsProfile p = run(std::type_identity<nn::GPT<float>>{});
  CHECK(p.world_size == 1);
  CHECK(p.micro_steps == 2);
  CHECK(p.params_per_rank == cfg.num_parameters());
  REQUIRE(p.forward);
  CHECK(p.forward->macs > 0);
  CHECK(p.forward_s > 0);
  CHECK(p.backward_s > 0);
  CHECK(p.step_s > 0);
  REQUIRE(p.units.size() == 4);
  CHECK(p.units[0].name == "transformer");
  CHECK(p.units[1].name == "transformer.h.0");
  CHECK(p.units[3].name == "transformer.ln_f");
  double unit_forward = 0;
  for (const auto& u : p.units) unit_forward += u.forward_s;
  CHECK(unit_forward <= p.forward_s * 1.0001);  // units' own time is inside the forward's
  const std::string text = p.report({});
  CHECK(text.find("fwd flops per rank:") != std::string::npos);
  CHECK(text.find("bwd FLOPS per rank = 2 * fwd flops per rank / bwd latency:") !=
        std::string::npos);
  CHECK(text.find("(2): transformer.h.1(") != std::string::npos);
  const auto j = p.to_json();
  CHECK(j.at("fwd").at("flops").get<std::int64_t>() == p.forward->flops);
  CHECK(j.at("units").size() == 4);

  // A model whose units count nothing: the same report with n/a, and null FLOPs in the JSON.
  const profile::FlopsProfile h = run(std::type_identity<nn::HandWrittenGPT<float>>{});
  CHECK_FALSE(h.forward);
  CHECK(h.params_per_rank == cfg.num_parameters());
  CHECK(h.report({}).find("fwd flops per rank:") != std::string::npos);
  CHECK(h.report({}).find("n/a") != std::string::npos);
  CHECK(h.to_json().at("fwd").is_null());
}

TEST_CASE("Flops profile: ranks that share their samples (Ulysses' sp) are not data-parallel",
          "[unit][profile]") {
  // Over 2 ranks that read one sample stream (sample_ranks 1, as sp 2 gives), the world is 2
  // ranks but samples/second counts one rank's rows; it counted both.
  const nn::GPTConfig cfg = shape(1, 16, 8, 32, 2);
  const std::int64_t B = 2;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(B * cfg.max_seq_len), 3);
  const auto sizes = testing::per_rank<std::array<int, 4>>(2, [&](parallel::LocalComm& comm) {
    nn::GPT<float> model(cfg);
    engine::Engine<nn::GPT<float>, ZeroStage<1>> eng(
        model, comm, [](int, std::span<float>, std::span<const float>) {});
    eng.timers().enable();
    eng.forward({tokens.data(), tokens.data(), B, cfg.max_seq_len});
    eng.backward();
    eng.step();
    const auto shared = profile::collect_flops_profile(eng, model, 1, B, 1, /*sample_ranks=*/1);
    const auto own = profile::collect_flops_profile(eng, model, 1, B);
    return std::array<int, 4>{shared.dp_size, shared.world_size, own.dp_size, own.world_size};
  });
  for (const auto& s : sizes) CHECK(s == std::array<int, 4>{1, 2, 2, 2});
}

TEST_CASE("flops_profiler and comms_logger config sections", "[unit][profile]") {
  const Config c = Config::from_json(nlohmann::json::parse(R"({
    "train_batch_size": 2,
    "flops_profiler": {"enabled": true, "profile_step": 3, "module_depth": 1, "top_modules": 2,
                       "detailed": false, "output_file": "p.txt"},
    "comms_logger": {"enabled": true, "verbose": true, "prof_all": false, "debug": true,
                     "prof_ops": ["all_reduce"]}})"));
  CHECK(c.flops_profiler.enabled);
  CHECK(c.flops_profiler.profile_step == 3);
  CHECK(c.flops_profiler.module_depth == 1);
  CHECK(c.flops_profiler.top_modules == 2);
  CHECK_FALSE(c.flops_profiler.detailed);
  CHECK(c.flops_profiler.output_file == "p.txt");
  CHECK(c.comms_logger.enabled);
  CHECK(c.comms_logger.verbose);
  CHECK_FALSE(c.comms_logger.prof_all);
  CHECK(c.comms_logger.prof_ops == std::vector<std::string>{"all_reduce"});
  CHECK(c.warnings.empty());
  // prof_ops names are checked with the config, naming the key (a bad name was a CommError when
  // the Monitor was made); torch.distributed's names of the same collectives are taken.
  const auto with_ops = [](const char* ops) {
    return Config::from_json(nlohmann::json::parse(
        std::string(R"({"comms_logger": {"enabled": true, "prof_all": false, "prof_ops": )") + ops +
        "}}"));
  };
  CHECK(with_ops(R"(["all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"])")
            .comms_logger.prof_ops ==
        std::vector<std::string>{"all_gather", "reduce_scatter", "all_to_all"});
  CHECK_THROWS_WITH(with_ops(R"(["all_reduce", "allreduce"])"),
                    Catch::Contains("comms_logger.prof_ops: 'allreduce' is not one of") &&
                        Catch::Contains("all_reduce, reduce_scatter"));
  const Config n = Config::from_json(
      nlohmann::json::parse(R"({"train_batch_size": 2, "flops_profiler": {"output_file": null}})"));
  CHECK(n.flops_profiler.output_file.empty());  // DeepSpeed's default spelling
  CHECK_THROWS_WITH(
      Config::from_json({{"train_batch_size", 2}, {"flops_profiler", {{"output_file", 3}}}}),
      Catch::Contains("flops_profiler.output_file: expected a file name or null"));
  const Config d = Config::from_json({{"train_batch_size", 2}});
  CHECK_FALSE(d.flops_profiler.enabled);
  CHECK(d.flops_profiler.profile_step == 1);
  CHECK(d.flops_profiler.detailed);
  CHECK(d.comms_logger.prof_all);
  CHECK_FALSE(d.flops_profiler.profiles(1));  // DeepSpeed's default: the step after the first
  config::FlopsProfilerConfig on = d.flops_profiler;
  on.enabled = true;
  CHECK_FALSE(on.profiles(1));
  CHECK(on.profiles(2));
  CHECK_FALSE(on.profiles(3));
  const Config first = Config::from_json(
      {{"train_batch_size", 2}, {"flops_profiler", {{"enabled", true}, {"profile_step", 0}}}});
  CHECK(first.flops_profiler.profiles(1));
  CHECK_THROWS_WITH(
      Config::from_json({{"train_batch_size", 2}, {"flops_profiler", {{"profile_step", -1}}}}),
      Catch::Contains("flops_profiler.profile_step: -1 must be >= 0"));
  const Config w =
      Config::from_json({{"train_batch_size", 2}, {"comms_logger", {{"enabeld", true}}}});
  REQUIRE(w.warnings.size() == 1);
  CHECK(w.warnings[0].find("comms_logger.enabeld") != std::string::npos);
}
