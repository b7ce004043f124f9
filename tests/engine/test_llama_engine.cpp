// The engine with nn::LayerLlama (grouped-query attention, rotary embedding, SwiGLU, an untied
// head): layouts of ZeRO stage, data, tensor (with and without Megatron's sequence parallelism)
// and Ulysses sequence parallelism equal one process on the global batch over
// several f64 AdamW steps with clipping (1e-10; a rank's rotary embedding turning its positions
// as if they started at 0 fails it by 0.057), with every rank's copies of a replicated parameter
// equal; so do pipelines of 2 stages (alone, with dp, tp or Ulysses sp); a checkpoint saved at
// (tp 2, dp 2, stage 3) resumes at (tp 1, dp 2 x sp 2, stage 1) equal to the uninterrupted run.
// Hugging Face's weights: load_llama_weights fills every layout (tp, dp, stage; a file of tied
// embeddings too) with a LlamaForCausalLM state dict packed as documented, LayerLlama with those
// weights (and Llama 3.1's rope scaling) computes the loss of Hugging Face's forward written out
// in f64 (1e-12), and
// save_llama_weights writes that state dict's tensors back (f32 bit for bit, bf16 rounded once).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <parallel/pipeline/pipeline_engine.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/core/rng.hpp>
#include <zero/engine/engine.hpp>
#include <zero/engine/engine_weights.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_shards.hpp>
#include <zero/io/safetensors_writer.hpp>
#include <zero/nn/layer_llama.hpp>
#include <zero/nn/local_parameters.hpp>

#include "../support/per_rank.hpp"
#include "../support/temp_dir.hpp"
#include "engine_test_util.hpp"
#include "sequence_batches.hpp"
#include "tp_test_util.hpp"

using namespace zero;
using parallel::LocalComm;
using parallel::SequenceParallel;
using parallel::TensorParallel;

namespace {

constexpr int accumulation = 2, steps = 3;

// 4 query heads over 2 key/value heads: tp 2 holds one group a rank.
nn::LlamaConfig tiny() {
  nn::LlamaConfig c = nn::LlamaConfig::preset("tiny");
  c.rope_theta = 100.0;  // angles that differ visibly between the positions of 8
  return c;
}

// One process on the whole global batch; sgd: a stateless SGD step in place of AdamW64, whose
// moments (the callback's own) a checkpoint does not hold.
test::LogicalValues reference(std::int64_t global_rows, int num_steps = steps, bool sgd = false) {
  nn::LayerLlama<double> model(tiny());
  auto update = [sgd, adam = test::AdamW64{}](int u, std::span<double> p,
                                              std::span<const double> g) mutable {
    if (sgd) {
      test::sgd(0.1, p, g);
    } else {
      adam(u, p, g);
    }
  };
  return test::sequence_reference(model, test::tp_options(accumulation).seed, global_rows,
                                  num_steps, tiny().vocab_size, false, update);
}

struct Layout {
  int tp, sp, dp, stage;
  bool megatron_sp = false;  // with tp: the norms hold split rows
  bool checkpoint = false;   // activation checkpointing of every block
  bool sgd = false;          // reference's sgd
};

struct Steps {
  int first = 0, last = steps;
  std::filesystem::path load, save;
};

template <int S>
std::vector<test::HeldParam> llama_rank(LocalComm& world, const Layout& l, const Steps& when) {
  parallel::ProcessGroups<LocalComm> groups(world,
                                            parallel::Grid({.tp = l.tp, .cp = l.sp, .dp = l.dp}));
  nn::LlamaConfig cfg = tiny();
  cfg.checkpoint_activations = l.checkpoint;
  nn::LayerLlama<double> model(
      cfg, l.tp > 1 ? TensorParallel(groups.tp(), l.megatron_sp) : TensorParallel(),
      l.sp > 1 ? SequenceParallel(groups.cp()) : SequenceParallel());
  using Engine = engine::Engine<nn::LayerLlama<double>, ZeroStage<S>>;
  const auto sgd = [](int, std::span<double> p, std::span<const double> g) {
    test::sgd(0.1, p, g);
  };
  Engine eng(model, groups,
             l.sgd ? typename Engine::UpdateFn(sgd) : typename Engine::UpdateFn(test::AdamW64{}),
             test::tp_options(accumulation));
  if (!when.load.empty()) (void)eng.load_checkpoint(when.load);
  test::train_sequences(eng, {groups.dp().rank(), l.dp, groups.cp().rank(), l.sp}, when.first,
                        when.last, accumulation, cfg.vocab_size);
  if (!when.save.empty()) eng.save_checkpoint(when.save, "step" + std::to_string(when.last));
  return test::held_params(eng);
}

using Run = test::LayoutRun;

Run run(const Layout& l, const Steps& when = {}) {
  return test::run_layout(l.tp * l.sp * l.dp, l.stage, [&](LocalComm& world, auto s) {
    return llama_rank<decltype(s)::value>(world, l, when);
  });
}

// The same layout cut into pp pipeline stages (uniform: the tiny model's 4 units, 2 a stage),
// each step one train_batch of the accumulation's micro-batches (1F1B).
template <int S>
std::vector<test::HeldParam> llama_pipeline_rank(LocalComm& world, const Layout& l, int pp) {
  parallel::ProcessGroups<LocalComm> groups(
      world, parallel::Grid({.tp = l.tp, .cp = l.sp, .dp = l.dp, .pp = pp}));
  nn::LayerLlama<double> model(
      tiny(), l.tp > 1 ? TensorParallel(groups.tp(), l.megatron_sp) : TensorParallel(),
      l.sp > 1 ? SequenceParallel(groups.cp()) : SequenceParallel());
  parallel::pipeline::PipelineOptions options;
  options.partition_method = "uniform";
  parallel::pipeline::PipelineEngine<nn::LayerLlama<double>, ZeroStage<S>> pipe(
      model, world, groups, test::AdamW64{}, options, test::tp_options(accumulation));
  for (int step = 0; step < steps; ++step) {
    const test::SequenceMicroBatches micro({groups.dp().rank(), l.dp, groups.cp().rank(), l.sp},
                                           step, accumulation, tiny().vocab_size);
    (void)pipe.train_batch(micro.batches);
  }
  return test::held_params(pipe.engine());
}

// ---- Hugging Face weights ----------------------------------------------------------------------

// A Hugging Face LlamaForCausalLM state dict for cfg (f32 values from counters), by name, with
// the shapes Hugging Face gives them; tied: no lm_head.weight (tie_word_embeddings).
struct HfLlama {
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::vector<std::int64_t>> shapes;
};

HfLlama hf_llama(const nn::LlamaConfig& c, bool tied = false) {
  HfLlama w;
  std::uint64_t counter = 0;
  const CounterRng rng(31);
  const auto add = [&](const std::string& name, std::vector<std::int64_t> shape, double scale,
                       double mean) {
    std::int64_t n = 1;
    for (std::int64_t e : shape) n *= e;
    std::vector<float>& v = w.values[name];
    for (std::int64_t i = 0; i < n; ++i) {
      v.push_back(static_cast<float>(mean + scale * rng.normal(counter++)));
    }
    w.shapes[name] = std::move(shape);
  };
  const std::int64_t C = c.channels, F = c.intermediate_size, hs = c.head_size();
  add("model.embed_tokens.weight", {c.vocab_size, C}, 0.5, 0.0);
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {C}, 0.1, 1.0);
    add(p + "self_attn.q_proj.weight", {c.num_heads * hs, C}, 0.2, 0.0);
    add(p + "self_attn.k_proj.weight", {c.num_kv_heads * hs, C}, 0.2, 0.0);
    add(p + "self_attn.v_proj.weight", {c.num_kv_heads * hs, C}, 0.2, 0.0);
    add(p + "self_attn.o_proj.weight", {C, c.num_heads * hs}, 0.2, 0.0);
    add(p + "post_attention_layernorm.weight", {C}, 0.1, 1.0);
    add(p + "mlp.gate_proj.weight", {F, C}, 0.2, 0.0);
    add(p + "mlp.up_proj.weight", {F, C}, 0.2, 0.0);
    add(p + "mlp.down_proj.weight", {C, F}, 0.2, 0.0);
  }
  add("model.norm.weight", {C}, 0.1, 1.0);
  if (!tied) add("lm_head.weight", {c.vocab_size, C}, 0.2, 0.0);
  return w;
}

void write_hf(const HfLlama& w, const std::filesystem::path& file) {
  std::vector<io::TensorDecl> decls;
  for (const auto& [name, shape] : w.shapes) decls.emplace_back(name, DType::f32, shape);
  io::SafetensorsWriter writer(file, decls, {{"format", "pt"}});
  for (const auto& [name, values] : w.values) {
    writer.write(
        name, Tensor<const float>(values.data(), Shape{static_cast<std::int64_t>(values.size())}));
  }
  writer.commit();
}

// w as Hugging Face shards it, written here apart from io::SafetensorsShardWriter: n files of
// consecutive tensors (name order) in dir, and dir/model.safetensors.index.json naming them.
void write_hf_shards(const HfLlama& w, const std::filesystem::path& dir, std::size_t n) {
  nlohmann::json index;
  index["metadata"]["total_size"] = 0;
  const std::size_t per_file = (w.values.size() + n - 1) / n;
  auto it = w.values.begin();
  for (std::size_t f = 0; f < n; ++f) {
    std::string name =
        "model-0000";  // built by append: see tensor names in test_safetensors_shards
    name.append(std::to_string(f + 1)).append("-of-0000").append(std::to_string(n));
    name.append(".safetensors");
    HfLlama part;
    for (std::size_t k = 0; k < per_file && it != w.values.end(); ++k, ++it) {
      part.values.insert(*it);
      part.shapes[it->first] = w.shapes.at(it->first);
      index["weight_map"][it->first] = name;
    }
    write_hf(part, dir / name);
  }
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(2);
}

// LayerLlama's parameters (logical values) from the state dict, packed here as the
// documentation says, apart from the library's layout: qkv_proj's rows are, for each key/value
// head j, the query rows of heads j g .. j g + g - 1, key rows j, value rows j; gate_up_proj's
// are gate's then up's. A tied state dict's head is the token table.
test::LogicalValues packed(const HfLlama& w, const nn::LlamaConfig& c) {
  test::LogicalValues out;
  const std::int64_t C = c.channels, hs = c.head_size(), g = c.group();
  const auto rows_of = [&](const std::string& name, std::int64_t first, std::int64_t count,
                           std::vector<double>& to) {
    const std::vector<float>& from = w.values.at(name);
    for (std::int64_t i = first * C; i < (first + count) * C; ++i) to.push_back(from[i]);
  };
  for (const auto& [name, values] : w.values) {
    out[name].assign(values.begin(), values.end());
  }
  if (!w.values.contains("lm_head.weight"))
    out["lm_head.weight"] = out["model.embed_tokens.weight"];
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    std::vector<double>& qkv = out[p + "self_attn.qkv_proj.weight"];
    for (std::int64_t j = 0; j < c.num_kv_heads; ++j) {
      rows_of(p + "self_attn.q_proj.weight", j * g * hs, g * hs, qkv);
      rows_of(p + "self_attn.k_proj.weight", j * hs, hs, qkv);
      rows_of(p + "self_attn.v_proj.weight", j * hs, hs, qkv);
    }
    std::vector<double>& gate_up = out[p + "mlp.gate_up_proj.weight"];
    rows_of(p + "mlp.gate_proj.weight", 0, c.intermediate_size, gate_up);
    rows_of(p + "mlp.up_proj.weight", 0, c.intermediate_size, gate_up);
    for (const char* part :
         {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight"}) {
      out.erase(p + part);
    }
  }
  return out;
}

// Hugging Face's LlamaForCausalLM forward, written out in f64 from its state dict: the mean
// cross-entropy of tokens' B sequences of T against targets (-1 ignored). wrong_groups: query
// head h reads key/value head h % num_kv_heads instead of h / group (a negative control).
double hf_reference_loss(const HfLlama& w, const nn::LlamaConfig& c,
                         const std::vector<std::int32_t>& tokens,
                         const std::vector<std::int32_t>& targets, std::int64_t B, std::int64_t T,
                         bool wrong_groups = false) {
  const std::int64_t C = c.channels, F = c.intermediate_size, hs = c.head_size(), N = B * T;
  const std::int64_t nh = c.num_heads, kv = c.num_kv_heads, V = c.vocab_size;
  const auto W = [&](const std::string& name) -> const std::vector<float>& {
    return w.values.at(name);
  };
  using Rows = std::vector<std::vector<double>>;
  // y[n] = x[n] W^T for W [out, in].
  const auto linear = [&](const Rows& x, const std::vector<float>& weight, std::int64_t out) {
    Rows y(x.size(), std::vector<double>(static_cast<std::size_t>(out), 0.0));
    const auto in = static_cast<std::int64_t>(x[0].size());
    for (std::size_t n = 0; n < x.size(); ++n) {
      for (std::int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (std::int64_t i = 0; i < in; ++i) s += x[n][i] * weight[o * in + i];
        y[n][o] = s;
      }
    }
    return y;
  };
  const auto rms_norm = [&](const Rows& x, const std::vector<float>& weight) {
    Rows y = x;
    for (auto& row : y) {
      double ss = 0;
      for (double v : row) ss += v * v;
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(C) + c.rms_norm_eps);
      for (std::int64_t i = 0; i < C; ++i) row[i] = row[i] * r * weight[i];
    }
    return y;
  };
  // q * cos + rotate_half(q) * sin, rotate_half(x) = [-x2, x1], per head of hs.
  const auto rope = [&](Rows& x, std::int64_t heads) {
    for (std::int64_t n = 0; n < N; ++n) {
      const double t = static_cast<double>(n % T);
      for (std::int64_t h = 0; h < heads; ++h) {
        double* v = x[n].data() + h * hs;
        for (std::int64_t i = 0; i < hs / 2; ++i) {
          // Llama 3.1's scaling by the function tests/io/test_llama_hf_config.cpp checks.
          const double inv_freq = c.rope_scaling.scaled(
              1.0 / std::pow(c.rope_theta, static_cast<double>(2 * i) / static_cast<double>(hs)));
          const double cs = std::cos(t * inv_freq), sn = std::sin(t * inv_freq);
          const double a = v[i], b = v[i + hs / 2];
          v[i] = a * cs - b * sn;
          v[i + hs / 2] = b * cs + a * sn;
        }
      }
    }
  };
  Rows x(static_cast<std::size_t>(N));
  for (std::int64_t n = 0; n < N; ++n) {
    const std::vector<float>& e = W("model.embed_tokens.weight");
    x[n].assign(e.begin() + tokens[n] * C, e.begin() + (tokens[n] + 1) * C);
  }
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const Rows h = rms_norm(x, W(p + "input_layernorm.weight"));
    Rows q = linear(h, W(p + "self_attn.q_proj.weight"), nh * hs);
    Rows k = linear(h, W(p + "self_attn.k_proj.weight"), kv * hs);
    const Rows v = linear(h, W(p + "self_attn.v_proj.weight"), kv * hs);
    rope(q, nh);
    rope(k, kv);
    Rows att(static_cast<std::size_t>(N), std::vector<double>(static_cast<std::size_t>(nh * hs)));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t head = 0; head < nh; ++head) {
        const std::int64_t j = wrong_groups ? head % kv : head / (nh / kv);  // repeat_kv
        for (std::int64_t t = 0; t < T; ++t) {
          std::vector<double> score(static_cast<std::size_t>(t + 1));
          double top = -INFINITY;
          for (std::int64_t u = 0; u <= t; ++u) {
            double s = 0;
            for (std::int64_t i = 0; i < hs; ++i) {
              s += q[b * T + t][head * hs + i] * k[b * T + u][j * hs + i];
            }
            score[u] = s / std::sqrt(static_cast<double>(hs));
            top = std::max(top, score[u]);
          }
          double sum = 0;
          for (double& s : score) sum += (s = std::exp(s - top));
          for (std::int64_t i = 0; i < hs; ++i) {
            double o = 0;
            for (std::int64_t u = 0; u <= t; ++u) o += score[u] / sum * v[b * T + u][j * hs + i];
            att[b * T + t][head * hs + i] = o;
          }
        }
      }
    }
    const Rows o = linear(att, W(p + "self_attn.o_proj.weight"), C);
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t i = 0; i < C; ++i) x[n][i] += o[n][i];
    }
    const Rows h2 = rms_norm(x, W(p + "post_attention_layernorm.weight"));
    const Rows gate = linear(h2, W(p + "mlp.gate_proj.weight"), F);
    Rows act = linear(h2, W(p + "mlp.up_proj.weight"), F);
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t i = 0; i < F; ++i) act[n][i] *= gate[n][i] / (1.0 + std::exp(-gate[n][i]));
    }
    const Rows down = linear(act, W(p + "mlp.down_proj.weight"), C);
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t i = 0; i < C; ++i) x[n][i] += down[n][i];
    }
  }
  const Rows logits = linear(
      rms_norm(x, W("model.norm.weight")),
      W(w.values.contains("lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight"), V);
  double loss = 0;
  std::int64_t counted = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    const double top = *std::max_element(logits[n].begin(), logits[n].end());
    double sum = 0;
    for (double z : logits[n]) sum += std::exp(z - top);
    loss += top + std::log(sum) - logits[n][targets[n]];
    ++counted;
  }
  return loss / static_cast<double>(counted);
}

// LayerLlama<double> with the given logical values: its loss on tokens and targets.
double layer_llama_loss(const nn::LlamaConfig& c, const test::LogicalValues& values,
                        std::vector<std::int32_t>& tokens, std::vector<std::int32_t>& targets,
                        std::int64_t B, std::int64_t T) {
  nn::LayerLlama<double> model(c);
  nn::LocalParameters<nn::LayerLlama<double>> params(model, 1);
  for (int u = 0; u < model.num_units(); ++u) {
    Tensor<double> v = params.unit_values(u);
    std::int64_t offset = 0;
    for (const nn::ParamSpec& spec : params.unit_specs(u)) {
      const std::vector<double>& from = values.at(spec.name);
      REQUIRE(static_cast<std::int64_t>(from.size()) == spec.numel());
      std::copy(from.begin(), from.end(), v.data() + offset);
      offset += spec.numel();
    }
  }
  Arena<> arena(16 << 20);
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.batch = B;
  ctx.seq_len = T;
  ctx.training = false;
  return model.forward(ctx);
}

// A rank of a layout over LayerLlama<double>(c) that loads file (load_llama_weights) and, when
// save is given, writes the engine's weights there in dtype (save_llama_weights).
template <int S>
std::vector<test::HeldParam> hf_rank(LocalComm& world, const nn::LlamaConfig& c, const Layout& l,
                                     const std::filesystem::path& file,
                                     const std::filesystem::path& save = {},
                                     DType dtype = DType::f32, std::uint64_t max_shard_bytes = 0) {
  parallel::ProcessGroups<LocalComm> groups(world, parallel::Grid({.tp = l.tp, .dp = l.dp}));
  nn::LayerLlama<double> model(c, l.tp > 1 ? TensorParallel(groups.tp()) : TensorParallel());
  using Engine = engine::Engine<nn::LayerLlama<double>, ZeroStage<S>>;
  const auto sgd = [](int, std::span<double> p, std::span<const double> g) {
    test::sgd(0.1, p, g);
  };
  Engine eng(model, groups, typename Engine::UpdateFn(sgd), test::tp_options(accumulation));
  engine::load_llama_weights(eng, file, c);
  if (!save.empty()) {
    const engine::WeightsExport written =
        engine::save_llama_weights(eng, save, c, dtype, max_shard_bytes);
    // Not a CHECK: ranks are threads, and Catch's assertions are not thread-safe.
    expect<Error>(written.tensors == static_cast<std::size_t>(3 + 9 * c.num_layers),
                  "save_llama_weights wrote ", written.tensors, " tensors");
  }
  return test::held_params(eng);
}

}  // namespace

TEST_CASE(
    "LayerLlama under the engine: (tp, sp, dp, stage) layouts equal the single-process reference "
    "(f64 AdamW, clipping)",
    "[unit][engine][llama]") {
  const std::vector<Layout> layouts{
      {1, 1, 1, 0},       {1, 1, 2, 1}, {1, 1, 2, 3}, {2, 1, 1, 2}, {2, 1, 2, 3},
      {2, 1, 2, 1, true}, {1, 2, 1, 2}, {1, 2, 2, 3}, {2, 2, 1, 3}, {1, 1, 2, 3, false, true},
  };
  for (const Layout& l : layouts) {
    const auto want = reference(test::micro_rows * accumulation * l.dp);
    const Run got = run(l);
    const double error = test::max_difference(got.values, want);
    INFO("tp " << l.tp << (l.megatron_sp ? " (SP)" : "") << ", sp " << l.sp << ", dp " << l.dp
               << ", stage " << l.stage << (l.checkpoint ? ", checkpointed" : "")
               << ": worst difference " << error);
    CHECK(error <= 1e-10);
    CHECK(got.copies_differ == 0.0);
  }
  // Negative control: the reference after one step more.
  CHECK(test::max_difference(run({2, 2, 1, 3}).values,
                             reference(test::micro_rows * accumulation, steps + 1)) > 1e-6);
}

TEST_CASE(
    "LayerLlama: a checkpoint saved at tp 2 x dp 2 resumes at sp 2 x dp 2 as if uninterrupted",
    "[unit][engine][llama]") {
  const testing::TempDir dir("llama_resume");
  const auto want = reference(test::micro_rows * accumulation * 2, steps, true);
  (void)run({2, 1, 2, 3, false, false, true}, {0, 1, {}, dir.path()});
  const Run resumed = run({1, 2, 2, 1, false, false, true}, {1, steps, dir.path(), {}});
  CHECK(test::max_difference(resumed.values, want) <= 1e-10);
  CHECK(resumed.copies_differ == 0.0);
}

TEST_CASE(
    "LayerLlama in a pipeline: pp 2, alone and with dp, tp or Ulysses sp, equals the reference",
    "[unit][engine][llama][pipeline]") {
  const int pp = 2;
  for (const Layout& l :
       std::vector<Layout>{{1, 1, 1, 0}, {1, 1, 2, 1}, {2, 1, 1, 1}, {1, 2, 1, 1}}) {
    const auto want = reference(test::micro_rows * accumulation * l.dp);
    const Run got = test::run_layout(pp * l.tp * l.sp * l.dp, l.stage, [&](LocalComm& w, auto s) {
      if constexpr (decltype(s)::value <= 1) {
        return llama_pipeline_rank<decltype(s)::value>(w, l, pp);
      } else {
        return std::vector<test::HeldParam>{};  // a pipeline trains at ZeRO 0-1
      }
    });
    const double error = test::max_difference(got.values, want);
    INFO("pp 2 x tp " << l.tp << " x sp " << l.sp << " x dp " << l.dp << ", stage " << l.stage
                      << ": worst difference " << error);
    CHECK(error <= 1e-10);
    CHECK(got.copies_differ == 0.0);
  }
}

TEST_CASE("load_llama_weights fills every layout from a Hugging Face Llama file",
          "[unit][engine][llama][weights]") {
  const testing::TempDir dir("llama_hf_load");
  const nn::LlamaConfig c = tiny();
  for (const bool tied : {false, true}) {
    const HfLlama hf = hf_llama(c, tied);
    const std::filesystem::path file = dir.path() / (tied ? "tied.safetensors" : "hf.safetensors");
    write_hf(hf, file);
    const test::LogicalValues want = packed(hf, c);
    for (const Layout& l : std::vector<Layout>{
             {1, 1, 1, 0}, {1, 1, 2, 3}, {2, 1, 1, 2}, {2, 1, 2, 3}, {2, 1, 2, 1}}) {
      INFO((tied ? "tied, " : "") << "tp " << l.tp << ", dp " << l.dp << ", stage " << l.stage);
      const Run got = test::run_layout(l.tp * l.dp, l.stage, [&](LocalComm& world, auto s) {
        return hf_rank<decltype(s)::value>(world, c, l, file);
      });
      CHECK(test::max_difference(got.values, want) == 0.0);
      CHECK(got.copies_differ == 0.0);
    }
  }
}

TEST_CASE("LayerLlama with a Hugging Face file's weights computes Hugging Face's loss",
          "[unit][engine][llama][weights]") {
  const nn::LlamaConfig c = tiny();
  constexpr std::int64_t B = 2, T = 7;
  std::vector<std::int32_t> tokens(B * T), targets(B * T);
  for (std::int64_t i = 0; i < B * T; ++i) {
    tokens[i] = static_cast<std::int32_t>((13 * i + 5) % c.vocab_size);
    targets[i] = i == 3 ? -1 : static_cast<std::int32_t>((29 * i + 2) % c.vocab_size);
  }
  // Llama 3.1's rope scaling over tiny's pairs (wavelengths 6.3, 20, 63 and 199 at theta 100):
  // against an original context of 64, the first kept, two blended, the last 4 times slower.
  nn::LlamaConfig scaled = c;
  scaled.rope_scaling.factor = 4.0;
  scaled.rope_scaling.original_max_position_embeddings = 64;
  for (const auto& [cfg, tied] :
       {std::pair{c, false}, std::pair{c, true}, std::pair{scaled, false}}) {
    const HfLlama hf = hf_llama(cfg, tied);
    const double want = hf_reference_loss(hf, cfg, tokens, targets, B, T);
    const double got = layer_llama_loss(cfg, packed(hf, cfg), tokens, targets, B, T);
    INFO((tied ? "tied, " : "") << (cfg.rope_scaling.active() ? "scaled: " : "") << "LayerLlama "
                                << got << ", Hugging Face's forward " << want);
    CHECK(std::abs(got - want) <= 1e-12 * std::abs(want));
    // Negative controls: query heads reading the wrong key/value heads; the other scaling.
    CHECK(std::abs(hf_reference_loss(hf, cfg, tokens, targets, B, T, true) - got) > 1e-6);
    const nn::LlamaConfig other = cfg.rope_scaling.active() ? c : scaled;
    CHECK(std::abs(hf_reference_loss(hf, other, tokens, targets, B, T) - got) > 1e-9);
  }
}

TEST_CASE("save_llama_weights writes Hugging Face's tensors, and they load back",
          "[unit][engine][llama][weights]") {
  const testing::TempDir dir("llama_hf_save");
  const nn::LlamaConfig c = tiny();
  const HfLlama hf = hf_llama(c);
  const std::filesystem::path file = dir.path() / "hf.safetensors";
  write_hf(hf, file);
  for (const Layout& l : std::vector<Layout>{{1, 1, 2, 3}, {2, 1, 2, 1}}) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
      INFO("tp " << l.tp << ", dp " << l.dp << ", stage " << l.stage << ", " << name_of(dtype));
      const std::filesystem::path saved = dir.path() / "saved.safetensors";
      (void)test::run_layout(l.tp * l.dp, l.stage, [&](LocalComm& world, auto s) {
        return hf_rank<decltype(s)::value>(world, c, l, file, saved, dtype);
      });
      const io::SafetensorsReader reader(saved);
      std::size_t seen = 0;
      for (const auto& [name, values] : hf.values) {
        INFO(name);
        REQUIRE(reader.contains(name));
        CHECK(reader.info(name).shape == hf.shapes.at(name));
        CHECK(reader.info(name).dtype == dtype);
        const std::vector<float> read = reader.read_vector<float>(name, io::DTypeRule::convert);
        std::vector<float> expected = values;
        if (dtype == DType::bf16) {
          for (float& v : expected) v = convert<float>(convert<bf16>(v));
        }
        CHECK(read == expected);
        ++seen;
      }
      CHECK(reader.tensors().size() == seen);  // Hugging Face's tensors and no others
      // The f32 file loads back as the original.
      if (dtype == DType::f32) {
        const Run again = test::run_layout(2, 3, [&](LocalComm& world, auto s) {
          return hf_rank<decltype(s)::value>(world, c, {1, 1, 2, 3}, saved);
        });
        CHECK(test::max_difference(again.values, packed(hf, c)) == 0.0);
      }
    }
  }
}

TEST_CASE("Llama weights in Hugging Face's shards: loaded by index or directory, saved past a size",
          "[unit][engine][llama][weights]") {
  const testing::TempDir dir("llama_hf_shards");
  const nn::LlamaConfig c = tiny();
  for (const bool tied : {false, true}) {
    const HfLlama hf = hf_llama(c, tied);
    const std::filesystem::path hub = dir.path() / (tied ? "hub_tied" : "hub");
    std::filesystem::create_directories(hub);
    write_hf_shards(hf, hub, 3);
    const test::LogicalValues want = packed(hf, c);
    for (const auto& [l, opened] :
         {std::pair{Layout{1, 1, 2, 3}, hub}, std::pair{Layout{2, 1, 2, 1}, hub},
          std::pair{Layout{2, 1, 1, 2}, hub / "model.safetensors.index.json"}}) {
      INFO((tied ? "tied, " : "") << "tp " << l.tp << ", dp " << l.dp << ", stage " << l.stage
                                  << " from " << opened.filename().string());
      const Run got = test::run_layout(l.tp * l.dp, l.stage, [&](LocalComm& world, auto s) {
        return hf_rank<decltype(s)::value>(world, c, l, opened);
      });
      CHECK(test::max_difference(got.values, want) == 0.0);
      CHECK(got.copies_differ == 0.0);
    }
  }
  // Saved at tp 2 x dp 2 in files of at most 6000 bytes of data (tiny's token table and head,
  // 8 KiB each in f32, get files of their own), then loaded by the directory at dp 2, stage 3.
  const HfLlama hf = hf_llama(c);
  write_hf(hf, dir.path() / "hf.safetensors");
  const std::filesystem::path out = dir.path() / "out";
  std::filesystem::create_directories(out);
  (void)test::run_layout(4, 1, [&](LocalComm& world, auto s) {
    return hf_rank<decltype(s)::value>(world, c, {2, 1, 2, 1}, dir.path() / "hf.safetensors",
                                       out / "model.safetensors", DType::f32, 6000);
  });
  CHECK_FALSE(std::filesystem::exists(out / "model.safetensors"));
  const io::SafetensorsShards saved(out);
  CHECK(saved.sharded());
  CHECK(saved.num_files() > 3);
  std::uint64_t data_bytes = 0;
  for (std::size_t f = 0; f < saved.num_files(); ++f) {
    const io::SafetensorsReader& file = saved.file(f);
    INFO(file.path().string());
    std::uint64_t bytes = 0;
    for (const auto& t : file.tensors()) bytes += t.bytes();
    CHECK((bytes <= 6000 || file.tensors().size() == 1));
    data_bytes += bytes;
  }
  std::uint64_t want_bytes = 0;
  for (const auto& [name, values] : hf.values) {
    INFO(name);
    REQUIRE(saved.contains(name));
    CHECK(saved.read_vector<float>(name) == values);
    want_bytes += 4 * values.size();
  }
  CHECK(saved.names().size() == hf.values.size());
  CHECK(data_bytes == want_bytes);
  const Run again = test::run_layout(2, 3, [&](LocalComm& world, auto s) {
    return hf_rank<decltype(s)::value>(world, c, {1, 1, 2, 3}, out);
  });
  CHECK(test::max_difference(again.values, packed(hf, c)) == 0.0);
}

TEST_CASE("load_llama_weights names a missing or misshapen tensor on every rank",
          "[unit][engine][llama][weights]") {
  const testing::TempDir dir("llama_hf_bad");
  const nn::LlamaConfig c = tiny();
  HfLlama missing = hf_llama(c);
  missing.values.erase("model.layers.1.self_attn.k_proj.weight");
  missing.shapes.erase("model.layers.1.self_attn.k_proj.weight");
  write_hf(missing, dir.path() / "missing.safetensors");
  nn::LlamaConfig mha = c;  // a file of 4 key/value heads for a model of 2
  mha.num_kv_heads = mha.num_heads;
  write_hf(hf_llama(mha), dir.path() / "mha.safetensors");
  const auto messages = [&](const std::filesystem::path& file) {
    return testing::per_rank<std::string>(2, [&](LocalComm& world) {
      return testing::thrown_message([&] { (void)hf_rank<3>(world, c, {1, 1, 2, 3}, file); });
    });
  };
  for (const std::string& m : messages(dir.path() / "missing.safetensors")) {
    CHECK_THAT(m, Catch::Contains("load_llama_weights") &&
                      Catch::Contains("model.layers.1.self_attn.k_proj.weight"));
  }
  for (const std::string& m : messages(dir.path() / "mha.safetensors")) {
    CHECK_THAT(m, Catch::Contains("model.layers.0.self_attn.k_proj.weight") &&
                      Catch::Contains("[32, 32]") && Catch::Contains("[16, 32]"));
  }
}
