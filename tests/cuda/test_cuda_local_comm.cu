// CudaLocalComm: ranks as threads on one GPU, every op on device buffers against LocalComm on
// the same inputs in host memory, bit for bit (both fold in rank order with the same rule); its
// stream ordering, and the deadlines of a missing rank and of a stream that never drains.

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <parallel/comm/cuda_local_comm.cuh>
#include <parallel/comm/local_comm.hpp>

#include "../parallel/comm_test_util.hpp"
#include "ops_test_util.hpp"

using namespace zero;
using namespace zero::parallel;
using namespace zero::parallel::testing;
using zero::testing::thrown_message;

namespace {

/// Buffers in host memory, for LocalComm.
struct HostSpace {
  template <class T>
  struct Vec {
    std::vector<T> v;
    explicit Vec(std::vector<T> h) : v(std::move(h)) {}
    std::span<T> span() { return v; }
    std::vector<T> read() const { return v; }
  };
};

/// Buffers in device memory, for CudaLocalComm.
struct DeviceSpace {
  template <class T>
  struct Vec {
    zero::test::DeviceVector<T> d;
    // cudaMemcpy from pageable memory may return before the copy lands, and the communicator's
    // non-blocking streams do not wait for the legacy stream: the producer must be done first,
    // as the Communicator contract asks. On an H200 the first element a ring's recv got differed
    // (bf16 at 4 ranks, f16 at 2) until the uploads were waited for; it passed in three runs after.
    explicit Vec(const std::vector<T>& h) : d(h) { ZERO_CUDA_CHECK(cudaDeviceSynchronize()); }
    std::span<T> span() { return {d.get(), d.size()}; }
    std::vector<T> read() const { return d.download(); }
  };
};

/// Rank r's input: random values for the float types (so rounding is exercised), small integers
/// otherwise.
template <class T>
std::vector<T> rank_input(int rank, std::size_t count, std::uint32_t salt = 0) {
  if constexpr (std::is_integral_v<T>) {
    return make_input<T>(rank, count, salt);
  } else {
    return zero::test::random_vector<T>(count, 1000u * salt + 17u * rank + 1u, -4.0f, 4.0f);
  }
}

/// Every op of the Communicator on buffers of Space, their outputs concatenated: all_reduce (out
/// of place and in place), reduce_scatter, all_gather (out of place and in place), broadcast,
/// all_to_all, all_to_all_v, the async forms, a ring of send/recv and an all_reduce on a split.
template <class T, class Space, class Comm>
std::vector<T> every_op(Comm& comm, ReduceOp op) {
  using Vec = typename Space::template Vec<T>;
  constexpr std::size_t count = 37;  // uneven chunks at 2 and 4 ranks
  const int me = comm.rank();
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  std::vector<T> out;
  auto keep = [&](const Vec& v) { append(out, v.read()); };

  Vec in(rank_input<T>(me, count)), reduced{std::vector<T>(count)};
  comm.all_reduce(std::span<const T>(in.span()), reduced.span(), op);
  keep(reduced);
  Vec in_place(rank_input<T>(me, count, 1));
  comm.all_reduce(in_place.span(), op);
  keep(in_place);

  Vec wide(rank_input<T>(me, un * count, 2)), scattered{std::vector<T>(count)};
  comm.reduce_scatter(std::span<const T>(wide.span()), scattered.span(), op);
  keep(scattered);

  Vec gathered{std::vector<T>(un * count)};
  comm.all_gather(std::span<const T>(in.span()), gathered.span());
  keep(gathered);
  std::vector<T> own(un * count);
  const std::vector<T> mine = rank_input<T>(me, count, 3);
  for (std::size_t i = 0; i < count; ++i) own[static_cast<std::size_t>(me) * count + i] = mine[i];
  Vec gathered_in_place(own);
  comm.all_gather(std::span<const T>(gathered_in_place.span().subspan(
                      static_cast<std::size_t>(me) * count, count)),
                  gathered_in_place.span());
  keep(gathered_in_place);

  Vec root(rank_input<T>(me, count, 4));
  comm.broadcast(root.span(), n - 1);
  keep(root);

  Vec transposed{std::vector<T>(un * count)};
  comm.all_to_all(std::span<const T>(wide.span()), transposed.span());
  keep(transposed);

  // Rank p sends (p + q) % 3 + 1 elements to rank q: the count matrix is symmetric.
  std::vector<std::size_t> counts(un);
  std::size_t total = 0;
  for (int q = 0; q < n; ++q) {
    counts[static_cast<std::size_t>(q)] = static_cast<std::size_t>((me + q) % 3 + 1);
    total += counts[static_cast<std::size_t>(q)];
  }
  Vec packed(rank_input<T>(me, total, 5)), unpacked{std::vector<T>(total)};
  comm.all_to_all_v(std::span<const T>(packed.span()), std::span<const std::size_t>(counts),
                    unpacked.span(), std::span<const std::size_t>(counts));
  keep(unpacked);

  Vec async_reduced{std::vector<T>(count)}, async_gathered{std::vector<T>(un * count)};
  Work w1 = comm.all_reduce_async(std::span<const T>(in.span()), async_reduced.span(), op);
  Work w2 = comm.all_gather_async(std::span<const T>(in.span()), async_gathered.span());
  w1.wait();
  w2.wait();
  keep(async_reduced);
  keep(async_gathered);

  if (n > 1) {
    Vec to_next(rank_input<T>(me, count, 6)), from_prev{std::vector<T>(count)};
    comm.send(std::span<const T>(to_next.span()), (me + 1) % n, 3);
    comm.recv(from_prev.span(), (me + n - 1) % n, 3);
    keep(from_prev);
  }

  auto half = comm.split(me % 2, me);
  Vec sub(rank_input<T>(me, count, 7));
  half.all_reduce(sub.span(), op);
  keep(sub);
  return out;
}

template <class T>
void check_against_local_comm() {
  for (int n : {1, 2, 4}) {
    for (ReduceOp op : all_reduce_ops) {
      INFO("ranks " << n << ", op " << name_of(op));
      auto want =
          per_rank<std::vector<T>>(n, [&](LocalComm& c) { return every_op<T, HostSpace>(c, op); });
      auto got = per_rank<std::vector<T>, CudaLocalComm>(
          n, [&](CudaLocalComm& c) { return every_op<T, DeviceSpace>(c, op); });
      for (int r = 0; r < n; ++r) {
        INFO("rank " << r);
        CHECK(first_mismatch(got[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)]) ==
              -1);
      }
    }
  }
}

/// Spins for about cycles clock ticks, then writes value to every element.
__global__ void slow_fill(float* out, int n, float value, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}

/// Spins until the host writes a non-zero value to flag.
__global__ void wait_for_host(const volatile int* flag) {
  while (*flag == 0) {
  }
}

}  // namespace

TEMPLATE_TEST_CASE("CudaLocalComm equals LocalComm bit for bit on every op at 1, 2 and 4 ranks",
                   "[cuda][comm]", double, float, zero::bf16, zero::f16, std::int32_t, std::int64_t,
                   std::uint8_t) {
  check_against_local_comm<TestType>();
}

TEST_CASE("CudaLocalComm runs an op after the work ordered before it on the rank's stream",
          "[cuda][comm]") {
  // Each rank's inputs are written by a kernel that spins for ~10 ms on another stream; the op
  // is ordered after it only through an event the mover's stream waits on.
  constexpr int count = 1024;
  auto got = per_rank<std::vector<float>, CudaLocalComm>(2, [](CudaLocalComm& comm) {
    zero::test::DeviceVector<float> v(std::vector<float>(count, -1.0f));
    cudaStream_t producer;
    cudaEvent_t done;
    ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking));
    ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    slow_fill<<<1, 256, 0, producer>>>(v.get(), count, static_cast<float>(comm.rank() + 1),
                                       20'000'000LL);
    ZERO_CUDA_CHECK(cudaEventRecord(done, producer));
    ZERO_CUDA_CHECK(cudaStreamWaitEvent(comm.mover().stream(), done, 0));
    comm.all_reduce(std::span<float>(v.get(), count), ReduceOp::sum);
    auto out = v.download();
    ZERO_CUDA_CHECK(cudaEventDestroy(done));
    ZERO_CUDA_CHECK(cudaStreamDestroy(producer));
    return out;
  });
  for (const auto& rank : got) CHECK(rank == std::vector<float>(count, 3.0f));
}

TEST_CASE("a CudaLocalComm split runs on its parent's stream, each rank on its own",
          "[cuda][comm]") {
  // The engine orders one comm stream after its compute; a split on another would run an
  // expert or tensor-parallel group's ops unordered (EngineGroups refuses that).
  const auto streams = per_rank<std::vector<void*>, CudaLocalComm>(2, [](CudaLocalComm& comm) {
    auto half = comm.split(0, comm.rank(), "half");
    return std::vector<void*>{static_cast<void*>(comm.device_stream()),
                              static_cast<void*>(half.device_stream())};
  });
  for (const auto& s : streams) {
    CHECK(s[0] != nullptr);
    CHECK(s[1] == s[0]);
  }
  CHECK(streams[0][0] != streams[1][0]);
}

TEST_CASE("CudaLocalComm names the op when a rank never joins or its stream never drains",
          "[cuda][comm]") {
  CommOptions quick;
  quick.timeout_s = 0.3;
  // Rank 1 holds back past the deadline before it would join the all_reduce.
  auto withheld = per_rank<std::string, CudaLocalComm>(
      3,
      [](CudaLocalComm& comm) {
        return thrown_message([&] {
          zero::test::DeviceVector<float> v(std::vector<float>(8, 1.0f));
          if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
          comm.all_reduce(std::span<float>(v.get(), 8), ReduceOp::sum);
        });
      },
      quick);
  CHECK_THAT(withheld[0], Catch::Contains("CudaLocalComm: all_reduce #0"));
  CHECK_THAT(withheld[0], Catch::Contains("timed out"));
  CHECK_THAT(withheld[0], Catch::Contains("group ranks [1]"));
  // Rank 1 joins after the others gave up: the group is broken, so its all_reduce fails at once
  // instead of completing against their descriptors (buffers they have freed).
  CHECK_THAT(withheld[1], Catch::Contains("all_reduce #0") && Catch::Contains("unusable"));
  // A kernel that waits for the host holds the mover's stream past the deadline.
  int* flag = nullptr;
  ZERO_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  int* device_flag = nullptr;
  ZERO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), flag, 0));
  const auto start = std::chrono::steady_clock::now();
  auto hung = per_rank<std::string, CudaLocalComm>(
      1,
      [&](CudaLocalComm& comm) {
        wait_for_host<<<1, 1, 0, comm.mover().stream()>>>(device_flag);
        std::string message = thrown_message([&] {
          zero::test::DeviceVector<float> v(std::vector<float>(8, 1.0f));
          comm.all_reduce(std::span<float>(v.get(), 8), ReduceOp::sum);
        });
        *reinterpret_cast<volatile int*>(flag) = 1;
        ZERO_CUDA_CHECK(cudaStreamSynchronize(comm.mover().stream()));
        return message;
      },
      quick);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK_THAT(hung[0], Catch::Contains("CudaLocalComm: all_reduce #0"));
  CHECK_THAT(hung[0],
             Catch::Contains("passed its deadline waiting for the work ordered before it"));
  CHECK(waited < 5.0);
  // A send's copy to the host waits on the same stream, within the deadline too (it
  // synchronised the stream without one before).
  *flag = 0;
  auto hung_send = per_rank<std::string, CudaLocalComm>(
      2,
      [&](CudaLocalComm& comm) {
        if (comm.rank() == 1) return std::string();
        wait_for_host<<<1, 1, 0, comm.mover().stream()>>>(device_flag);
        std::string message = thrown_message([&] {
          zero::test::DeviceVector<float> v(std::vector<float>(8, 1.0f));
          comm.send(std::span<const float>(v.get(), 8), 1);
        });
        *reinterpret_cast<volatile int*>(flag) = 1;
        ZERO_CUDA_CHECK(cudaStreamSynchronize(comm.mover().stream()));
        return message;
      },
      quick);
  CHECK_THAT(hung_send[0], Catch::Contains("CudaLocalComm: send #0") &&
                               Catch::Contains("passed its deadline waiting for the work ordered "
                                               "before its message's copy to the host"));
  ZERO_CUDA_CHECK(cudaFreeHost(flag));
}
