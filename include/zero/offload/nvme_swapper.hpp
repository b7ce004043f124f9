#pragma once
// NvmeSwapper: flat fp32 tensors grouped in sub-groups, living in swap files on NVMe, brought
// into aligned host buffers to be updated in place. This is what lets the engine run its
// optimizer over states (fp32 master, exp_avg, exp_avg_sq) that do not fit in host memory.
//
// Use from the engine (Offload<NVMe>):
//
//   NvmeSwapper swap(NvmeConfig::from_config(cfg), groups, {.rank = r});  // groups: per
//                                                    // sub-group, {name, numel} of its tensors
//   swap.swap_out(g, {master_g, zeros, zeros});     // once: initial states from any memory
//   swap.for_each_group([&](std::size_t g, std::span<const std::span<float>> t) {
//     adamw_step(t[0], t[1], t[2], grads_of(g));   // t in the order the group listed them
//   });                                             // reads g+1 and writes g-1 meanwhile
//   swap.swap_in(g, {out_master, out_m, out_v});     // e.g. checkpoint or fp16 refresh
//   swap.swap_in_tensor(g, 0, out_master);          // one tensor alone (stage-3 gathers)
//   swap.read_ahead(g, 0);                          // ...its bytes start coming in now, into a
//                                                   // buffer of their own; swap_in_tensor
//                                                   // later waits only for what is not in yet
//   swap.for_each_group(fn, {.reverse = true, .hand_over = 0});  // last group to first; groups
//                                                   // 0, 1, ... stay in the buffers after it,
//                                                   // and their swap_in_tensor(g, 0) reads nothing
//
// Files: <nvme_path>/zero_swap/rank<r>/<tag>/group<g>.swp, one per sub-group, created and fully
// allocated by the constructor (so "disk full" shows at start-up, not mid-training) after a
// preflight, and removed with the (then empty) directories by the destructor. The directory is
// locked (flock on <dir>/.lock, swap_directory.hpp) for the swapper's life: a second swapper for
// the same rank, tag and nvme_path is refused with a ConfigError instead of truncating the first
// one's files. Tensors sit at aligned offsets, so a sub-group moves as one O_DIRECT transfer split
// into aio.block_size requests with aio.queue_depth in flight. Reads ahead of swap_in_tensor use
// the buffers a pass would (every one but the first): a pass, or a swap_out of their group, drops
// them. A pass may hand over the tensor it names of the groups it ends with, which are in those
// buffers then, as reads already done (SwapPass::hand_over). The buffers are AlignedBuffers (2 MiB
// aligned and advised for huge pages), which keeps each request to a few DMA segments;
// aligned_buffer.hpp says why that decides the throughput.
//
// Errors: every I/O failure is an NvmeIoError naming file, offset, bytes and errno text. A
// failed write leaves that sub-group's file undefined (other groups are untouched) and marks
// the group so that reading it throws until it is written again. Not thread-safe: one thread
// drives a swapper.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/io/file.hpp>
#include <zero/offload/aligned_buffer.hpp>
#include <zero/offload/direct_io.hpp>
#include <zero/offload/file_io.hpp>
#include <zero/offload/make_file_io.hpp>
#include <zero/offload/nvme_config.hpp>
#include <zero/offload/preflight.hpp>
#include <zero/offload/swap_directory.hpp>
#include <zero/offload/swap_layout.hpp>
#include <zero/offload/tensor_read_stats.hpp>

namespace zero::offload {

/// Who the swapper is and how it does I/O.
struct SwapperOptions {
  int rank = 0;                   ///< files go under rank<rank>/
  std::string tag = "optimizer";  ///< one directory per swapper of a rank
  IoBackend backend = IoBackend::automatic;
  std::shared_ptr<FaultInjector> faults;  ///< tests only
};
/// What a for_each_group pass moves.
struct SwapPass {
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  bool read = true;      ///< false: fn starts from zeros (first write of fresh states)
  bool write = true;     ///< false: read-only pass (checkpoint save, fp16 refresh)
  bool reverse = false;  ///< visit the groups last to first
  /// A tensor index: once the pass is through, this tensor of each group its last visits left in
  /// the buffers a read ahead uses (buffer_count - 1 groups: with reverse, groups 0, 1, ...) is
  /// held for that group's swap_in_tensor as if read ahead, without reading (the buffer holds
  /// what the file now holds). none: the pass hands nothing over.
  std::size_t hand_over = none;
};
/// Swaps sub-groups of fp32 tensors between NVMe files and host buffers (see above).
class NvmeSwapper {
 public:
  using Options = SwapperOptions;
  using Pass = SwapPass;
  /// fn(group, tensors): tensors are spans into the group's buffer, in the group's order.
  using GroupFn = std::function<void(std::size_t, std::span<const std::span<float>>)>;

  /// Takes its directory's lock and removes the swap files a crashed run left there, runs the
  /// preflight (throws ConfigError listing what to change; the space those files held counts
  /// as free), creates and allocates the files and the buffer_count buffers.
  NvmeSwapper(const NvmeConfig& cfg, std::vector<std::vector<SwapTensor>> groups,
              Options options = {})
      : cfg_(cfg), options_(std::move(options)) {
    expect<ConfigError>(cfg_.buffer_count >= 1, "offload_*.buffer_count: ", cfg_.buffer_count,
                        " must be at least 1");
    dir_ = SwapDirectory(cfg_.nvme_path, options_.rank, options_.tag);
    try {
      // Only under an existing, writable nvme_path (the preflight names what is wrong
      // otherwise): the lock comes before any file is touched, so others' files are left alone.
      std::error_code ec;
      if (std::filesystem::is_directory(cfg_.nvme_path, ec) &&
          ::access(cfg_.nvme_path.c_str(), W_OK | X_OK) == 0) {
        dir_.lock();
        dir_.remove_stale_files();
      }
      const PreflightReport report = require_preflight(cfg_, needs(cfg_, groups, 4096));
      alignment_ = cfg_.direct_io ? report.direct.alignment : 4096;
      expect<ConfigError>(cfg_.block_size % alignment_ == 0, "aio.block_size: ", cfg_.block_size,
                          " is not a multiple of the logical block size ", alignment_, " of '",
                          cfg_.nvme_path.string(), "'");
      std::size_t largest = 0;
      for (auto& g : groups) {
        layouts_.push_back(SwapLayout::plan(std::move(g), alignment_));
        largest = std::max(largest, layouts_.back().bytes);
      }
      state_.assign(layouts_.size(), GroupState::fresh);
      for (std::size_t g = 0; g < layouts_.size(); ++g) {
        const auto path = file_of(g);
        fds_.push_back(open_direct(path, true, cfg_.direct_io));
        paths_.push_back(path.string());
        const int rc =
            ::posix_fallocate(fds_.back().get(), 0, static_cast<::off_t>(layouts_[g].bytes));
        if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL)
          throw NvmeIoError("reserving space for", path.string(), 0, layouts_[g].bytes, rc,
                            errno_reason(rc));
      }
      IoOptions io = cfg_.io_options();
      io.faults = options_.faults;
      io_ = make_file_io(io, options_.backend);
      const int nbuf =
          std::max(1, std::min<int>(cfg_.buffer_count, static_cast<int>(layouts_.size())));
      for (int b = 0; b < nbuf; ++b) buffers_.emplace_back(largest, alignment_, cfg_.pin_memory);
    } catch (...) {
      remove_files();
      throw;
    }
    slots_.resize(buffers_.size());
    ahead_.resize(buffers_.size() - 1);
  }
  NvmeSwapper(const NvmeSwapper&) = delete;
  NvmeSwapper& operator=(const NvmeSwapper&) = delete;
  /// Waits for any transfer still in flight, closes and removes the files and empty directories.
  ~NvmeSwapper() {
    drop_reads_ahead([](const Ahead&) { return true; });
    drain();
    io_.reset();
    remove_files();
  }

  /// Bytes on disk and in host buffers for groups laid out with alignment (for a preflight or
  /// a memory report before constructing).
  static PreflightNeeds needs(const NvmeConfig& cfg,
                              const std::vector<std::vector<SwapTensor>>& groups,
                              std::size_t alignment) {
    PreflightNeeds n;
    std::uint64_t largest = 0;
    for (const auto& g : groups) {
      const auto b = SwapLayout::plan(g, alignment).bytes;
      n.swap_bytes += b;
      largest = std::max<std::uint64_t>(largest, b);
    }
    const auto nbuf = static_cast<std::uint64_t>(
        std::max(1, std::min<int>(cfg.buffer_count, static_cast<int>(groups.size()))));
    n.buffer_bytes = nbuf * largest;
    return n;
  }

  /// Number of sub-groups.
  std::size_t num_groups() const { return layouts_.size(); }
  /// The layout of group g.
  const SwapLayout& layout(std::size_t g) const { return layouts_.at(g); }
  /// The swap file of group g.
  std::filesystem::path file_of(std::size_t g) const {
    return dir_.path() / ("group" + std::to_string(g) + ".swp");
  }
  /// The directory holding this swapper's files.
  const std::filesystem::path& directory() const { return dir_.path(); }
  /// The direct-I/O alignment in use (bytes).
  std::size_t alignment() const { return alignment_; }
  /// Host bytes held in swap buffers.
  std::size_t buffer_bytes() const {
    return buffers_.empty() ? 0 : buffers_.size() * buffers_.front().size();
  }
  /// Bytes of all swap files.
  std::uint64_t file_bytes() const {
    std::uint64_t n = 0;
    for (const auto& l : layouts_) n += l.bytes;
    return n;
  }
  /// The file-I/O engine in use ("io_uring", "pread/pwrite (...)").
  std::string io_name() const { return io_->name(); }
  /// True when the buffers are locked in RAM (pin_memory and mlock succeeded).
  bool buffers_locked() const { return !buffers_.empty() && buffers_.front().locked(); }

  /// Writes group g's tensors from caller memory (one span per tensor, in the group's order,
  /// each exactly the tensor's size); blocks until the data is on disk.
  void swap_out(std::size_t g, std::span<const std::span<const float>> tensors) {
    expect_idle("swap_out");
    check_spans(g, tensors.size(), [&](std::size_t i) { return tensors[i].size(); });
    drop_reads_ahead([g](const Ahead& a) { return a.group == g; });  // about to be stale
    drain();
    AlignedBuffer& buf = buffers_.front();
    buf.zero(layouts_[g].bytes);  // padding goes to disk as zeros
    for (std::size_t i = 0; i < tensors.size(); ++i)
      std::memcpy(buf.data() + layouts_[g].offsets[i], tensors[i].data(), tensors[i].size_bytes());
    write_group(g, buf);
  }
  /// swap_out from non-const spans.
  void swap_out(std::size_t g, std::span<const std::span<float>> tensors) {
    std::vector<std::span<const float>> c(tensors.begin(), tensors.end());
    swap_out(g, std::span<const std::span<const float>>(c));
  }

  /// Reads group g's tensors into caller memory (spans as for swap_out); a group never written
  /// reads as zeros.
  void swap_in(std::size_t g, std::span<const std::span<float>> tensors) {
    expect_idle("swap_in");
    check_spans(g, tensors.size(), [&](std::size_t i) { return tensors[i].size(); });
    drain();
    AlignedBuffer& buf = buffers_.front();
    read_group(g, buf);
    for (std::size_t i = 0; i < tensors.size(); ++i)
      std::memcpy(tensors[i].data(), buf.data() + layouts_[g].offsets[i], tensors[i].size_bytes());
  }

  /// Reads tensor i of group g alone (its aligned byte range of the file) into out, exactly the
  /// tensor's size; a group never written reads as zeros. Blocks until the data is in: from the
  /// tensor's read ahead when one is held (waiting for what has not arrived), else read now.
  void swap_in_tensor(std::size_t g, std::size_t i, std::span<float> out) {
    check_tensor(g, i);
    const SwapLayout& l = layouts_[g];
    expect<ShapeError>(out.size() == static_cast<std::size_t>(l.tensors[i].numel),
                       "NVMe swap: group ", g, " tensor '", l.tensors[i].name, "' has ",
                       l.tensors[i].numel, " elements, its span ", out.size());
    expect_idle("swap_in_tensor");
    const auto start = std::chrono::steady_clock::now();
    struct Waited {  // adds the time spent here to the stats, however it ends
      TensorReadStats& stats;
      std::chrono::steady_clock::time_point start;
      ~Waited() {
        stats.wait_s +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    } waited{stats_, start};
    const std::size_t k = find_ahead(g, i);
    if (k < ahead_.size() && (ahead_[k].handed_over || ahead_[k].ticket.valid())) {
      Ahead& a = ahead_[k];
      a.held = false;
      if (a.ticket.valid()) io_->wait(a.ticket);  // a failed read throws, as a read now would
      std::memcpy(out.data(), buffers_[k + 1].data() + a.offset, out.size_bytes());
      ++(a.handed_over ? stats_.handed_over : stats_.read_ahead);
      return;
    }
    if (k < ahead_.size()) ahead_[k].held = false;  // a group that reads as zeros, or throws
    drain();
    const auto [begin, bytes] = tensor_range(g, i);
    AlignedBuffer& buf = buffers_.front();
    read_range(g, begin, bytes, buf);
    std::memcpy(out.data(), buf.data(), out.size_bytes());
    ++stats_.on_demand;
  }

  /// Starts reading tensor i of group g into a swap buffer of its own, for a later
  /// swap_in_tensor(g, i, ...). True when such a read is held for the tensor now (also when one
  /// already was); false when every buffer reads ahead may use is held (read_ahead_capacity()).
  /// The answer depends only on the calls made, never on the file's state, so ranks that make
  /// the same calls get the same answers: a group never written, or whose last write failed,
  /// holds a buffer without reading, and its swap_in_tensor reads zeros or throws as it would
  /// have. Not from inside a pass; a pass, or a swap_out of the group, drops the read unused.
  bool read_ahead(std::size_t g, std::size_t i) {
    check_tensor(g, i);
    expect_idle("read_ahead");
    if (find_ahead(g, i) < ahead_.size()) return true;
    const auto free =
        std::find_if(ahead_.begin(), ahead_.end(), [](const Ahead& a) { return !a.held; });
    if (free == ahead_.end()) return false;
    const auto k = static_cast<std::size_t>(free - ahead_.begin());
    IoTicket ticket;
    if (state_[g] == GroupState::valid) {
      const auto [begin, bytes] = tensor_range(g, i);
      ticket = io_->submit(
          Transfer{IoOp::read, fds_[g].get(), paths_[g], begin, buffers_[k + 1].data(), bytes});
    }
    ahead_[k] = Ahead{std::move(ticket), g, i, true};
    return true;
  }
  /// True while a read ahead of tensor i of group g is held for its swap_in_tensor.
  bool reading_ahead(std::size_t g, std::size_t i) const {
    return find_ahead(g, i) < ahead_.size();
  }
  /// How many reads ahead may be held at once: one per buffer but the first (0 with one buffer).
  std::size_t read_ahead_capacity() const { return ahead_.size(); }
  /// What swap_in_tensor did so far (see tensor_read_stats.hpp).
  const TensorReadStats& read_stats() const { return stats_; }

  /// Calls fn on every group in order (last to first with pass.reverse) with its tensors in a
  /// swap buffer, updated in place and written back. Pipelined over the buffer_count buffers:
  /// while fn runs on a group, the next (and further, with more buffers) is being read and the
  /// one before written. The first error (an NvmeIoError or fn's own exception) is rethrown after
  /// every transfer in flight finished. A pass that went through hands over pass.hand_over.
  void for_each_group(const GroupFn& fn, Pass pass = {}) {
    expect_idle("for_each_group");  // before drain: a nested call must not take the outer's
    drop_reads_ahead([](const Ahead&) { return true; });  // the pass needs their buffers
    drain();
    const std::size_t n = layouts_.size();
    const std::size_t nbuf = buffers_.size();
    // How many groups past the one computing have a buffer claimed (read ahead). With reads and
    // writes: one buffer computes, one writes the previous group, the rest read ahead. Reads
    // only: every other buffer reads ahead. Writes only: nothing to read, so a buffer is claimed
    // just when its group computes, and up to nbuf - 1 writes stay queued behind it (claiming
    // early would wait for a write to land sooner than needed and let the queue run dry).
    const std::size_t ahead = !pass.write  ? nbuf - 1
                              : !pass.read ? 0
                              : nbuf >= 3  ? nbuf - 2
                                           : nbuf - 1;
    // The j-th group visited, and the buffer (slot) it goes through. Handing over, the buffers
    // are rotated so that the last buffer_count - 1 visits use buffers 1.. (those reads ahead
    // use; the first stays free for swap_in_tensor's reads on demand).
    const auto group_at = [&](std::size_t j) { return pass.reverse ? n - 1 - j : j; };
    const std::size_t rotate = pass.hand_over == Pass::none ? 0 : (nbuf - n % nbuf) % nbuf;
    const auto buffer_at = [&](std::size_t j) { return (j + rotate) % nbuf; };
    std::size_t next_read = 0;
    std::vector<std::span<float>> spans;
    // Marks the pass as running (and how it reads) until it returns or throws.
    struct PassScope {
      NvmeSwapper& s;
      PassScope(NvmeSwapper& sw, bool reads) : s(sw) {
        s.pass_reads_ = reads;
        s.in_pass_ = true;
      }
      ~PassScope() {
        s.pass_reads_ = true;
        s.in_pass_ = false;
      }
    } scope(*this, pass.read);
    try {
      for (std::size_t j = 0; j < n; ++j) {
        while (next_read < n && next_read <= j + ahead) {
          Slot& s = slots_[buffer_at(next_read)];
          finish(s);  // the buffer's previous write must land before it is reused
          start_read(group_at(next_read), s);
          ++next_read;
        }
        const std::size_t g = group_at(j);
        Slot& s = slots_[buffer_at(j)];
        finish(s);  // the read of g
        auto& buf = buffers_[buffer_at(j)];
        if (s.zero_fill) {  // zeroed only now, so zeroing does not delay earlier transfers
          buf.zero(layouts_[g].bytes);
          s.zero_fill = false;
        }
        spans.clear();
        for (std::size_t i = 0; i < layouts_[g].tensors.size(); ++i)
          spans.emplace_back(reinterpret_cast<float*>(buf.data() + layouts_[g].offsets[i]),
                             static_cast<std::size_t>(layouts_[g].tensors[i].numel));
        fn(g, std::span<const std::span<float>>(spans));
        if (pass.write) start_write(g, s);
      }
      for (auto& s : slots_) finish(s);
    } catch (...) {
      drain();
      throw;
    }
    if (pass.hand_over != Pass::none) hand_over(pass.hand_over);
  }

  /// for_each_group with pass options given first (reads the call sites better).
  void for_each_group(Pass pass, const GroupFn& fn) { for_each_group(fn, pass); }

 private:
  enum class GroupState : unsigned char { fresh, valid, broken };

  // swap_in / swap_out / swap_in_tensor / a nested pass would reuse buffers a pass holds.
  void expect_idle(const char* what) const {
    expect<Error>(!in_pass_, "NVMe swap: ", what,
                  " called from inside for_each_group (its buffers are in use); call it after "
                  "the pass");
  }
  // A buffer's transfer in flight, if any.
  struct Slot {
    IoTicket ticket;
    std::size_t group = 0;
    IoOp op = IoOp::read;
    bool zero_fill = false;  // the group starts from zeros instead of being read
  };

  // A read ahead of one tensor into buffers_[index + 1], held until swap_in_tensor takes it or
  // something drops it: its bytes at offset in the buffer. Neither a ticket nor handed over: the
  // group reads as zeros or throws (read_ahead).
  struct Ahead {
    IoTicket ticket;
    std::size_t group = 0;
    std::size_t tensor = 0;
    bool held = false;
    bool handed_over = false;  // the bytes a pass left in the buffer (no read)
    std::size_t offset = 0;
  };
  // After a pass went through: tensor i of the group each buffer a read ahead uses holds now,
  // held as read (for_each_group's rotation puts the pass's last groups there). Its file holds
  // the same bytes: a write pass's writes have landed, a read pass wrote nothing.
  void hand_over(std::size_t i) {
    for (std::size_t k = 0; k < ahead_.size(); ++k) {
      const Slot& s = slots_[k + 1];
      if (i >= layouts_[s.group].tensors.size() || state_[s.group] != GroupState::valid) continue;
      ahead_[k] = Ahead{IoTicket{}, s.group, i, true, true, layouts_[s.group].offsets[i]};
    }
  }
  // The index in ahead_ of the read held for (g, i), or ahead_.size().
  std::size_t find_ahead(std::size_t g, std::size_t i) const {
    for (std::size_t k = 0; k < ahead_.size(); ++k) {
      if (ahead_[k].held && ahead_[k].group == g && ahead_[k].tensor == i) return k;
    }
    return ahead_.size();
  }
  // Drops the held reads ahead that pred picks, waiting for those in flight (their errors are
  // no one's now: the bytes are not wanted).
  template <class Pred>
  void drop_reads_ahead(Pred pred) noexcept {
    for (Ahead& a : ahead_) {
      if (!a.held || !pred(a)) continue;
      try {
        io_->wait(a.ticket);
      } catch (...) {
      }
      a.held = false;
      ++stats_.dropped;
    }
  }
  // The aligned byte range [begin, begin + bytes) of tensor i of group g in its file.
  std::pair<std::size_t, std::size_t> tensor_range(std::size_t g, std::size_t i) const {
    const SwapLayout& l = layouts_[g];
    const std::size_t begin = l.offsets[i];
    const std::size_t end = i + 1 < l.offsets.size() ? l.offsets[i + 1] : l.bytes;
    return {begin, end - begin};
  }
  void check_tensor(std::size_t g, std::size_t i) const {
    expect<ShapeError>(g < layouts_.size() && i < layouts_[g].tensors.size(), "NVMe swap: group ",
                       g, " tensor ", i, " does not exist");
  }

  template <class SizeOf>
  void check_spans(std::size_t g, std::size_t count, SizeOf size_of) const {
    expect<ShapeError>(g < layouts_.size(), "NVMe swap: group ", g, " does not exist (",
                       layouts_.size(), " groups)");
    const auto& l = layouts_[g];
    expect<ShapeError>(count == l.tensors.size(), "NVMe swap: group ", g, " has ", l.tensors.size(),
                       " tensors, ", count, " spans were given");
    for (std::size_t i = 0; i < count; ++i)
      expect<ShapeError>(size_of(i) == static_cast<std::size_t>(l.tensors[i].numel),
                         "NVMe swap: group ", g, " tensor '", l.tensors[i].name, "' has ",
                         l.tensors[i].numel, " elements, its span ", size_of(i));
  }

  Transfer transfer(IoOp op, std::size_t g, AlignedBuffer& buf) const {
    return Transfer{op, fds_[g].get(), paths_[g], 0, buf.data(), layouts_[g].bytes};
  }

  void check_readable(std::size_t g) const {
    if (state_[g] == GroupState::broken)
      throw NvmeIoError("reading", paths_[g], 0, layouts_[g].bytes, 0,
                        zero::detail::concat("sub-group ", g,
                                             " is incomplete on disk because its last write "
                                             "failed; write it again (swap_out) first"));
  }

  void start_read(std::size_t g, Slot& s) {
    AlignedBuffer& buf = buffers_[&s - slots_.data()];
    s.group = g;
    s.op = IoOp::read;
    // A write-only pass rewrites g whole, so a group whose last write failed may be zero-filled.
    s.zero_fill = state_[g] == GroupState::fresh || !pass_reads_;
    if (s.zero_fill) return;
    check_readable(g);
    s.ticket = io_->submit(transfer(IoOp::read, g, buf));
  }

  void start_write(std::size_t g, Slot& s) {
    AlignedBuffer& buf = buffers_[&s - slots_.data()];
    s.group = g;
    s.op = IoOp::write;
    state_[g] = GroupState::broken;  // until the write completes
    s.ticket = io_->submit(transfer(IoOp::write, g, buf));
  }

  // Waits for the slot's transfer; a completed write makes its group valid.
  void finish(Slot& s) {
    if (!s.ticket.valid()) return;
    io_->wait(s.ticket);  // throws; the group stays broken for a failed write
    if (s.op == IoOp::write) state_[s.group] = GroupState::valid;
  }

  // Waits for every transfer in flight, ignoring errors (the caller is already failing or
  // there are none left to report).
  void drain() noexcept {
    for (auto& s : slots_) {
      try {
        finish(s);
      } catch (...) {
      }
    }
  }

  void write_group(std::size_t g, AlignedBuffer& buf) {
    state_[g] = GroupState::broken;
    io_->run(transfer(IoOp::write, g, buf));
    state_[g] = GroupState::valid;
  }

  void read_group(std::size_t g, AlignedBuffer& buf) { read_range(g, 0, layouts_[g].bytes, buf); }

  // Reads bytes [begin, begin + bytes) of group g's file (aligned) into the start of buf; a
  // group never written reads as zeros, one whose last write failed throws.
  void read_range(std::size_t g, std::size_t begin, std::size_t bytes, AlignedBuffer& buf) {
    check_readable(g);
    if (state_[g] == GroupState::fresh) {
      buf.zero(bytes);
      return;
    }
    io_->run(Transfer{IoOp::read, fds_[g].get(), paths_[g], begin, buf.data(), bytes});
  }

  void remove_files() noexcept {
    fds_.clear();
    std::error_code ec;
    for (const auto& p : paths_) std::filesystem::remove(p, ec);
    dir_.release();
  }

  NvmeConfig cfg_;
  Options options_;
  std::size_t alignment_ = 4096;
  std::vector<SwapLayout> layouts_;
  std::vector<GroupState> state_;
  SwapDirectory dir_;
  std::vector<io::FileDescriptor> fds_;
  std::vector<std::string> paths_;
  std::unique_ptr<FileIo> io_;
  std::vector<AlignedBuffer> buffers_;
  std::vector<Slot> slots_;
  std::vector<Ahead> ahead_;  // reads ahead; ahead_[k] uses buffers_[k + 1]
  TensorReadStats stats_;
  bool pass_reads_ = true;
  bool in_pass_ = false;  // for_each_group is running: its buffers are in use
};

}  // namespace zero::offload
