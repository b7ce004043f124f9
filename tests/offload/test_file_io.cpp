// File-I/O engines (pread/pwrite and io_uring): O_DIRECT round trips split into block-sized
// requests, concurrent transfers, and injected and real faults reported with file, offset,
// bytes and errno text.
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/offload/aligned_buffer.hpp>
#include <zero/offload/direct_io.hpp>
#include <zero/offload/make_file_io.hpp>

#include "scratch.hpp"

using namespace zero;
using namespace zero::offload;
using zero::testing::TempDir;

namespace {

IoOptions small_options() {
  IoOptions o;
  o.block_size = 64 * 1024;
  o.queue_depth = 4;
  o.thread_count = 2;
  return o;
}

// A buffer holding bytes bytes of a pattern that depends on seed.
AlignedBuffer pattern(std::size_t bytes, std::size_t align, std::uint32_t seed) {
  AlignedBuffer b(bytes, align);
  const auto v = zero::testing::random_floats(b.size() / sizeof(float), seed);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace

TEST_CASE("aligned buffers start on a page, large ones on 2 MiB, read as zeros and zero exactly",
          "[unit][offload]") {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  // 512 is what a 512-byte-sector disk reports; the buffer still starts on a page, because a
  // sub-page start costs every O_DIRECT request one more DMA segment.
  for (const std::size_t align : {std::size_t{512}, std::size_t{4096}}) {
    for (const std::size_t bytes :
         {std::size_t{1000}, std::size_t{3} << 20, (std::size_t{5} << 20) + 512}) {
      INFO("alignment " << align << ", bytes " << bytes);
      AlignedBuffer b(bytes, align);
      CHECK(b.size() == (bytes + align - 1) / align * align);
      CHECK(b.alignment() == align);
      const auto at = reinterpret_cast<std::uintptr_t>(b.data());
      CHECK(at % page == 0);
      if (b.size() >= (std::size_t{2} << 20)) CHECK(at % (std::uintptr_t{2} << 20) == 0);
      for (std::byte x : b.bytes()) REQUIRE(x == std::byte{0});
      std::memset(b.data(), 0x5a, b.size());  // every byte of size() is writable
      // zero() clears exactly the bytes asked for (streaming stores from 1 MiB up, then a tail
      // that is not a multiple of their 64-byte step).
      const std::size_t part = b.size() > 4096 ? b.size() - 4096 + 512 : b.size() / 2;
      b.zero(part);
      for (std::size_t i = 0; i < b.size(); ++i)
        REQUIRE(b.data()[i] == (i < part ? std::byte{0} : std::byte{0x5a}));
      CHECK_THROWS_AS(b.zero(b.size() + 1), Error);
    }
  }
  AlignedBuffer empty(0, 4096);
  CHECK(empty.data() == nullptr);
  CHECK(empty.size() == 0);
}

TEST_CASE("direct I/O probe finds an alignment on the scratch directory", "[unit][offload]") {
  const auto d = probe_direct_io(zero::testing::direct_io_base());
  REQUIRE(d.supported);
  CHECK(d.alignment >= 512);
  CHECK((d.alignment & (d.alignment - 1)) == 0);
  CHECK(!d.fs_type.empty());
}

TEST_CASE("file-I/O engines round-trip concurrent O_DIRECT transfers", "[unit][offload]") {
  {
    const auto backend = GENERATE(from_range(zero::testing::backends()));
    INFO("engine " << zero::testing::name_of(backend));
    TempDir dir("fileio", zero::testing::direct_io_base());
    const auto align = probe_direct_io(dir.path()).alignment;
    auto io = make_file_io(small_options(), backend);
    auto fd = open_direct(dir / "a.swp", true);
    // Three transfers of sizes that are not multiples of the block size, in flight together.
    const std::size_t sizes[] = {3 * 64 * 1024 + align, align, 10 * 64 * 1024 + 5 * align};
    std::vector<AlignedBuffer> out, in;
    std::vector<IoTicket> tickets;
    std::uint64_t offset = 0;
    std::vector<std::uint64_t> offsets;
    for (int i = 0; i < 3; ++i) {
      out.push_back(pattern(sizes[i], align, 17 + i));
      offsets.push_back(offset);
      tickets.push_back(
          io->submit({IoOp::write, fd.get(), "a.swp", offset, out[i].data(), out[i].size()}));
      offset += out[i].size();
    }
    for (int i = 2; i >= 0; --i) io->wait(tickets[i]);  // any order
    tickets.clear();
    for (int i = 0; i < 3; ++i) {
      in.emplace_back(sizes[i], align);
      tickets.push_back(
          io->submit({IoOp::read, fd.get(), "a.swp", offsets[i], in[i].data(), in[i].size()}));
    }
    for (int i = 0; i < 3; ++i) {
      io->wait(tickets[i]);
      CHECK(!tickets[i].valid());
      CHECK(std::memcmp(in[i].data(), out[i].data(), out[i].size()) == 0);
    }
  }
}

TEST_CASE("injected EIO, ENOSPC and short writes name file, offset, bytes and reason",
          "[unit][offload]") {
  {
    const auto backend = GENERATE(from_range(zero::testing::backends()));
    INFO("engine " << zero::testing::name_of(backend));
    TempDir dir("faults", zero::testing::direct_io_base());
    const auto align = probe_direct_io(dir.path()).alignment;
    const auto path = (dir / "f.swp").string();
    auto fd = open_direct(path, true);
    const std::size_t bytes = 4 * 64 * 1024;
    AlignedBuffer good = pattern(bytes, align, 1);
    {
      auto io = make_file_io(small_options(), backend);
      io->run({IoOp::write, fd.get(), path, 0, good.data(), bytes});
    }

    SECTION("EIO on the third read request") {
      auto opt = small_options();
      opt.faults = std::make_shared<FaultInjector>(2, EIO, IoOp::read);
      auto io = make_file_io(opt, backend);
      AlignedBuffer in(bytes, align);
      try {
        io->run({IoOp::read, fd.get(), path, 0, in.data(), bytes});
        FAIL("no error");
      } catch (const NvmeIoError& e) {
        const std::string m = e.what();
        CHECK(m.find(path) != std::string::npos);
        CHECK(m.find("reading") != std::string::npos);
        CHECK(m.find("at byte 131072 (65536 bytes)") != std::string::npos);
        CHECK(m.find(std::strerror(EIO)) != std::string::npos);
        CHECK(e.error_code() == EIO);
        CHECK(e.offset() == 131072);
        CHECK(e.path() == path);
      }
      CHECK(opt.faults->fired() == 1);
      // The engine keeps working after a failure.
      io->run({IoOp::read, fd.get(), path, 0, in.data(), bytes});
      CHECK(std::memcmp(in.data(), good.data(), bytes) == 0);
    }
    SECTION("ENOSPC on a write leaves the other requests' data in place") {
      auto opt = small_options();
      opt.faults = std::make_shared<FaultInjector>(1, ENOSPC, IoOp::write);
      auto io = make_file_io(opt, backend);
      AlignedBuffer other = pattern(bytes, align, 2);
      try {
        io->run({IoOp::write, fd.get(), path, 0, other.data(), bytes});
        FAIL("no error");
      } catch (const NvmeIoError& e) {
        const std::string m = e.what();
        CHECK(e.error_code() == ENOSPC);
        CHECK(m.find(std::strerror(ENOSPC)) != std::string::npos);
        CHECK(m.find("nvme_path") != std::string::npos);  // the advice
        CHECK(e.offset() == 65536);
      }
      AlignedBuffer in(bytes, align);
      io->run({IoOp::read, fd.get(), path, 0, in.data(), bytes});
      // Request 1 ([64K, 128K)) failed before touching the file.
      CHECK(std::memcmp(in.data() + 65536, good.data() + 65536, 65536) == 0);
    }
    SECTION("EAGAIN and EINTR are retried, not errors") {
      // io_uring completes an O_DIRECT transfer with -EAGAIN when the block layer is out of
      // tags; the application is to reissue it. It failed the step instead.
      for (const int transient : {EAGAIN, EINTR}) {
        for (const IoOp op : {IoOp::write, IoOp::read}) {
          INFO("errno " << transient << (op == IoOp::read ? " on a read" : " on a write"));
          auto opt = small_options();
          opt.faults = std::make_shared<FaultInjector>(1, transient, op);
          auto io = make_file_io(opt, backend);
          AlignedBuffer data = pattern(bytes, align, 3);
          if (op == IoOp::write) {
            CHECK_NOTHROW(io->run({IoOp::write, fd.get(), path, 0, data.data(), bytes}));
          }
          AlignedBuffer in(bytes, align);
          CHECK_NOTHROW(io->run({IoOp::read, fd.get(), path, 0, in.data(), bytes}));
          CHECK(opt.faults->fired() == 1);
          // What was written (the pattern, or the good data before) reads back whole.
          CHECK(std::memcmp(in.data(), op == IoOp::write ? data.data() : good.data(), bytes) == 0);
          if (op == IoOp::write) io->run({IoOp::write, fd.get(), path, 0, good.data(), bytes});
        }
      }
    }
    SECTION("a short write is an error, not silent truncation") {
      auto opt = small_options();
      opt.faults = std::make_shared<FaultInjector>(0, 0, IoOp::write, align);
      auto io = make_file_io(opt, backend);
      try {
        io->run({IoOp::write, fd.get(), path, 0, good.data(), bytes});
        FAIL("no error");
      } catch (const NvmeIoError& e) {
        const std::string m = e.what();
        INFO(m);
        CHECK(m.find("short write: " + std::to_string(align) + " of 65536 bytes") !=
              std::string::npos);
        CHECK(e.error_code() == 0);
      }
    }
  }
}

TEST_CASE("a write that moves part of its bytes goes on, and the next part says why it stopped",
          "[unit][offload]") {
  // The file-size limit truncates the write that crosses it (the kernel moves the bytes below
  // the limit) and refuses the next with EFBIG, as a filling disk does with ENOSPC. io_uring
  // reported the partial completion as "short write" without the reason.
  TempDir dir("partial", zero::testing::direct_io_base());
  const auto align = probe_direct_io(dir.path()).alignment;
  const std::size_t bytes = 2 * 64 * 1024;
  const rlim_t limit = 64 * 1024 + align;
  AlignedBuffer data = pattern(bytes, align, 4);
  {
    const auto backend = GENERATE(from_range(zero::testing::backends()));
    INFO("engine " << zero::testing::name_of(backend));
    const auto path = (dir / "limited.swp").string();
    auto fd = open_direct(path, true);
    auto io = make_file_io(small_options(), backend);
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of a core dump
    rlimit lowered = saved;
    lowered.rlim_cur = limit;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &lowered) == 0);
    std::string message;
    int code = -1;
    try {
      io->run({IoOp::write, fd.get(), path, 0, data.data(), bytes});
    } catch (const NvmeIoError& e) {
      message = e.what();
      code = e.error_code();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    INFO(message);
    CHECK(code == EFBIG);
    CHECK(message.find(std::strerror(EFBIG)) != std::string::npos);
    CHECK(std::filesystem::file_size(path) == limit);  // the part below the limit was written
    fd.reset();
    std::filesystem::remove(path);
  }
}

TEST_CASE("a full tmpfs reports ENOSPC with the file and range", "[unit][offload]") {
  zero::testing::TmpfsMount fs("256k");
  if (!fs.mounted()) {
    WARN("skipped: cannot mount a tmpfs here (" << fs.why() << ")");
    return;
  }
  const auto d = probe_direct_io(fs.path());
  WARN("tmpfs O_DIRECT on this kernel: " << (d.supported ? "supported" : d.reason));
  {
    const auto backend = GENERATE(from_range(zero::testing::backends()));
    INFO("engine " << zero::testing::name_of(backend));
    const auto path = (fs.path() / "full.swp").string();
    auto fd = open_direct(path, true, d.supported);
    auto io = make_file_io(small_options(), backend);
    AlignedBuffer data = pattern(1 << 20, 4096, 3);
    try {
      io->run({IoOp::write, fd.get(), path, 0, data.data(), data.size()});
      FAIL("writing 1 MiB to a 256 KiB tmpfs succeeded");
    } catch (const NvmeIoError& e) {
      const std::string m = e.what();
      INFO(m);
      CHECK(m.find(path) != std::string::npos);
      CHECK((e.error_code() == ENOSPC || m.find("short write") != std::string::npos));
    }
    fd.reset();
    std::filesystem::remove(path);
  }
}
