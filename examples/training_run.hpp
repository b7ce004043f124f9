#pragma once
// What the training examples (train_gpt, train_llama) share: their data (a text's bytes or token
// files) and loaders, a loader batch as the engine's micro-batch, the checkpoint and --metrics
// files, the step line, the DeepSpeed config their flags write into, and where the ranks come
// from (threads of one process, or one process a rank under mpiexec; on the host or, compiled by
// nvcc, on the GPU). Their flags and the walk over argv are run_flags.hpp.
//
// Compiled by nvcc (an example's *_cuda.cu, which includes cuda_backend.cuh first), run_ranks<Cuda>
// runs the ranks as threads sharing one GPU over CudaLocalComm, or one process a GPU over NcclComm
// under mpiexec; device_peak_tflops reads the GPU's datasheet peak.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <parallel/comm/local_comm.hpp>
#include <parallel/launch_env.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/tensor_parallel/regions.hpp>
#if defined(ZERO_WITH_MPI)
#include <parallel/comm/mpi_comm.hpp>
#endif
#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include <parallel/comm/cuda_local_comm.cuh>
#include <zero/core/cuda_check.cuh>
#if defined(ZERO_WITH_NCCL) && defined(ZERO_WITH_MPI)
#include <parallel/comm/nccl_comm.cuh>
#endif
#endif
#include <zero/config/auto_values.hpp>
#include <zero/config/config.hpp>
#include <zero/core/device.hpp>
#include <zero/core/error.hpp>
#include <zero/data/byte_tokenizer.hpp>
#include <zero/data/data_loader.hpp>
#include <zero/data/prepare_text.hpp>
#include <zero/data/token_file.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/nn/sampler.hpp>
#include <zero/profile/mfu.hpp>

#include "cli_number.hpp"
#include "run_flags.hpp"

namespace zero::examples {

/// The training and validation tokens of a run.
struct Corpus {
  std::shared_ptr<const data::TokenFile> train, val;
  bool val_held_out = true;  ///< false: val is the training file (--tokens without --val-tokens)
  std::vector<std::int32_t> prompt;  ///< the start of the validation text, for a sample
  std::int64_t vocab = 257;          ///< the tokens' vocabulary
};

/// Token files (tokens, and val_tokens when given, else the training rows again), whose
/// vocabulary is token_vocab; or, with tokens empty, the text file at text as byte tokens (256 =
/// end of text, vocabulary 257), 90% train and 10% validation, held in memory under names that
/// say which split of the text a loader's message is about.
inline Corpus load_corpus(const std::string& text_file, const std::string& tokens,
                          const std::string& val_tokens, data::TokenFormat format,
                          std::int64_t token_vocab) {
  Corpus c;
  if (!tokens.empty()) {
    c.train = std::make_shared<const data::TokenFile>(data::TokenFile::open(tokens, format));
    c.val_held_out = !val_tokens.empty();
    c.val = c.val_held_out
                ? std::make_shared<const data::TokenFile>(data::TokenFile::open(val_tokens, format))
                : c.train;
    c.vocab = token_vocab;
    return c;
  }
  data::PreparedText text = data::tokenize_text_file(text_file, 0.1);
  c.prompt.assign(text.val.begin(),
                  text.val.begin() +
                      std::min<std::ptrdiff_t>(16, static_cast<std::ptrdiff_t>(text.val.size())));
  c.train = std::make_shared<const data::TokenFile>(
      data::TokenFile::from_tokens(std::move(text.train), text_file + " (its 90% training split)"));
  c.val = std::make_shared<const data::TokenFile>(
      data::TokenFile::from_tokens(std::move(text.val), text_file + " (its 10% validation split)"));
  return c;
}

/// The loader of one data-parallel rank (dp_rank of dp): training reads whole steps, shuffled;
/// validation one micro-batch a rank, all the evaluation reads, so a small validation split
/// need not hold a global batch.
inline data::LoaderConfig loader_config(const Config::BatchSizes& sizes, std::int64_t seq, int dp,
                                        int dp_rank, bool training, std::uint64_t seed,
                                        std::int64_t vocab) {
  data::LoaderConfig lc;
  lc.global_batch = training ? sizes.train : sizes.micro * dp;
  lc.seq_len = seq;
  lc.world_size = dp;
  lc.rank = dp_rank;
  lc.micro_batches = training ? static_cast<int>(sizes.accumulation) : 1;
  lc.shuffle = training;
  lc.seed = seed;
  lc.vocab_size = vocab;
  return lc;
}

/// A loader batch as the engine's micro-batch (views: the batch must outlive its use), with its
/// rows' place in the step's global batch, so dropout masks follow the rows.
inline engine::MicroBatch micro_of(const data::Batch& b) {
  engine::MicroBatch micro{b.inputs.data(), b.targets.data(), b.rows, b.seq_len};
  micro.first_row = b.first_row;
  return micro;
}

/// A loader batch as this rank feeds it: the whole batch, or with Ulysses sequence parallelism
/// this rank's positions of it (the slice lives as long as the micro-step reads it).
struct RankBatch {
  const data::Batch& batch;
  std::optional<parallel::SequenceSlice> slice;

  RankBatch(const data::Batch& b, const parallel::SequenceParallel& sp) : batch(b) {
    if (sp.active()) slice.emplace(b.inputs.data(), b.targets.data(), b.rows, b.seq_len, sp);
  }
  engine::MicroBatch micro() const {
    if (!slice) return micro_of(batch);
    engine::MicroBatch micro{slice->tokens.data(), slice->targets.data(), slice->batch,
                             slice->seq_len};
    micro.first_row = batch.first_row;  // the same rows, this rank's positions of them
    return micro;
  }
};

/// v averaged over eng's data-parallel group (through the engine, whose communicator may move
/// device memory only).
template <class Eng>
double mean_over_dp(Eng& eng, double v) {
  if constexpr (requires(std::span<double> s) { eng.sum_over_data_parallel(s); }) {
    eng.sum_over_data_parallel(std::span<double>(&v, 1));
    return v / eng.world_size();
  } else {
    eng.comm().all_reduce(std::span<double>(&v, 1), parallel::ReduceOp::avg);
    return v;
  }
}

/// Where a run saves its checkpoints and what it resumes from (--save-dir, --save-every,
/// --resume latest|<tag>), for program's messages.
struct Checkpoints {
  std::string program;
  std::string save_dir, resume;
  std::int64_t save_every = 0;
  std::int64_t last_step = 0;  ///< the run's last step (always saved when save_every > 0)

  /// Loads `resume` into eng and the loader's position; the step to start from (0 without).
  template <class Eng>
  std::int64_t resume_into(Eng& eng, data::DataLoader& loader, bool leader) const {
    if (resume.empty()) return 0;
    const auto client = eng.load_checkpoint(save_dir, resume == "latest" ? "" : resume);
    const auto first_step = client.at("next_step").template get<std::int64_t>();
    loader.restore(data::LoaderState::from_json(client.at("loader")));
    if (leader) {
      std::printf("%s: resumed from %s/%s at step %lld\n", program.c_str(), save_dir.c_str(),
                  resume.c_str(), static_cast<long long>(first_step));
    }
    return first_step;
  }

  /// Saves a checkpoint after `done` steps when save_every says so (and after the last step).
  template <class Eng>
  void save_if_due(Eng& eng, const data::DataLoader& loader, std::int64_t done, bool leader) const {
    if (save_every <= 0 || (done % save_every != 0 && done != last_step)) return;
    const auto saved =
        eng.save_checkpoint(save_dir, "step" + std::to_string(done),
                            {{"next_step", done}, {"loader", loader.state().to_json()}});
    if (leader) {
      std::printf("%s: saved %s (%.1f MB)\n", program.c_str(), saved.path.string().c_str(),
                  static_cast<double>(saved.total_bytes) / 1e6);
    }
  }
};

/// The --metrics file (appended to) on the leader, or none: ConfigError when it cannot be
/// opened, rather than a run that writes nothing.
inline std::ofstream open_metrics(const std::string& path, bool leader) {
  std::ofstream metrics;
  if (leader && !path.empty()) {
    metrics.open(path, std::ios::app);
    expect<ConfigError>(metrics.is_open(), "--metrics ", path, ": cannot open it to append (",
                        std::strerror(errno), ")");
  }
  return metrics;
}

/// The --metrics line of a printed step: the figures every run has, and the Monitor's wall-clock
/// and memory breakdowns when they were due (observed, end_step's JSON); the caller adds its own.
template <class Eng>
nlohmann::json metrics_line(const Eng& eng, std::int64_t step, double loss, double tokens_per_s,
                            double ms, const nlohmann::json& observed) {
  nlohmann::json line = {{"step", step},
                         {"loss", loss},
                         {"lr", eng.lr()},
                         {"grad_norm", eng.last_grad_norm()},
                         {"loss_scale", eng.loss_scale()},
                         {"tokens_per_s", tokens_per_s},
                         {"ms_per_step", ms},
                         {"model_state_bytes", eng.memory_report().total()},
                         {"skipped", eng.last_step_skipped()}};
  for (const char* key : {"wall_clock", "memory", "wall_clock_stages", "memory_stages"}) {
    if (observed.contains(key)) line[key] = observed[key];
  }
  return line;
}

/// Tokens/s and ms a step over the steps since the last lap.
struct Throughput {
  double tokens_per_s = 0, ms_per_step = 0;
};

/// The time between printed step lines.
class StepClock {
 public:
  /// The throughput of `steps` steps of tokens_per_step tokens since the last lap (or since
  /// the clock was made), and starts the next lap.
  Throughput lap(std::int64_t steps, std::int64_t tokens_per_step) {
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return {static_cast<double>(steps * tokens_per_step) / seconds,
            1e3 * seconds / static_cast<double>(std::max<std::int64_t>(steps, 1))};
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_ = Clock::now();
};

/// The step lines of a data-parallel training loop (rank 0 prints): every print_every steps
/// and after the last, "step N | loss | lr | grad norm | scale | tokens/s | TFLOP/s [| MFU] |
/// ms/step | state MB" and what the caller adds, with a --metrics line; between them, on a
/// terminal, a progress bar.
class StepLines {
 public:
  /// tokens_per_step counts every rank's tokens; flops_per_token is the model's (6N + 6LCT);
  /// peak_tflops the GPUs' datasheet peak (0: no MFU).
  StepLines(bool leader, std::int64_t steps, std::int64_t print_every, std::int64_t tokens_per_step,
            double flops_per_token, double peak_tflops, std::ofstream& metrics)
      : leader_(leader),
        tty_(leader && ::isatty(STDOUT_FILENO)),
        steps_(steps),
        print_every_(std::max<std::int64_t>(print_every, 1)),
        tokens_per_step_(tokens_per_step),
        flops_per_token_(flops_per_token),
        peak_tflops_(peak_tflops),
        metrics_(metrics) {}

  /// After step `done` (1-based) with its loss: prints when due. extra is appended to the line
  /// (" | aux ..."); extend(json&) adds to its metrics line; observed is the Monitor's end_step.
  template <class Eng, class Extend>
  void after_step(const Eng& eng, std::int64_t done, double loss, const std::string& extra,
                  const nlohmann::json& observed, Extend&& extend) {
    ++since_print_;
    const bool print = done % print_every_ == 0 || done == steps_;
    if (tty_ && !print) {
      const int width = 30;
      const auto filled = static_cast<int>(width * done / std::max<std::int64_t>(steps_, 1));
      std::printf("\r[%.*s%*s] %lld/%lld loss %.4f", filled, "##############################",
                  width - filled, "", static_cast<long long>(done), static_cast<long long>(steps_),
                  loss);
      std::fflush(stdout);
    }
    if (!print) return;
    const Throughput t = clock_.lap(since_print_, tokens_per_step_);
    since_print_ = 0;
    const double state_mb = static_cast<double>(eng.memory_report().total()) / 1e6;
    const double model_tflops = flops_per_token_ * t.tokens_per_s / 1e12;
    char mfu[32] = "";
    if (peak_tflops_ > 0) {
      std::snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100.0 * model_tflops / peak_tflops_);
    }
    if (!leader_) return;
    std::printf(
        "%sstep %4lld | loss %.4f | lr %.2e | grad norm %.3f | scale %g | %.0f tokens/s"
        " | %.3g TFLOP/s%s | %.1f ms/step | state %.2f MB%s%s\n",
        tty_ ? "\r" : "", static_cast<long long>(done), loss, eng.lr(), eng.last_grad_norm(),
        eng.loss_scale(), t.tokens_per_s, model_tflops, mfu, t.ms_per_step, state_mb, extra.c_str(),
        eng.last_step_skipped() ? " | skipped" : "");
    std::fflush(stdout);
    if (!metrics_.is_open()) return;
    nlohmann::json line = metrics_line(eng, done, loss, t.tokens_per_s, t.ms_per_step, observed);
    line["model_tflops"] = model_tflops;
    line["activation_peak_bytes"] = eng.activation_peak_bytes();
    if (peak_tflops_ > 0) line["mfu"] = model_tflops / peak_tflops_;
    extend(line);
    metrics_ << line.dump() << "\n" << std::flush;
  }

 private:
  bool leader_, tty_;
  std::int64_t steps_, print_every_, tokens_per_step_;
  double flops_per_token_, peak_tflops_;
  std::ofstream& metrics_;
  StepClock clock_;
  std::int64_t since_print_ = 0;
};

/// The closing line: the loss at the first and last step beside the uniform guess over vocab
/// tokens, and the validation loss, or, with no held-out tokens, the loss on the first training
/// rows (which training has seen, so it is no validation figure).
inline void print_losses(double first_loss, double loss, std::int64_t vocab, bool val_held_out,
                         double val_loss) {
  std::printf("loss %.4f -> %.4f (uniform over %lld tokens: %.4f); %s %.4f\n", first_loss, loss,
              static_cast<long long>(vocab), std::log(static_cast<double>(vocab)),
              val_held_out ? "validation loss" : "loss on training rows (no --val-tokens)",
              val_loss);
}

/// The tokens a sample draws from: the byte vocabulary without end-of-text (a sample is drawn
/// only from a text's bytes: a --tokens corpus has no prompt).
inline std::int64_t sample_vocab(const Corpus& corpus) {
  return std::min<std::int64_t>(corpus.vocab, 256);
}

/// Row `row` of the logits of model's last forward, its first `count` columns as floats. The
/// model's logits() are [rows, V / tp] (with tensor parallelism each rank holds its columns:
/// they are gathered). On a device (no tensor parallelism there) the row is copied out of device
/// memory.
template <bool OnDevice, class Model>
std::vector<float> last_row_logits(const Model& model, std::int64_t row, std::int64_t count) {
  using Elem = typename Model::value_type;
  const auto logits = model.logits();
  const std::int64_t local_vocab = logits.dim(1);
  const auto tp = static_cast<std::int64_t>(model.tensor_parallel().size());
  expect<ShapeError>(row >= 0 && row < logits.dim(0) && count <= local_vocab * tp,
                     "last_row_logits: row ", row, " and ", count, " columns of logits ",
                     logits.shape(), " over ", tp, " tensor-parallel ranks");
  std::vector<Elem> whole(static_cast<std::size_t>(local_vocab * tp));
  if constexpr (OnDevice) {
#if defined(__CUDACC__)
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());  // the forward ran on the engine's own stream
    ZERO_CUDA_CHECK(cudaMemcpy(whole.data(), logits.data() + row * local_vocab,
                               whole.size() * sizeof(Elem), cudaMemcpyDeviceToHost));
#else
    static_assert(!OnDevice, "device logits are read by a program compiled by nvcc");
#endif
  } else {
    parallel::region_forward(parallel::Region::gather_from_tp, model.tensor_parallel(),
                             logits.data() + row * local_vocab, whole.data(), 1, local_vocab);
  }
  std::vector<float> out(static_cast<std::size_t>(count));
  for (std::size_t v = 0; v < out.size(); ++v) out[v] = static_cast<float>(whole[v]);
  return out;
}

/// The closing sample: continues the start of the validation text (corpus.prompt) by
/// --sample-bytes bytes, each from next(window, row, sampler), which runs the model on the window
/// and returns the byte drawn from the logits of its last real row. The window slides once the
/// context fills --seq; with sequence parallelism (split = tp) it is padded on the right to a
/// multiple of tp (attention is causal, so the last real row does not see the padding). Rank 0
/// prints; bytes outside printable ASCII print escaped. Nothing without a prompt.
template <class Next>
void print_sample(const RunFlags& o, const Corpus& corpus, bool leader, std::int64_t split,
                  Next&& next) {
  if (corpus.prompt.empty() || o.sample_bytes <= 0) return;
  std::vector<std::int32_t> context = corpus.prompt;
  const std::size_t prompt = context.size();
  nn::Sampler sampler(o.temperature, o.top_k, o.seed);
  for (std::int64_t i = 0; i < o.sample_bytes; ++i) {
    const auto T = std::min<std::int64_t>(static_cast<std::int64_t>(context.size()), o.seq);
    const std::int64_t padded = (T + split - 1) / split * split;
    std::vector<std::int32_t> window(context.end() - T, context.end());
    window.resize(static_cast<std::size_t>(padded), window.back());
    context.push_back(next(engine::MicroBatch{window.data(), nullptr, 1, padded}, T - 1, sampler));
  }
  if (leader) {
    const auto ids = std::span<const std::int32_t>(context);
    std::printf(
        "sample (temperature %g, top-k %d, seed %llu):\n  prompt: %s\n  output: %s\n",
        o.temperature, o.top_k, static_cast<unsigned long long>(o.seed),
        data::ByteTokenizer::escape(data::ByteTokenizer::decode(ids.subspan(1, prompt - 1)))
            .c_str(),
        data::ByteTokenizer::escape(data::ByteTokenizer::decode(ids.subspan(prompt))).c_str());
  }
}

/// The datasheet bf16 peak of the GPU the CUDA runtime uses now, in TFLOP/s (0: not listed, or
/// not compiled by nvcc).
inline double device_peak_tflops() {
#if defined(__CUDACC__)
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return 0.0;
  }
  return profile::datasheet_bf16_tflops(prop.name);
#else
  return 0.0;
#endif
}

/// The GPUs the ranks of comm compute on, for MFU: CudaLocalComm runs its ranks as threads on
/// one GPU; NcclComm, the other device communicator, has one GPU a rank.
template <class Comm>
int gpus_of(const Comm& comm) {
  if constexpr (requires { Comm::comm_name; }) {
    if (std::string_view(Comm::comm_name) == "CudaLocalComm") return 1;
  }
  return comm.size();
}

/// Started by mpirun or mpiexec, or as one of several srun tasks (parallel::launched_by_mpi); a
/// lone srun task, or a batch script running the program directly (no step: launch_env finds
/// nothing), keeps the threads.
inline bool launched_by_mpi() {
  return parallel::launched_by_mpi(parallel::launch_env());
}

#if defined(ZERO_WITH_MPI)
/// fn(), and on an exception from it with other ranks running, the message and MPI_Abort: the
/// other ranks may be inside a collective this rank will never join (NCCL's wait for a peer has
/// no deadline while it connects), and MPI_Finalize, which the unwinding would run, can wait for
/// them too. One rank alone rethrows, so main reports it as on the host.
template <class Fn>
bool abort_others_on_error(parallel::MpiComm& world, const char* program, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    if (world.size() <= 1) throw;
    std::fprintf(stderr, "%s: rank %d: %s\n", program, world.rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(world.native_handle(), 1);
    throw;  // not reached: MPI_Abort ends the job
  }
}
#endif

/// Runs fn(comm) on `ranks` threads of this process over the communicator Threads (LocalComm, or
/// CudaLocalComm sharing one GPU); rank 0's result.
template <class Threads, class Fn>
bool run_threads(int ranks, const parallel::CommOptions& options, Fn& fn) {
  bool result = true;
  Threads::run(
      ranks,
      [&](Threads& comm) {
        const bool ok = fn(comm);
        if (comm.rank() == 0) result = ok;
      },
      options);
  return result;
}

/// Runs fn(comm) -> bool on every rank and returns rank 0's result: under mpiexec one process a
/// rank (MpiComm on the host; on the GPU, Device = Cuda, NcclComm, each process on the GPU of its
/// index among its node's ranks), else `ranks` threads of this process (LocalComm, or
/// CudaLocalComm sharing one GPU). fn is a generic callable: it meets each communicator type.
template <class Device, class Fn>
bool run_ranks(int& argc, char**& argv, int ranks, double timeout_s, const char* program, Fn&& fn) {
  const parallel::CommOptions options{timeout_s};
  if constexpr (std::is_same_v<Device, Host>) {
    if (launched_by_mpi()) {
#if defined(ZERO_WITH_MPI)
      auto world = parallel::MpiComm::world(argc, argv, options);
      return abort_others_on_error(world, program, [&] { return fn(world); });
#else
      throw ConfigError(std::string(program) +
                        " runs under mpiexec but was built without MPI (ZERO_WITH_MPI)");
#endif
    }
    return run_threads<parallel::LocalComm>(ranks, options, fn);
  } else {
#if defined(__CUDACC__)
    int devices = 0;
    const cudaError_t found = cudaGetDeviceCount(&devices);
    expect<CudaError>(
        found == cudaSuccess && devices > 0, "no CUDA device is visible (cudaGetDeviceCount: ",
        found == cudaSuccess ? "0 devices" : cudaGetErrorString(found), "); ", program,
        " needs an NVIDIA GPU and a working driver (check nvidia-smi and "
        "CUDA_VISIBLE_DEVICES); the build without _cuda trains on the host");
    if (launched_by_mpi()) {
#if defined(ZERO_WITH_NCCL) && defined(ZERO_WITH_MPI)
      auto world = parallel::MpiComm::world(argc, argv, options);
      return abort_others_on_error(world, program, [&] {
        parallel::NcclComm nccl(world);
        return fn(nccl);
      });
#else
      throw ConfigError(std::string(program) +
                        " runs under mpiexec, one process per GPU over NCCL, but was built without "
                        "NCCL or MPI (ZERO_WITH_NCCL, ZERO_WITH_MPI); without mpiexec its --ranks "
                        "ranks share one GPU");
#endif
    }
    return run_threads<parallel::CudaLocalComm>(ranks, options, fn);
#else
    static_assert(std::is_same_v<Device, Host>, "run_ranks on a device needs nvcc");
#endif
  }
}

}  // namespace zero::examples

namespace zero::examples {

/// The built-in DeepSpeed config, what a user would write for a small run: AdamW (betas 0.9,
/// 0.95, no weight decay), WarmupCosineLR over the run (warmup a tenth of it), clipping 1.0,
/// ZeRO `stage` unless the flag gives one.
inline nlohmann::json builtin_config(const ConfigFlags& f, int stage) {
  nlohmann::json j = {
      {"train_batch_size", f.batch},
      {"gradient_clipping", 1.0},
      {"steps_per_print", f.print_every.value_or(10)},
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", f.lr.value_or(1e-3)}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.0}}}}},
      {"scheduler",
       {{"type", "WarmupCosineLR"},
        {"params",
         {{"total_num_steps", std::max<std::int64_t>(f.steps, 1)},
          {"warmup_num_steps", f.warmup.value_or(std::max<std::int64_t>(1, f.steps / 10))},
          {"cos_min_ratio", 0.1}}}}},
      {"zero_optimization", {{"stage", f.stage.value_or(stage)}}}};
  if (f.precision == "bf16") j["bf16"] = {{"enabled", true}};
  if (f.grad_accum > 1) j["gradient_accumulation_steps"] = f.grad_accum;
  return j;
}

/// The JSON of the DeepSpeed config file `file` (ConfigError naming it when it cannot be read or
/// is not JSON).
inline nlohmann::json read_config_json(const std::string& file) {
  std::ifstream in(file);
  if (!in.good()) throw ConfigError("config: cannot open '" + file + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(file + ": invalid JSON: " + e.what());
  }
}

/// Writes the flags into the JSON object j of the config file `file`, so the notices about keys
/// without effect describe the config that runs: --stage, --print-every, and --lr, --warmup and
/// --precision, which set the file's keys whether it gives them or leaves them to their defaults
/// (a file without optimizer.params.lr trained at 1e-3 under --lr 3e-4), but not where it says
/// "auto" (fill_auto gives those the flag's value); a file without the section a flag belongs to
/// is a ConfigError, not a flag without effect.
inline void override_config(nlohmann::json& j, const std::string& file, const ConfigFlags& f) {
  if (f.stage) j["zero_optimization"]["stage"] = *f.stage;
  if (f.print_every) j["steps_per_print"] = *f.print_every;
  const auto is_auto = [&](const char* path) {
    const auto* v = config::json_at(j, path);
    return v != nullptr && v->is_string() && v->get<std::string>() == "auto";
  };
  const auto overrides = [&](const char* path) {
    return config::json_at(j, path) != nullptr && !is_auto(path);
  };
  const std::string scheduler = j.contains("scheduler") && j["scheduler"].is_object() &&
                                        j["scheduler"].contains("type") &&
                                        j["scheduler"]["type"].is_string()
                                    ? config::lowercase(j["scheduler"]["type"].get<std::string>())
                                    : "";
  const bool warms_to_own_peak = scheduler == "warmuplr" || scheduler == "warmupdecaylr";
  const bool has_warmup = warms_to_own_peak || scheduler == "warmupcosinelr";
  if (f.lr) {
    expect<ConfigError>(j.contains("optimizer") && j["optimizer"].is_object(), "--lr: ", file,
                        " has no optimizer section to set it in");
    if (!is_auto("optimizer.params.lr")) j["optimizer"]["params"]["lr"] = *f.lr;
    // WarmupLR and WarmupDecayLR ramp to warmup_max_lr, not to the optimizer's lr.
    if (warms_to_own_peak && !is_auto("scheduler.params.warmup_max_lr")) {
      j["scheduler"]["params"]["warmup_max_lr"] = *f.lr;
    }
  }
  if (f.warmup) {
    expect<ConfigError>(has_warmup, "--warmup: ", file,
                        scheduler.empty()
                            ? std::string(" has no scheduler")
                            : " has scheduler type " + j["scheduler"]["type"].get<std::string>() +
                                  ", which has no warmup_num_steps",
                        " (WarmupLR, WarmupDecayLR and WarmupCosineLR have one)");
    if (!is_auto("scheduler.params.warmup_num_steps")) {
      j["scheduler"]["params"]["warmup_num_steps"] = *f.warmup;
    }
  }
  if (!f.precision.empty()) {  // the flag's precision, whatever the file enables
    const bool bf16 = f.precision == "bf16";
    if (bf16 || overrides("bf16.enabled")) j["bf16"]["enabled"] = bf16;
    if (overrides("bfloat16.enabled")) j["bfloat16"]["enabled"] = bf16;
    if (overrides("fp16.enabled")) j["fp16"]["enabled"] = false;
  }
}

/// Fills the config's "auto" values from the flags and the built-in defaults (as the Hugging
/// Face Trainer does) for dp data-parallel ranks of a model of hidden_size channels; returns what
/// it chose.
inline std::vector<std::string> fill_auto(const ConfigFlags& f, Config& c, std::int64_t hidden_size,
                                          int dp) {
  config::AutoValues v;
  v.train_batch_size = f.batch;
  v.gradient_accumulation = f.grad_accum;
  v.lr = f.lr.value_or(1e-3);
  v.betas = {0.9, 0.95};
  v.weight_decay = 0.0;
  v.gradient_clipping = 1.0;
  v.warmup_steps = f.warmup.value_or(std::max<std::int64_t>(1, f.steps / 10));
  v.total_steps = std::max<std::int64_t>(f.steps, 1);
  v.precision = f.precision == "bf16" ? "bf16" : "fp32";
  v.hidden_size = hidden_size;
  return config::fill_auto(c, v, dp);
}

/// Prints, on rank 0, the config's warnings (to stderr), its notices about keys without effect,
/// and the "auto" values fill_auto chose.
inline void print_config_notes(const char* program, const Config& cfg,
                               const std::vector<std::string>& chosen) {
  for (const auto& w : cfg.warnings) std::fprintf(stderr, "%s: config: %s\n", program, w.c_str());
  for (const auto& n : cfg.notices) std::printf("%s: config: %s\n", program, n.c_str());
  for (const auto& c : chosen) std::printf("%s: config: auto: %s\n", program, c.c_str());
}

}  // namespace zero::examples
