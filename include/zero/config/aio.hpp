#pragma once
// The "aio" section of a DeepSpeed config: how NVMe offload issues its file I/O. DeepSpeed
// (csrc/aio, runtime/swap_tensor/constants.py) drives libaio with these knobs; zero drives
// io_uring (or a pread/pwrite fallback) with the same meaning, so a tuned DeepSpeed config keeps
// its numbers.

#include <cstdint>
#include <string>
#include <vector>

#include <zero/config/json_reader.hpp>

namespace zero::config {

/// "aio": request size, requests in flight and submission style of NVMe swap I/O.
struct AioConfig {
  std::int64_t block_size = 1'048'576;  ///< bytes per request (a transfer is split into these)
  std::int64_t queue_depth = 8;         ///< requests in flight per file-I/O engine
  std::int64_t thread_count = 1;        ///< worker threads of the pread/pwrite fallback
  bool single_submit = false;           ///< submit requests one at a time instead of in batches
  bool overlap_events = true;           ///< refill the queue as requests finish, not per batch
  bool use_gds = false;                 ///< GPUDirect Storage: accepted, not supported

  /// Reads the section at r; key paths nobody reads are appended to unknown.
  static AioConfig read(JsonReader r, std::vector<std::string>& unknown) {
    AioConfig c;
    c.block_size = r.integer("block_size").value_or(c.block_size);
    c.queue_depth = r.integer("queue_depth").value_or(c.queue_depth);
    // DeepSpeed renamed thread_count to intra_op_parallelism; both spellings are read (the
    // new one wins), and a bad value is named by the spelling that gave it.
    c.thread_count = r.integer("thread_count").value_or(c.thread_count);
    const auto intra_op = r.integer("intra_op_parallelism");
    c.thread_count = intra_op.value_or(c.thread_count);
    const char* thread_key =
        intra_op || !r.has("thread_count") ? "intra_op_parallelism" : "thread_count";
    c.single_submit = r.boolean("single_submit").value_or(c.single_submit);
    c.overlap_events = r.boolean("overlap_events").value_or(c.overlap_events);
    c.use_gds = r.boolean("use_gds").value_or(c.use_gds);
    expect<ConfigError>(c.block_size >= 512 && c.block_size % 512 == 0, r.where("block_size"), ": ",
                        c.block_size,
                        " must be a positive multiple of 512 bytes (O_DIRECT requests are whole "
                        "logical blocks); DeepSpeed's default is 1048576");
    // Linux moves at most 0x7ffff000 bytes in one request (offload::QueuedFileIo).
    expect<ConfigError>(c.block_size <= (std::int64_t{1} << 30), r.where("block_size"), ": ",
                        c.block_size, " is more than 1 GiB (1073741824), the largest request");
    expect<ConfigError>(c.queue_depth >= 1 && c.queue_depth <= 4096, r.where("queue_depth"), ": ",
                        c.queue_depth, " must be in [1, 4096]; DeepSpeed's default is 8");
    expect<ConfigError>(c.thread_count >= 1 && c.thread_count <= 256, r.where(thread_key), ": ",
                        c.thread_count, " must be in [1, 256]");
    expect<ConfigError>(!c.use_gds, r.where("use_gds"),
                        ": GPUDirect Storage is not supported by zero; set it to false");
    for (const auto& k : r.unknown_keys()) unknown.push_back(k);
    return c;
  }
};

}  // namespace zero::config
