// train_gpt: trains a small byte-level GPT-2 on the bundled corpus with the ZeRO engine.
//
// By default 2 ranks in one process (LocalComm threads) at ZeRO stage 3: every rank holds only its
// shard of each unit and gathers a unit just before using it. nn::GPT supplies the units,
// optim::AdamW updates each rank's master shards (fused pass), DeepSpeed's WarmupCosineLR shape
// sets the learning rate, and the DataLoader gives rank r its rows of each global batch, so any
// --ranks and --stage train on the same data and (up to rounding) reach the same loss.
//
//   ./train_gpt [--ranks 2] [--stage 3] [--steps 100] [--batch 8] [--seq 64] [--layers 4]
//               [--heads 4] [--channels 128] [--lr 1e-3] [--seed 1234] [--data corpus.txt]
//               [--print-every 10]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <optim/adam.hpp>
#include <parallel/comm/local_comm.hpp>
#include <zero/data/byte_tokenizer.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/prepare_text.hpp>
#include <zero/data/token_file.hpp>
#include <zero/engine/engine.hpp>
#include <zero/nn/gpt.hpp>

namespace {

using namespace zero;

struct Options {
  int ranks = 2, stage = 3;
  std::int64_t steps = 100, batch = 8, seq = 64, layers = 4, heads = 4, channels = 128;
  double lr = 1e-3;
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
    if (flag == "--ranks")
      o.ranks = std::atoi(v);
    else if (flag == "--stage")
      o.stage = std::atoi(v);
    else if (flag == "--steps")
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

using Clock = std::chrono::steady_clock;

struct Corpus {
  data::PreparedText text;
  std::shared_ptr<const data::TokenFile> train, val;
};

// Trains on rank comm.rank() of comm.size(); rank 0 prints.
template <int Stage>
bool train(const Options& o, const Corpus& corpus, parallel::LocalComm& comm) {
  const bool leader = comm.rank() == 0;
  data::LoaderConfig lc;
  lc.global_batch = o.batch;
  lc.seq_len = o.seq;
  lc.world_size = comm.size();
  lc.rank = comm.rank();
  lc.shuffle = true;
  lc.seed = o.seed;
  lc.vocab_size = 257;
  data::DataLoader train_loader(corpus.train, lc);
  lc.shuffle = false;
  data::DataLoader val_loader(corpus.val, lc);

  nn::GPTConfig cfg;
  cfg.vocab_size = 257;
  cfg.max_seq_len = o.seq;
  cfg.num_layers = o.layers;
  cfg.num_heads = o.heads;
  cfg.channels = o.channels;
  nn::GPT<float> model(cfg);

  // One AdamW per unit over whatever this rank updates (its shard; the whole unit at stage 0).
  std::map<int, optim::AdamW> optimizers;
  double lr = o.lr;
  auto update = [&](int unit, std::span<float> param, std::span<const float> grad) {
    auto it = optimizers.find(unit);
    if (it == optimizers.end()) {
      optim::AdamHyper h;
      h.lr = o.lr;
      h.beta2 = 0.95;
      h.weight_decay = 0.0;
      it = optimizers.emplace(unit, optim::AdamW(param.size(), h)).first;
    }
    it->second.set_lr(lr);
    it->second.step(optim::FusedIo::over(param, grad));
  };
  engine::EngineOptions eo;
  eo.seed = o.seed;
  eo.activation_bytes = std::size_t{512} << 20;
  engine::Engine<nn::GPT<float>, ZeroStage<Stage>> eng(model, comm, update, eo);
  if (leader) {
    const auto m = eng.memory_report();
    std::printf(
        "train_gpt: %lld parameters (L=%lld, H=%lld, C=%lld, V=257, T=%lld), ZeRO stage %d "
        "on %d ranks (LocalComm); %zu train / %zu val tokens; global batch %lld, %lld "
        "steps; model state on rank 0: %.2f MB\n",
        static_cast<long long>(cfg.num_parameters()), static_cast<long long>(o.layers),
        static_cast<long long>(o.heads), static_cast<long long>(o.channels),
        static_cast<long long>(o.seq), Stage, comm.size(), corpus.text.train.size(),
        corpus.text.val.size(), static_cast<long long>(o.batch), static_cast<long long>(o.steps),
        static_cast<double>(m.total()) / 1e6);
  }
  auto mean_over_ranks = [&](double v) {
    comm.all_reduce(std::span<double>(&v, 1), parallel::ReduceOp::avg);
    return v;
  };
  auto micro = [](const data::Batch& b) {
    return engine::MicroBatch{b.inputs.data(), b.targets.data(), b.rows, b.seq_len};
  };

  auto last = Clock::now();
  double first_loss = 0, loss = 0;
  for (std::int64_t step = 0; step < o.steps; ++step) {
    lr = learning_rate(o, step);
    const data::Batch batch = train_loader.next();
    loss = mean_over_ranks(eng.forward(micro(batch)));
    eng.backward();
    eng.step();
    if (step == 0) first_loss = loss;
    if ((step + 1) % o.print_every == 0 || step + 1 == o.steps) {
      const auto now = Clock::now();
      const double seconds = std::chrono::duration<double>(now - last).count();
      last = now;
      const std::int64_t done =
          (step + 1) % o.print_every == 0 ? o.print_every : (step + 1) % o.print_every;
      if (leader) {
        std::printf("step %4lld | loss %.4f | lr %.2e | %.0f tokens/s | %.1f ms/step\n",
                    static_cast<long long>(step + 1), loss, lr,
                    static_cast<double>(done * o.batch * o.seq) / seconds,
                    1e3 * seconds / static_cast<double>(done));
        std::fflush(stdout);
      }
    }
  }
  const double val_loss = mean_over_ranks(eng.evaluate(micro(val_loader.next())));
  if (leader) {
    std::printf("loss %.4f -> %.4f (uniform over 257 tokens: %.4f); validation loss %.4f\n",
                first_loss, loss, std::log(257.0), val_loss);
  }

  // A short greedy sample from the start of the validation text (every rank takes part: the
  // stage-3 forward gathers units collectively).
  const auto& val = corpus.text.val;
  std::vector<std::int32_t> context(
      val.begin(),
      val.begin() + std::min<std::ptrdiff_t>(16, static_cast<std::ptrdiff_t>(val.size())));
  const std::size_t prompt = context.size();
  while (context.size() < static_cast<std::size_t>(o.seq)) {
    const auto T = static_cast<std::int64_t>(context.size());
    eng.evaluate(engine::MicroBatch{context.data(), nullptr, 1, T});
    const float* last_row = model.logits().data() + (T - 1) * 257;
    context.push_back(
        static_cast<std::int32_t>(std::max_element(last_row, last_row + 256) - last_row));
  }
  if (leader) {
    std::string sample =
        data::ByteTokenizer::decode(std::span<const std::int32_t>(context).subspan(1));
    std::replace(sample.begin(), sample.end(), '\n', ' ');
    std::printf("sample (prompt of %zu bytes, then greedy): %s\n", prompt - 1, sample.c_str());
  }
  return loss < first_loss;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  expect<ConfigError>(o.ranks >= 1, "--ranks ", o.ranks, " must be >= 1");
  expect<ConfigError>(o.stage >= 0 && o.stage <= 3, "--stage ", o.stage, " must be 0, 1, 2 or 3");

  // Data: the corpus as byte tokens (256 = end of text), 90% train, 10% validation.
  const auto prefix = std::filesystem::temp_directory_path() / "zero_train_gpt_corpus";
  Corpus corpus;
  corpus.text = data::prepare_text_file(o.data, prefix, 0.1);
  corpus.train = std::make_shared<const data::TokenFile>(
      data::TokenFile::open(prefix.string() + "_train.bin"));
  corpus.val =
      std::make_shared<const data::TokenFile>(data::TokenFile::open(prefix.string() + "_val.bin"));

  bool improved = true;
  parallel::LocalComm::run(o.ranks, [&](parallel::LocalComm& comm) {
    bool ok = false;
    switch (o.stage) {
      case 0:
        ok = train<0>(o, corpus, comm);
        break;
      case 1:
        ok = train<1>(o, corpus, comm);
        break;
      case 2:
        ok = train<2>(o, corpus, comm);
        break;
      default:
        ok = train<3>(o, corpus, comm);
        break;
    }
    if (comm.rank() == 0) improved = ok;
  });
  return improved ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_gpt: %s\n", e.what());
  return 1;
}
