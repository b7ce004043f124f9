// train_gpt: trains a small byte-level GPT-2 on the bundled corpus, in one process.
//
// This is the single-process form of the main example: nn::GPT with its parameters in one flat
// buffer per unit (nn::LocalParameters), fused AdamW per unit (optim::AdamW), DeepSpeed's
// WarmupCosineLR schedule, global-norm clipping, and the deterministic DataLoader. The ZeRO engine
// (stages 0-3 over LocalComm/MpiComm) replaces LocalParameters when it lands; the numbers it
// produces must equal these.
//
//   ./train_gpt [--steps 100] [--batch 8] [--seq 64] [--layers 4] [--heads 4] [--channels 128]
//               [--lr 3e-3] [--seed 1234] [--data data/corpus.txt] [--print-every 10]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <optim/adam.hpp>
#include <optim/grad_norm.hpp>
#include <zero/core/arena.hpp>
#include <zero/data/byte_tokenizer.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/prepare_text.hpp>
#include <zero/data/token_file.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/local_parameters.hpp>

namespace {

struct Options {
  std::int64_t steps = 100, batch = 8, seq = 64, layers = 4, heads = 4, channels = 128;
  double lr = 3e-3, clip = 1.0;
  std::uint64_t seed = 1234;
  std::int64_t print_every = 10;
  std::string data = ZERO_DEFAULT_CORPUS;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "train_gpt: %s needs a value\n", flag.c_str());
      std::exit(2);
    }
    const char* v = argv[i + 1];
    if (flag == "--steps")
      o.steps = std::atoll(v);
    else if (flag == "--batch")
      o.batch = std::atoll(v);
    else if (flag == "--seq")
      o.seq = std::atoll(v);
    else if (flag == "--layers")
      o.layers = std::atoll(v);
    else if (flag == "--heads")
      o.heads = std::atoll(v);
    else if (flag == "--channels")
      o.channels = std::atoll(v);
    else if (flag == "--lr")
      o.lr = std::atof(v);
    else if (flag == "--clip")
      o.clip = std::atof(v);
    else if (flag == "--seed")
      o.seed = std::strtoull(v, nullptr, 10);
    else if (flag == "--print-every")
      o.print_every = std::max<std::int64_t>(1, std::atoll(v));
    else if (flag == "--data")
      o.data = v;
    else {
      std::fprintf(stderr, "train_gpt: unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return o;
}

// WarmupCosineLR with 10% warmup, decaying to 10% of the peak.
double learning_rate(const Options& o, std::int64_t step) {
  const double warmup = std::max<double>(1.0, 0.1 * static_cast<double>(o.steps));
  if (static_cast<double>(step) < warmup) return o.lr * (static_cast<double>(step) + 1) / warmup;
  const double progress = (static_cast<double>(step) - warmup) / std::max(1.0, o.steps - warmup);
  return o.lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(3.141592653589793 * progress)));
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace zero;
  const Options o = parse(argc, argv);

  // Data: the corpus as byte tokens (256 = end of text), 90% train, 10% validation.
  const auto prefix = std::filesystem::temp_directory_path() / "zero_train_gpt_corpus";
  const data::PreparedText text = data::prepare_text_file(o.data, prefix, 0.1);
  auto train_tokens = std::make_shared<const data::TokenFile>(
      data::TokenFile::open(prefix.string() + "_train.bin"));
  auto val_tokens =
      std::make_shared<const data::TokenFile>(data::TokenFile::open(prefix.string() + "_val.bin"));
  data::LoaderConfig lc;
  lc.global_batch = o.batch;
  lc.seq_len = o.seq;
  lc.shuffle = true;
  lc.seed = o.seed;
  lc.vocab_size = 257;
  data::DataLoader train(train_tokens, lc);
  lc.shuffle = false;
  data::DataLoader val(val_tokens, lc);

  nn::GPTConfig cfg;
  cfg.vocab_size = 257;
  cfg.max_seq_len = o.seq;
  cfg.num_layers = o.layers;
  cfg.num_heads = o.heads;
  cfg.channels = o.channels;
  nn::GPT<float> model(cfg);
  nn::LocalParameters<nn::GPT<float>> params(model, o.seed);
  std::vector<optim::AdamW> optimizers;
  for (int u = 0; u < model.num_units(); ++u) {
    optim::AdamHyper h;
    h.lr = o.lr;
    h.beta2 = 0.95;
    h.weight_decay = 0.0;
    optimizers.emplace_back(static_cast<std::size_t>(params.unit_values(u).numel()), h);
  }
  Arena<> arena(std::size_t{512} << 20, "activations");
  std::printf(
      "train_gpt: %lld parameters (L=%lld, H=%lld, C=%lld, V=257, T=%lld), %zu train / "
      "%zu val tokens, batch %lld, %lld steps, single process\n",
      static_cast<long long>(params.num_parameters()), static_cast<long long>(o.layers),
      static_cast<long long>(o.heads), static_cast<long long>(o.channels),
      static_cast<long long>(o.seq), text.train.size(), text.val.size(),
      static_cast<long long>(o.batch), static_cast<long long>(o.steps));

  auto run = [&](const data::Batch& b, bool training) {
    nn::StepContext<float> ctx;
    ctx.arena = &arena;
    ctx.tokens = b.inputs.data();
    ctx.targets = b.targets.data();
    ctx.batch = b.rows;
    ctx.seq_len = b.seq_len;
    ctx.training = training;
    const float loss = model.forward(ctx);
    if (training) model.backward(ctx);
    arena.reset();
    return loss;
  };

  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  float first_loss = 0, loss = 0;
  for (std::int64_t step = 0; step < o.steps; ++step) {
    params.zero_grads();
    loss = run(train.next(), true);
    if (step == 0) first_loss = loss;
    // Global gradient norm over every unit, then clip folded into the fused AdamW pass.
    double sum_sq = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      auto g = params.unit_grads(u);
      sum_sq +=
          optim::grad_stats(std::span<const float>(g.data(), static_cast<std::size_t>(g.numel())))
              .sum_sq;
    }
    const double norm = std::sqrt(sum_sq);
    const double lr = learning_rate(o, step);
    const float clip = static_cast<float>(optim::clip_coefficient(norm, o.clip));
    for (int u = 0; u < model.num_units(); ++u) {
      auto v = params.unit_values(u);
      auto g = params.unit_grads(u);
      auto io = optim::FusedIo::over(
          std::span<float>(v.data(), static_cast<std::size_t>(v.numel())),
          std::span<const float>(g.data(), static_cast<std::size_t>(g.numel())));
      io.grad_scale = clip;
      optimizers[static_cast<std::size_t>(u)].set_lr(lr);
      optimizers[static_cast<std::size_t>(u)].step(io);
    }
    if ((step + 1) % o.print_every == 0 || step + 1 == o.steps) {
      const auto now = std::chrono::steady_clock::now();
      const double seconds = std::chrono::duration<double>(now - last).count();
      const std::int64_t steps_done =
          (step + 1) % o.print_every == 0 ? o.print_every : (step + 1) % o.print_every;
      last = now;
      std::printf(
          "step %4lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tokens/s | %.1f ms/step\n",
          static_cast<long long>(step + 1), static_cast<double>(loss), lr, norm,
          static_cast<double>(steps_done * o.batch * o.seq) / seconds,
          1e3 * seconds / static_cast<double>(steps_done));
      std::fflush(stdout);
    }
  }
  const float val_loss = run(val.next(), false);
  std::printf("loss %.4f -> %.4f (uniform over 257 tokens: %.4f); validation loss %.4f\n",
              static_cast<double>(first_loss), static_cast<double>(loss), std::log(257.0),
              static_cast<double>(val_loss));

  // A short sample: greedy decoding from the start of the validation text.
  std::vector<std::int32_t> context(
      text.val.begin(), text.val.begin() + std::min<std::ptrdiff_t>(
                                               16, static_cast<std::ptrdiff_t>(text.val.size())));
  const std::size_t prompt = context.size();
  while (context.size() < static_cast<std::size_t>(o.seq)) {
    nn::StepContext<float> ctx;
    ctx.arena = &arena;
    ctx.tokens = context.data();
    ctx.batch = 1;
    ctx.seq_len = static_cast<std::int64_t>(context.size());
    ctx.training = false;
    model.forward(ctx);
    const auto logits = model.logits();
    const float* last_row = logits.data() + (ctx.seq_len - 1) * 257;
    context.push_back(
        static_cast<std::int32_t>(std::max_element(last_row, last_row + 256) - last_row));
    arena.reset();
  }
  std::string sample =
      data::ByteTokenizer::decode(std::span<const std::int32_t>(context).subspan(1));
  std::replace(sample.begin(), sample.end(), '\n', ' ');
  std::printf("sample (prompt of %zu bytes, then greedy): %s\n", prompt - 1, sample.c_str());
  return loss < first_loss ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_gpt: %s\n", e.what());
  return 1;
}
