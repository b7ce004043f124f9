// LinearCrossEntropy (the LM head's GEMM and loss in row chunks) against TiedLinear +
// SoftmaxCrossEntropy: with one chunk the bits must be the unfused ones; in several chunks the
// values must be close, the bits independent of the thread count, and no whole set of logits
// kept.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include <catch2/catch.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <zero/core/arena.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/hand_written_gpt.hpp>
#include <zero/nn/layers/linear_cross_entropy.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/testing/gradient_check.hpp>

#include "../support/worse.hpp"

using namespace zero;

namespace {

// Runs fn with threads OpenMP threads, then restores the count.
template <class Fn>
auto with_threads([[maybe_unused]] int threads, Fn&& fn) {
#if defined(_OPENMP)
  struct Restore {
    int threads = omp_get_max_threads();
    ~Restore() { omp_set_num_threads(threads); }
  } restore;
  omp_set_num_threads(threads);
#endif
  return fn();
}

// The loss and every gradient of one forward and backward, as doubles.
template <class M>
std::vector<double> run(M& model, nn::StepContext<typename M::value_type>& ctx) {
  using T = typename M::value_type;
  nn::LocalParameters<M> params(model, 5);
  Arena<> arena(32 << 20);
  {  // the arena's memory starts as NaN (all bits set, in every float type), as a reused
     // arena's holds old values: nothing may read it before writing it
    const Tensor<std::byte> all = arena.allocate<std::byte>({32 << 20});
    std::memset(all.data(), 0xff, static_cast<std::size_t>(all.numel()));
    arena.reset();
  }
  ctx.arena = &arena;
  std::vector<double> out{convert<double>(model.forward(ctx))};
  model.backward(ctx);
  for (int u = 0; u < model.num_units(); ++u) {
    for (const T& g : params.unit_grads(u)) out.push_back(convert<double>(g));
  }
  return out;
}

}  // namespace

namespace {

// GPT's tiny shape with vocab_size V; chunk_bytes bounds the head's logits.
nn::GPTConfig tiny_gpt(std::int64_t chunk_bytes) {
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.num_layers = 1;
  cfg.logits_chunk_bytes = chunk_bytes;
  return cfg;
}

constexpr std::int64_t gpt_batch = 3, gpt_seq = 7;  // 21 rows

// Loss and gradients of model M (nn::GPT, or the hand-written GPT with its unfused head) shaped
// by cfg on a fixed batch of tokens below `tokens_below` (cfg.vocab_size when 0; two targets
// ignored), loss scale 2; training false runs the forward as an evaluation (the chunked head then
// computes its gradients in the backward; the tiny GPT has no dropout).
template <class T, class M = nn::GPT<T>>
std::vector<double> gpt_run_of(const nn::GPTConfig& cfg, bool training = true,
                               std::int64_t tokens_below = 0) {
  M model(cfg);
  const std::int64_t V = tokens_below > 0 ? tokens_below : cfg.vocab_size;
  std::vector<std::int32_t> tokens, targets;
  for (std::int64_t i = 0; i < gpt_batch * gpt_seq; ++i) {
    tokens.push_back(static_cast<std::int32_t>((i * 11 + 2) % V));
    targets.push_back(i == 4 || i == 17 ? -1 : static_cast<std::int32_t>((i * 7 + 3) % V));
  }
  nn::StepContext<T> ctx;
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.batch = gpt_batch;
  ctx.seq_len = gpt_seq;
  ctx.loss_scale = 2;
  ctx.training = training;
  return run(model, ctx);
}

// gpt_run_of on the tiny GPT whose head holds chunk_bytes of logits at once.
template <class T, class M = nn::GPT<T>>
std::vector<double> gpt_run(std::int64_t chunk_bytes, bool training = true) {
  return gpt_run_of<T, M>(tiny_gpt(chunk_bytes), training);
}

double worst_relative(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double scale = 0, diff = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    diff = zero::testing::worse(diff, std::abs(got[i] - want[i]));
  }
  return diff / scale;
}

}  // namespace

TEST_CASE("LinearCrossEntropy in row chunks equals the whole batch's logits, loss and gradients",
          "[unit][nn][fused]") {
  const std::int64_t V = tiny_gpt(0).vocab_size;
  // 5 rows a chunk in f64 and f32 (21 rows: chunks of 5, 5, 5, 5, 1), and a 16-row chunk.
  for (std::int64_t chunk_rows : {5, 16}) {
    INFO("chunk rows " << chunk_rows);
    const std::int64_t f64_bytes = chunk_rows * V * 8, f32_bytes = chunk_rows * V * 4;
    CHECK(worst_relative(gpt_run<double>(f64_bytes), gpt_run<double>(0)) < 1e-13);
    CHECK(worst_relative(gpt_run<float>(f32_bytes), gpt_run<float>(0)) < 1e-5);
    CHECK(worst_relative(gpt_run<bf16>(chunk_rows * V * 2), gpt_run<bf16>(0)) < 2e-2);
    // The chunking depends on the shape only: the same bits at 1 and 2 threads.
    const auto want = with_threads(1, [&] { return gpt_run<float>(f32_bytes); });
    CHECK(with_threads(2, [&] { return gpt_run<float>(f32_bytes); }) == want);
    CHECK(want != gpt_run<float>(0));  // and the chunks really changed the weight gradient's sums
    // The gradients of a training forward (its chunks' weight gradients added first to last)
    // and of a backward that recomputes the logits after an evaluation forward (last to first).
    CHECK(worst_relative(gpt_run<double>(f64_bytes, false), gpt_run<double>(0)) < 1e-13);
    const auto recomputed = gpt_run<float>(f32_bytes, false);
    CHECK(worst_relative(recomputed, gpt_run<float>(0)) < 1e-5);
    if (chunk_rows == 5) CHECK(recomputed != want);  // 5 chunks summed in the other order
  }
  // A batch that just fits one chunk takes the bits of the hand-written GPT, whose head is the
  // unfused GEMM then cross-entropy; a bound below one row still makes progress, a row a chunk.
  CHECK(gpt_run<float>(21 * V * 4) == gpt_run<float, nn::HandWrittenGPT<float>>(0));
  CHECK(worst_relative(gpt_run<double>(1), gpt_run<double>(0)) < 1e-13);
}

TEST_CASE("LinearCrossEntropy keeps one chunk of logits and says so when asked for them",
          "[unit][nn][fused]") {
  const nn::GPTConfig whole = tiny_gpt(0), chunked = tiny_gpt(4 * tiny_gpt(0).vocab_size * 4);
  // Bytes the head's forward leaves in the arena (targets given or not; a training forward or
  // an evaluation; 0 for the training forward without targets the head refuses).
  const auto held = [](const nn::GPTConfig& cfg, bool targets, bool training) {
    nn::GPT<float> model(cfg);
    nn::LocalParameters<nn::GPT<float>> params(model, 5);
    std::vector<std::int32_t> tokens(gpt_batch * gpt_seq, 3), labels(tokens.size(), 1);
    Arena<> arena(32 << 20);
    nn::StepContext<float> ctx;
    ctx.arena = &arena;
    ctx.tokens = tokens.data();
    ctx.targets = targets ? labels.data() : nullptr;
    ctx.batch = gpt_batch;
    ctx.seq_len = gpt_seq;
    ctx.training = training;
    const Arena<>::Mark before_head = [&] {
      for (int u = 0; u < model.head_unit(); ++u) model.forward_unit(u, ctx);
      return arena.mark();
    }();
    if (training && !targets) {  // refused: its backward could not seed a gradient
      CHECK_THROWS_WITH(model.forward_unit(model.head_unit(), ctx),
                        Catch::Contains("a training forward needs the labels") &&
                            Catch::Contains("no input 'targets'"));
      return std::size_t{0};
    }
    model.forward_unit(model.head_unit(), ctx);
    const std::size_t bytes = arena.used_bytes() - before_head;
    if (targets && cfg.logits_chunk_bytes > 0) {
      CHECK_THROWS_WITH(model.logits(), Catch::Contains("kept no logits"));
    } else {
      CHECK(model.logits().numel() == gpt_batch * gpt_seq * cfg.vocab_size);
    }
    return bytes;
  };
  const std::int64_t rows = gpt_batch * gpt_seq, V = tiny_gpt(0).vocab_size,
                     C = tiny_gpt(0).channels;
  const std::size_t row_bytes = V * 4;
  for (const bool training : {true, false}) {
    INFO("training " << training);
    CHECK(held(whole, true, training) >= rows * row_bytes);
  }
  CHECK(held(chunked, false, false) == held(whole, false, false));  // every logit
  CHECK(held(whole, false, false) >= rows * row_bytes);
  CHECK(held(chunked, false, true) == 0);  // a training forward without targets is refused
  CHECK(held(whole, false, true) == 0);
  // An evaluation with targets keeps 4 rows of logits instead of 21 (arena allocations are
  // aligned: a little slack).
  CHECK(held(whole, true, false) - held(chunked, true, false) >= (rows - 4) * row_bytes - 128);
  // A training forward in chunks keeps the gradients it computed besides: the weight's [V, C]
  // and the input's [rows, C] (GPT-2's 50257 x 768 and 8192 x 768 in bf16: 89 MB beside a
  // 256 MiB chunk of logits).
  const std::size_t grads = static_cast<std::size_t>(V * C + rows * C) * 4;
  CHECK(held(chunked, true, true) - held(chunked, true, false) >= grads);
  CHECK(held(chunked, true, true) - held(chunked, true, false) <=
        grads + 2 * BumpArena::default_alignment);
  // Finite differences through the chunked head (f64), tied embedding included.
  nn::GPTConfig cfg = tiny_gpt(3 * tiny_gpt(0).vocab_size * 8);
  nn::GPT<double> gpt(cfg);
  std::vector<std::int32_t> tokens, targets;
  for (int i = 0; i < 2 * 4; ++i) {
    tokens.push_back(static_cast<std::int32_t>((i * 7 + 1) % cfg.vocab_size));
    targets.push_back(i == 2 ? -1 : static_cast<std::int32_t>((i * 3 + 2) % cfg.vocab_size));
  }
  engine::MicroBatch b{tokens.data(), targets.data(), 2, 4};
  testing::GradientCheckOptions o;
  o.max_elements = 24;
  for (int unit : {0, gpt.head_unit()}) {
    const auto r = testing::check_unit_gradients(gpt, unit, b, o);
    INFO(r.summary());
    CHECK(r.passed());
  }
  CHECK_THROWS_AS(tiny_gpt(-1).validate(), ConfigError);
}

TEST_CASE(
    "A token table padded past the vocabulary: the padding is out of the softmax, its gradient "
    "zero, the rest the unpadded model's",
    "[unit][nn][fused]") {
  // 61 tokens in a table of 64 rows (Megatron pads the table to split it over tensor-parallel
  // ranks, llm.c for the GEMMs). The initialiser draws element i of a tensor from (seed, name, i),
  // so the padded table's first 61 rows are the unpadded table's.
  const std::int64_t vocab = 61, rows = 64, C = tiny_gpt(0).channels;
  const auto config = [&](std::int64_t padded, std::int64_t chunk_bytes) {
    nn::GPTConfig cfg = tiny_gpt(chunk_bytes);
    cfg.vocab_size = vocab;
    cfg.padded_vocab_size = padded;
    return cfg;
  };
  // The padded run's loss and gradients without the padding rows of wte's gradient (unit 0's
  // first tensor, after the loss), which must be exact zeros.
  const auto without_padding = [&](std::vector<double> out) {
    const auto first = out.begin() + 1 + vocab * C, last = out.begin() + 1 + rows * C;
    double padding = 0;
    for (auto it = first; it != last; ++it) padding = zero::testing::worse(padding, std::abs(*it));
    CHECK(padding == 0.0);
    out.erase(first, last);
    return out;
  };
  // The whole batch's logits at once, and in chunks of 5 rows (a training forward computing the
  // gradients chunk by chunk, and an evaluation forward whose backward recomputes them).
  for (const std::int64_t chunk_rows : {std::int64_t{0}, std::int64_t{5}}) {
    INFO("chunk rows " << chunk_rows);
    for (const bool training : {true, false}) {
      INFO("training " << training);
      const auto bytes = [&](std::size_t element) {
        return chunk_rows * rows * static_cast<std::int64_t>(element);
      };
      CHECK(worst_relative(without_padding(gpt_run_of<double>(config(rows, bytes(8)), training)),
                           gpt_run_of<double>(config(0, bytes(8)), training)) < 1e-13);
      CHECK(worst_relative(without_padding(gpt_run_of<float>(config(rows, bytes(4)), training)),
                           gpt_run_of<float>(config(0, bytes(4)), training)) < 1e-5);
      CHECK(worst_relative(without_padding(gpt_run_of<bf16>(config(rows, bytes(2)), training)),
                           gpt_run_of<bf16>(config(0, bytes(2)), training)) < 2e-2);
    }
  }
  // The hand-written GPT masks the padding the same way: the bits of the one-chunk head.
  CHECK(gpt_run_of<float>(config(rows, 0)) ==
        gpt_run_of<float, nn::HandWrittenGPT<float>>(config(rows, 0)));
  // Negative control: a 64-token model on the same 61-token batch has the padding in its softmax
  // (3 more classes at init: the loss grows by about log(64 / 61)).
  const double masked = gpt_run_of<double>(config(rows, 0))[0],
               unmasked = gpt_run_of<double>(tiny_gpt(0), true, vocab)[0];
  CHECK(unmasked - masked > 0.01);
  // A target in the padding is no token: refused, as one past the vocabulary is.
  nn::GPT<float> model(config(rows, 0));
  nn::LocalParameters<nn::GPT<float>> params(model, 5);
  std::vector<std::int32_t> tokens(4, 1), targets{1, 2, 62, 3};
  Arena<> arena(8 << 20);
  nn::StepContext<float> ctx;
  ctx.arena = &arena;
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.batch = 1;
  ctx.seq_len = 4;
  CHECK_THROWS_WITH(model.forward(ctx),
                    Catch::Contains("target 62 at position 2 is outside the vocabulary [0, 61)"));
  // So is a token, in both models; and the table declares its rows in use (ParamSpec::
  // rows_in_use), so a checkpoint padded otherwise loads.
  targets[2] = 3;
  tokens[1] = 61;
  CHECK_THROWS_WITH(model.forward(ctx),
                    Catch::Contains("61") && Catch::Contains("outside the vocabulary [0, 61)"));
  nn::HandWrittenGPT<float> hand(config(rows, 0));
  nn::LocalParameters<nn::HandWrittenGPT<float>> hand_params(hand, 5);
  CHECK_THROWS_WITH(hand.forward(ctx),
                    Catch::Contains("61") && Catch::Contains("outside the vocabulary [0, 61)"));
  CHECK(model.unit_params(0)[0].rows_in_use == vocab);
  // A padded size below the vocabulary is a configuration error naming both.
  CHECK_THROWS_WITH(config(60, 0).validate(),
                    Catch::Contains("padded_vocab_size (60) must be 0 (unpadded) or at least "
                                    "vocab_size (61)"));
  // The layer's own setter: a vocabulary past the weight's rows is refused.
  nn::LinearCrossEntropy<float> head(
      "lm_head", [] { return nn::ParamView<float>{}; }, C, rows);
  CHECK_THROWS_WITH(head.set_vocabulary(rows + 1),
                    Catch::Contains("a vocabulary of 65 classes must be in [1, 64]"));
}
