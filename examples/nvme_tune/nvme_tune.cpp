// nvme_tune: what "aio" settings get the most out of the drive behind a path. For each block
// size and queue depth it writes and then reads a file with O_DIRECT through zero's file-I/O
// engine (io_uring, or pread/pwrite when built without liburing), prints GB/s, and ends with
// the config fragment of the best combination: the harmonic mean of the read and write figures,
// since the optimizer pass reads and writes every byte. The fragment's intra_op_parallelism is
// the thread count the measurement used (the pread/pwrite engine runs min(depth, 8) threads;
// io_uring one).
//
//   ./nvme_tune [--path DIR] [--mib 256] [--blocks 131072,262144,1048576,4194304]
//               [--depths 1,4,8,16,32]
//
// DIR defaults to /var/tmp; point it at the drive you will give as offload_*.nvme_path.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <zero/offload/aligned_buffer.hpp>
#include <zero/offload/direct_io.hpp>
#include <zero/offload/make_file_io.hpp>
#include <zero/offload/preflight.hpp>

#include "../cli_number.hpp"

using namespace zero::offload;

namespace {

// A comma-separated list of whole numbers in [min, max], at least one (ConfigError naming flag).
std::vector<long long> parse_list(const std::string& flag, const std::string& text, long long min,
                                  long long max) {
  std::vector<long long> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    out.push_back(zero::examples::parse_integer(flag, item, min, max));
  }
  zero::expect<zero::ConfigError>(!out.empty(), flag, " needs at least one value");
  return out;
}

// Removes the scratch file however the sweep ends.
struct RemoveOnExit {
  std::filesystem::path path;
  ~RemoveOnExit() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

double seconds(const auto& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path dir = "/var/tmp";
  long long mib = 256;
  std::vector<long long> blocks = {131072, 262144, 1048576, 4194304};
  std::vector<long long> depths = {1, 4, 8, 16, 32};
  try {
    for (int i = 1; i < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag != "--path" && flag != "--mib" && flag != "--blocks" && flag != "--depths") {
        std::fprintf(stderr, "unknown flag %s (see the top of nvme_tune.cpp)\n", flag.c_str());
        return 2;
      }
      if (i + 1 >= argc) {
        std::fprintf(stderr, "nvme_tune: %s needs a value\n", flag.c_str());
        return 2;
      }
      const std::string v = argv[i + 1];
      if (flag == "--path")
        dir = v;
      else if (flag == "--mib")
        mib = zero::examples::parse_integer(flag, v, 1, 1 << 20);
      else if (flag == "--blocks")  // what aio.block_size takes
        blocks = parse_list(flag, v, 512, 1LL << 30);
      else
        depths = parse_list(flag, v, 1, 1024);
    }
    for (long long block : blocks) {
      zero::expect<zero::ConfigError>(block % 512 == 0, "--blocks: ", block,
                                      " is not a multiple of 512 bytes");
    }
    NvmeConfig cfg;
    cfg.nvme_path = dir;
    const std::size_t bytes = static_cast<std::size_t>(mib) << 20;
    const auto report = require_preflight(cfg, {bytes, bytes});
    for (long long block : blocks) {  // what the swapper checks before its first transfer
      zero::expect<zero::ConfigError>(
          static_cast<std::size_t>(block) % report.direct.alignment == 0, "--blocks: ", block,
          " is not a multiple of ", dir.string(), "'s O_DIRECT alignment of ",
          report.direct.alignment, " bytes");
    }
    const auto path = dir / ("zero_nvme_tune." + std::to_string(::getpid()));
    const RemoveOnExit scratch{path};
    auto fd = open_direct(path, true);
    AlignedBuffer buf(bytes, report.direct.alignment);
    std::memset(buf.data(), 7, buf.size());
    // One untimed pass first allocates the file, so the first pair's writes overwrite blocks as
    // every later pair's do, rather than extending the file (which some file systems serialise).
    make_file_io(IoOptions{})
        ->run({IoOp::write, fd.get(), path.string(), 0, buf.data(), buf.size()});
    std::printf("path %s (%s, O_DIRECT alignment %zu), %lld MiB per run\n", dir.c_str(),
                report.direct.fs_type.c_str(), report.direct.alignment, mib);
    std::printf("%10s %6s %10s %10s  engine\n", "block", "depth", "write GB/s", "read GB/s");
    double best_score = -1, best_read = 0, best_write = 0;
    long long best_block = 0, best_depth = 0;
    int best_threads = 1;
    for (long long block : blocks) {
      for (long long depth : depths) {
        IoOptions o;
        o.block_size = static_cast<std::size_t>(block);
        o.queue_depth = static_cast<int>(depth);
        o.thread_count = static_cast<int>(std::min<long long>(depth, 8));  // fallback engine
        auto io = make_file_io(o);
        const double tw = seconds([&] {
          io->run({IoOp::write, fd.get(), path.string(), 0, buf.data(), buf.size()});
        });
        const double tr = seconds([&] {
          io->run({IoOp::read, fd.get(), path.string(), 0, buf.data(), buf.size()});
        });
        const double w = static_cast<double>(bytes) / tw / 1e9;
        const double r = static_cast<double>(bytes) / tr / 1e9;
        std::printf("%10lld %6lld %10.2f %10.2f  %s\n", block, depth, w, r, io->name().c_str());
        // io_uring keeps one thread (its ring); the pread/pwrite engine ran thread_count.
        const int threads = io->name() == "io_uring" ? 1 : o.thread_count;
        // Harmonic mean: a pass both reads and writes every byte.
        const double score = 2.0 / (1.0 / r + 1.0 / w);
        if (score > best_score) {
          best_score = score;
          best_block = block;
          best_depth = depth;
          best_read = r;
          best_write = w;
          best_threads = threads;
        }
      }
    }
    fd.reset();
    std::printf("best: block %lld, depth %lld: read %.2f GB/s, write %.2f GB/s\n", best_block,
                best_depth, best_read, best_write);
    std::printf(
        "\"aio\": {\"block_size\": %lld, \"queue_depth\": %lld, \"intra_op_parallelism\": %d, "
        "\"single_submit\": false, \"overlap_events\": true}\n",
        best_block, best_depth, best_threads);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nvme_tune: %s\n", e.what());
    return 1;
  }
  return 0;
}
