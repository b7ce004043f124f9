// Checkpoint save and load throughput for GPT-2-shaped fp32 master weights plus two Adam states
// (124M parameters by default: ~1.49 GB), sharded ZeRO-style (each rank owns one contiguous
// slice of the flat buffer of every group), with 1 and 2 LocalComm ranks; beside a plain
// sequential write (+ fsync) and read of the same bytes into one file, measured in the same run.
// Reads are cold: every file read is first dropped from the page cache (posix_fadvise
// DONTNEED after fsync), so they measure the disk, not memory. One JSON object per line.
//
// The engine_* rows do the same through a live zero::Engine (GPT of the same shape, AdamW from a
// DeepSpeed config, ZeRO stage 1 on 1 and 2 LocalComm ranks): save_checkpoint, a cold
// load_checkpoint into the same layout, and save_gpt2_weights (the streamed bf16 export of the
// weights from the engine itself). --no-engine skips them.
//
//   ./ckpt_bench [--layers 12] [--hidden 768] [--vocab 50257] [--ranks 1,2] [--dir PATH]
//                [--export-chunk-mib 64] [--no-engine]
// --dir defaults to a fresh directory under the system temp directory (removed at the end).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <parallel/comm/local_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>
#include <zero/config/config.hpp>
#include <zero/engine/engine.hpp>
#include <zero/engine/engine_weights.hpp>
#include <zero/io/file.hpp>
#include <zero/nn/gpt.hpp>

#include "../bench_flags.hpp"
#include "../bench_timing.hpp"

using zero::bench::line;

namespace {

using zero::DType;
using zero::parallel::LocalComm;
namespace ckpt = zero::checkpoint;
using Clock = std::chrono::steady_clock;

struct Options {
  int layers = 12, hidden = 768, vocab = 50257, positions = 1024;
  std::vector<int> ranks{1, 2};
  std::filesystem::path dir;
  std::size_t export_chunk_mib = 64;
  bool engine = true;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// GPT-2's parameters in zero's layout (Linear weights [out, in]; 124M at 12 x 768, vocab 50257).
std::vector<ckpt::TensorSpec> gpt2_specs(const Options& o) {
  const std::int64_t h = o.hidden;
  std::vector<ckpt::TensorSpec> s;
  s.push_back({"transformer.wte.weight", DType::f32, {o.vocab, h}});
  s.push_back({"transformer.wpe.weight", DType::f32, {o.positions, h}});
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    s.push_back({p + "ln_1.weight", DType::f32, {h}});
    s.push_back({p + "ln_1.bias", DType::f32, {h}});
    s.push_back({p + "attn.c_attn.weight", DType::f32, {3 * h, h}});
    s.push_back({p + "attn.c_attn.bias", DType::f32, {3 * h}});
    s.push_back({p + "attn.c_proj.weight", DType::f32, {h, h}});
    s.push_back({p + "attn.c_proj.bias", DType::f32, {h}});
    s.push_back({p + "ln_2.weight", DType::f32, {h}});
    s.push_back({p + "ln_2.bias", DType::f32, {h}});
    s.push_back({p + "mlp.c_fc.weight", DType::f32, {4 * h, h}});
    s.push_back({p + "mlp.c_fc.bias", DType::f32, {4 * h}});
    s.push_back({p + "mlp.c_proj.weight", DType::f32, {h, 4 * h}});
    s.push_back({p + "mlp.c_proj.bias", DType::f32, {h}});
  }
  s.push_back({"transformer.ln_f.weight", DType::f32, {h}});
  s.push_back({"transformer.ln_f.bias", DType::f32, {h}});
  return s;
}

/// Drops a file's cached pages so the next read comes from the disk.
void drop_cache(const std::filesystem::path& path) {
  zero::io::FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return;
  ::fdatasync(fd.get());
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
}

void drop_cache_tree(const std::filesystem::path& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) drop_cache(e.path());
  }
}

/// One rank's shard: its segments of every tensor in the flat (padded) buffer of each group
/// (master, exp_avg, exp_avg_sq), filled with rank-dependent values.
struct Shard {
  std::vector<float> data;  // 3 groups x shard elements
  std::vector<ckpt::Segment> segments;
};

Shard make_shard(const std::vector<ckpt::TensorSpec>& specs, std::int64_t total, int rank,
                 int world) {
  const std::int64_t shard = (total + world - 1) / world;
  const std::int64_t begin = shard * rank, end = std::min(total, begin + shard);
  Shard s;
  s.data.resize(static_cast<std::size_t>(3 * shard));
  for (std::size_t i = 0; i < s.data.size(); ++i) {
    s.data[i] = static_cast<float>(i % 1021) * 0.001f + static_cast<float>(rank);
  }
  const char* suffix[3] = {"", "/exp_avg", "/exp_avg_sq"};
  for (int g = 0; g < 3; ++g) {
    std::int64_t offset = 0;
    for (const auto& t : specs) {
      const std::int64_t lo = std::max(offset, begin), hi = std::min(offset + t.numel(), end);
      if (lo < hi) {
        const float* p = s.data.data() + g * shard + (lo - begin);
        s.segments.push_back(
            ckpt::segment_of(t.name + suffix[g], lo - offset,
                             std::span<const float>(p, static_cast<std::size_t>(hi - lo))));
      }
      offset += t.numel();
    }
  }
  return s;
}

/// The engine_* rows (see the file comment); false when a load does not restore the values.
bool engine_rows(const Options& o) {
  zero::nn::GPTConfig model_config;
  model_config.num_layers = o.layers;
  model_config.channels = o.hidden;
  model_config.num_heads = std::max(1, o.hidden / 64);
  model_config.vocab_size = o.vocab;
  model_config.max_seq_len = o.positions;
  const zero::Config cfg = zero::Config::from_json_string(
      R"({"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
          "zero_optimization": {"stage": 1}})");
  bool equal = true;
  for (int n : o.ranks) {
    const std::string tag = "engine-ranks-" + std::to_string(n);
    double save_s = 0, load_s = 0, export_s = 0, bytes = 0;
    std::uint64_t export_bytes = 0, peak_unit = 0;
    LocalComm::run(n, [&](LocalComm& comm) {
      zero::nn::GPT<float> model(model_config);
      zero::engine::EngineOptions options;
      options.activation_bytes = std::size_t{16} << 20;  // no forward runs here
      zero::engine::Engine<zero::nn::GPT<float>, zero::ZeroStage<1>> eng(model, comm, cfg, options);
      // Rank 0 times each phase between barriers, so a phase ends when its slowest rank does.
      comm.barrier();
      auto t0 = Clock::now();
      const auto saved = eng.save_checkpoint(o.dir, tag, {{"step", 1}});
      comm.barrier();
      if (comm.rank() == 0) {
        save_s = seconds_since(t0);
        bytes = static_cast<double>(saved.total_bytes);
        drop_cache_tree(saved.path);
      }
      // The load must bring the values back: zero every master slice first.
      const std::vector<float> before = eng.gather_unit_values(eng.num_units() - 1);
      eng.state().for_each_master(zero::engine::StateAccess::overwrite,
                                  [](int, std::span<float> m) { std::ranges::fill(m, 0.0f); });
      comm.barrier();
      t0 = Clock::now();
      eng.load_checkpoint(o.dir, tag);
      comm.barrier();
      if (comm.rank() == 0) load_s = seconds_since(t0);
      if (eng.gather_unit_values(eng.num_units() - 1) != before && comm.rank() == 0) equal = false;
      comm.barrier();
      t0 = Clock::now();
      const auto exported =
          zero::engine::save_gpt2_weights(eng, o.dir / (tag + ".safetensors"), DType::bf16);
      comm.barrier();
      if (comm.rank() == 0) {
        export_s = seconds_since(t0);
        export_bytes = exported.bytes;
        peak_unit = exported.peak_unit_bytes;
      }
    });
    const std::string config = "\"params\": " + std::to_string(model_config.num_parameters()) +
                               ", \"bytes\": " + std::to_string(static_cast<long long>(bytes)) +
                               ", \"ranks\": " + std::to_string(n) + ", \"stage\": 1";
    line("engine_save", config, bytes / save_s / 1e9, "GB/s", ", \"s\": " + std::to_string(save_s));
    line("engine_load_cold", config, bytes / load_s / 1e9, "GB/s",
         ", \"s\": " + std::to_string(load_s) + ", \"equal\": " + (equal ? "true" : "false"));
    line("engine_export_bf16", config,
         static_cast<double>(model_config.num_parameters()) * 4.0 / export_s / 1e9,
         "GB/s (f32 read)",
         ", \"s\": " + std::to_string(export_s) + ", \"bytes_written\": " +
             std::to_string(export_bytes) + ", \"peak_unit_bytes\": " + std::to_string(peak_unit));
    std::filesystem::remove_all(o.dir / tag);
  }
  return equal;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ckpt_bench: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--layers")
      o.layers = static_cast<int>(
          zero::bench::integer_arg("ckpt_bench", std::string(a), next(), 1, 1 << 20));
    else if (a == "--hidden")
      o.hidden = static_cast<int>(
          zero::bench::integer_arg("ckpt_bench", std::string(a), next(), 1, 1 << 20));
    else if (a == "--vocab")
      o.vocab = static_cast<int>(
          zero::bench::integer_arg("ckpt_bench", std::string(a), next(), 1, 1 << 24));
    else if (a == "--dir")
      o.dir = next();
    else if (a == "--export-chunk-mib")
      o.export_chunk_mib =
          static_cast<std::size_t>(zero::bench::integer_arg("ckpt_bench", std::string(a), next()));
    else if (a == "--no-engine")
      o.engine = false;
    else if (a == "--ranks") {
      o.ranks.clear();
      for (std::string list = next(); !list.empty();) {
        const auto comma = list.find(',');
        o.ranks.push_back(static_cast<int>(zero::bench::integer_arg(
            "ckpt_bench", "--ranks", list.substr(0, comma).c_str(), 1, 4096)));
        list = comma == std::string::npos ? "" : list.substr(comma + 1);
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--layers L] [--hidden H] [--vocab V] [--ranks 1,2] [--dir PATH] "
                   "[--export-chunk-mib N] [--no-engine]\n",
                   argv[0]);
      return 2;
    }
  }
  const bool own_dir = o.dir.empty();
  if (own_dir) {
    o.dir = std::filesystem::temp_directory_path() / ("ckpt_bench-" + std::to_string(::getpid()));
  }
  std::filesystem::create_directories(o.dir);

  // The model's tensors (master) and, per tensor, two Adam states of the same shape.
  std::vector<ckpt::TensorSpec> specs = gpt2_specs(o), all;
  std::int64_t params = 0;
  for (const auto& t : specs) params += t.numel();
  for (const char* suffix : {"", "/exp_avg", "/exp_avg_sq"}) {
    for (const auto& t : specs) all.push_back({t.name + suffix, t.dtype, t.shape});
  }
  const double bytes = 3.0 * static_cast<double>(params) * 4.0;
  const std::string base = "\"params\": " + std::to_string(params) +
                           ", \"bytes\": " + std::to_string(static_cast<long long>(bytes));
  std::printf("# %lld parameters x 3 (master, exp_avg, exp_avg_sq) = %.3f GB in %s\n",
              static_cast<long long>(params), bytes / 1e9, o.dir.c_str());

  // Baseline: the same bytes written sequentially into one file (+ fsync), then read cold.
  {
    std::vector<float> flat(static_cast<std::size_t>(3 * params), 1.5f);
    const auto path = o.dir / "baseline.bin";
    auto t0 = Clock::now();
    {
      zero::io::AtomicFile f(path);
      const std::size_t block = std::size_t{64} << 20;
      const auto* p = reinterpret_cast<const std::byte*>(flat.data());
      const std::size_t total = flat.size() * sizeof(float);
      for (std::size_t done = 0; done < total; done += block) {
        f.write(p + done, std::min(block, total - done));
      }
      f.commit();  // fsync + rename + fsync of the directory
    }
    const double write_s = seconds_since(t0);
    line("ckpt_baseline_write_fsync", base, bytes / write_s / 1e9, "GB/s",
         ", \"s\": " + std::to_string(write_s));
    drop_cache(path);
    t0 = Clock::now();
    {
      const zero::io::ReadFile f(path);
      const std::size_t block = std::size_t{64} << 20;
      auto* p = reinterpret_cast<std::byte*>(flat.data());
      const std::size_t total = flat.size() * sizeof(float);
      for (std::size_t done = 0; done < total; done += block) {
        f.read_at(done, p + done, std::min(block, total - done), "baseline");
      }
    }
    const double read_s = seconds_since(t0);
    line("ckpt_baseline_read_cold", base, bytes / read_s / 1e9, "GB/s",
         ", \"s\": " + std::to_string(read_s));
    std::filesystem::remove(path);

    // CRC32C speed on the same data (the checksum cost inside save and load).
    const std::size_t crc_bytes = std::min<std::size_t>(flat.size() * 4, std::size_t{1} << 30);
    const std::span<const std::byte> view(reinterpret_cast<const std::byte*>(flat.data()),
                                          crc_bytes);
    t0 = Clock::now();
    volatile std::uint32_t sink = ckpt::crc32c(view);
    const double crc_s = seconds_since(t0);
    line("crc32c",
         "\"bytes\": " + std::to_string(crc_bytes) +
             ", \"hardware\": " + (ckpt::crc32c_hardware_available() ? "true" : "false"),
         static_cast<double>(crc_bytes) / crc_s / 1e9, "GB/s");
    t0 = Clock::now();
    sink = ckpt::crc32c_portable(view.first(crc_bytes / 4));
    const double portable_s = seconds_since(t0);
    line("crc32c_portable", "\"bytes\": " + std::to_string(crc_bytes / 4),
         static_cast<double>(crc_bytes / 4) / portable_s / 1e9, "GB/s");
    (void)sink;
  }

  for (int n : o.ranks) {
    const std::string tag = "ranks-" + std::to_string(n);
    const std::string config = base + ", \"ranks\": " + std::to_string(n);
    std::vector<Shard> shards;
    for (int r = 0; r < n; ++r) shards.push_back(make_shard(specs, params, r, n));
    std::vector<double> rank_save_s(static_cast<std::size_t>(n));
    auto t0 = Clock::now();
    LocalComm::run(n, [&](LocalComm& comm) {
      const Shard& s = shards[static_cast<std::size_t>(comm.rank())];
      ckpt::save(comm, o.dir, tag, std::span<const ckpt::TensorSpec>(all),
                 std::span<const ckpt::Segment>(s.segments), {{"step", 1}});
    });
    const double save_s = seconds_since(t0);
    line("ckpt_save", config, bytes / save_s / 1e9, "GB/s", ", \"s\": " + std::to_string(save_s));

    drop_cache_tree(o.dir / tag);
    // Load into fresh buffers with the same sharding (each rank reads its own segments).
    // Destination buffers are allocated and touched first, as an engine's shards would be.
    std::vector<std::vector<float>> loaded(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      loaded[static_cast<std::size_t>(r)].assign(shards[static_cast<std::size_t>(r)].data.size(),
                                                 0.0f);
    }
    auto load_all = [&] {
      LocalComm::run(n, [&](LocalComm& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const ckpt::Reader reader = ckpt::load(comm, o.dir, tag);
        auto& out = loaded[r];
        for (const ckpt::Segment& seg : shards[r].segments) {
          const auto* src = reinterpret_cast<const float*>(seg.data.data());
          float* dst = out.data() + (src - shards[r].data.data());
          reader.read(seg.name, seg.offset,
                      std::span<float>(dst, static_cast<std::size_t>(seg.count())));
        }
      });
    };
    t0 = Clock::now();
    load_all();
    const double load_s = seconds_since(t0);
    bool equal = true;
    for (int r = 0; r < n; ++r) {
      for (const ckpt::Segment& seg : shards[static_cast<std::size_t>(r)].segments) {
        const auto* src = reinterpret_cast<const float*>(seg.data.data());
        const float* got = loaded[static_cast<std::size_t>(r)].data() +
                           (src - shards[static_cast<std::size_t>(r)].data.data());
        equal = equal && std::memcmp(src, got, seg.data.size()) == 0;
      }
    }
    line("ckpt_load_cold", config, bytes / load_s / 1e9, "GB/s",
         ", \"s\": " + std::to_string(load_s) + ", \"equal\": " + (equal ? "true" : "false"));
    if (!equal) return 1;
    // Again, now from the page cache: the CPU cost of a load (open, index, pread copies, CRC).
    t0 = Clock::now();
    load_all();
    const double warm_s = seconds_since(t0);
    line("ckpt_load_warm", config, bytes / warm_s / 1e9, "GB/s",
         ", \"s\": " + std::to_string(warm_s));
  }

  // Resharded load: the last checkpoint read by one more rank than saved it, so shard
  // boundaries cut saved segments and the touched-segment checksums read some bytes twice.
  {
    const int saved = o.ranks.back(), m = saved + 1;
    const std::string tag = "ranks-" + std::to_string(saved);
    std::vector<Shard> layout;
    for (int r = 0; r < m; ++r) layout.push_back(make_shard(specs, params, r, m));
    drop_cache_tree(o.dir / tag);
    std::vector<std::uint64_t> read_bytes(static_cast<std::size_t>(m));
    const auto t0 = Clock::now();
    LocalComm::run(m, [&](LocalComm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      const ckpt::Reader reader = ckpt::load(comm, o.dir, tag);
      for (const ckpt::Segment& seg : layout[r].segments) {
        // Into the rank's own buffer (its layout's data), overwriting the generated values.
        auto* dst = const_cast<float*>(reinterpret_cast<const float*>(seg.data.data()));
        reader.read(seg.name, seg.offset,
                    std::span<float>(dst, static_cast<std::size_t>(seg.count())));
      }
      read_bytes[r] = reader.bytes_read();
    });
    const double s = seconds_since(t0);
    std::uint64_t total_read = 0;
    for (auto b : read_bytes) total_read += b;
    line("ckpt_load_cold_resharded",
         base + ", \"saved_ranks\": " + std::to_string(saved) + ", \"ranks\": " + std::to_string(m),
         bytes / s / 1e9, "GB/s",
         ", \"s\": " + std::to_string(s) + ", \"bytes_read_fraction\": " +
             std::to_string(static_cast<double>(total_read) / bytes));
  }

  // Streamed export of the model weights (master only) to bf16 from the last checkpoint.
  {
    const std::string tag = "ranks-" + std::to_string(o.ranks.back());
    drop_cache_tree(o.dir / tag);
    const ckpt::Reader reader(o.dir, tag);
    std::vector<std::string> names;
    for (const auto& t : specs) names.push_back(t.name);
    const auto out = o.dir / "model.safetensors";
    const auto t0 = Clock::now();
    const auto r =
        ckpt::export_safetensors(reader, names, out, DType::bf16, {}, {o.export_chunk_mib << 20});
    const double s = seconds_since(t0);
    line("ckpt_export_bf16", base + ", \"chunk_mib\": " + std::to_string(o.export_chunk_mib),
         static_cast<double>(params) * 4.0 / s / 1e9, "GB/s (f32 read)",
         ", \"s\": " + std::to_string(s) +
             ", \"bytes_written\": " + std::to_string(r.bytes_written) +
             ", \"peak_buffer_bytes\": " + std::to_string(r.peak_buffer_bytes));
  }
  if (o.engine && !engine_rows(o)) return 1;
  if (own_dir) std::filesystem::remove_all(o.dir);
  return 0;
}
