// NcclComm under mpiexec on GPUs: each op against the closed forms of the host tests, with
// device buffers. Without a visible GPU nccl_main.cpp exits with 77 (CTest: skipped); the early
// returns below only guard a run of this file under another main.

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include <parallel/comm/nccl_comm.cuh>

#include "../parallel/comm_test_util.hpp"

using namespace zero;
using namespace zero::parallel;
using namespace zero::parallel::testing;

namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/// A device copy of a host vector, freed on scope exit.
template <class T>
struct DeviceVector {
  T* data = nullptr;
  std::size_t size = 0;
  explicit DeviceVector(const std::vector<T>& host) : size(host.size()) {
    REQUIRE(cudaMalloc(&data, sizeof(T) * size + 1) == cudaSuccess);
    REQUIRE(cudaMemcpy(data, host.data(), sizeof(T) * size, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  explicit DeviceVector(std::size_t n) : DeviceVector(std::vector<T>(n)) {}
  ~DeviceVector() { cudaFree(data); }
  std::span<T> span() { return {data, size}; }
  std::vector<T> host() const {
    std::vector<T> out(size);
    REQUIRE(cudaMemcpy(out.data(), data, sizeof(T) * size, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

template <class T>
void check_nccl_ops(NcclComm& comm) {
  const int n = comm.size(), me = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  constexpr std::size_t count = 33;
  for (ReduceOp op : all_reduce_ops) {
    if (std::is_integral_v<T> && op == ReduceOp::avg)
      continue;  // NCCL's integer avg rounds its own way
    INFO("op " << name_of(op));
    DeviceVector<T> send(make_input<T>(me, count)), recv(count);
    comm.all_reduce(std::span<const T>(send.span()), recv.span(), op);
    std::vector<T> want(count);
    for (std::size_t i = 0; i < count; ++i) want[i] = expected_reduction<T>(op, n, i);
    CHECK(first_mismatch(recv.host(), want) == -1);

    DeviceVector<T> big(make_input<T>(me, count * un)), mine(count);
    comm.reduce_scatter(std::span<const T>(big.span()), mine.span(), op);
    for (std::size_t i = 0; i < count; ++i) {
      want[i] = expected_reduction<T>(op, n, static_cast<std::size_t>(me) * count + i);
    }
    CHECK(first_mismatch(mine.host(), want) == -1);
  }
  DeviceVector<T> one(make_input<T>(me, count)), all(count * un);
  auto work = comm.all_gather_async(std::span<const T>(one.span()), all.span());
  work.wait();
  std::vector<T> want_ag;
  for (int q = 0; q < n; ++q) append(want_ag, make_input<T>(q, count));
  CHECK(first_mismatch(all.host(), want_ag) == -1);

  DeviceVector<T> bc(make_input<T>(me, count));
  comm.broadcast(bc.span(), n - 1);
  CHECK(first_mismatch(bc.host(), make_input<T>(n - 1, count)) == -1);

  DeviceVector<T> a2a_send(make_input<T>(me, 3 * un)), a2a_recv(3 * un);
  comm.all_to_all(std::span<const T>(a2a_send.span()), a2a_recv.span());
  std::vector<T> want_a2a;
  for (int q = 0; q < n; ++q)
    append(want_a2a, make_input<T>(q, 3, static_cast<std::size_t>(me) * 3));
  CHECK(first_mismatch(a2a_recv.host(), want_a2a) == -1);

  if (n > 1) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    DeviceVector<T> out(make_input<T>(me, 5)), in(5);
    comm.group_start();
    comm.send(std::span<const T>(out.span()), right);
    comm.recv(in.span(), left);
    comm.group_end();
    CHECK(first_mismatch(in.host(), make_input<T>(left, 5)) == -1);
  }
  comm.barrier();
}

}  // namespace

TEMPLATE_TEST_CASE("NcclComm: ops match the closed forms on the world and a split", "[mpi][cuda]",
                   double, float, zero::bf16, std::int32_t, std::uint8_t) {
  if (!have_gpu()) {
    WARN("no CUDA device visible: NcclComm test skipped");
    return;
  }
  NcclComm world(MpiComm::world());
  check_nccl_ops<TestType>(world);
  auto halves = world.split(world.rank() % 2, world.rank(), "parity");
  // A split runs on its parent's stream: what orders one orders both.
  CHECK(halves.stream() == world.stream());
  check_nccl_ops<TestType>(halves);
}

// apply_comm_timeout sets a communicator's deadline only where options() and set_options()
// both exist: NcclComm had no options(), so comm_timeout_s never reached an NCCL engine.
static_assert(requires(NcclComm & c) { c.set_options(c.options()); });

TEST_CASE("NcclComm: options reach the MPI communicator under it, all_to_all is not in place",
          "[mpi][cuda]") {
  if (!have_gpu()) {
    WARN("no CUDA device visible: NcclComm test skipped");
    return;
  }
  NcclComm world(MpiComm::world());
  world.set_options(CommOptions{.timeout_s = 12.5});
  CHECK(world.options().timeout_s == 12.5);
  CHECK(world.mpi().options().timeout_s == 12.5);  // split's barrier and broadcast use it
  // In place, a peer's chunk could land on one not sent yet: refused, as LocalComm refuses it.
  const auto n = static_cast<std::size_t>(world.size());
  DeviceVector<float> buf(std::vector<float>(4 * n, 1.0f));
  CHECK_THROWS_AS(world.all_to_all(std::span<const float>(buf.span()), buf.span()), CommError);
  world.mpi().barrier();
}

TEST_CASE("NcclComm: the logger sees the ops and a withheld rank times out", "[mpi][cuda]") {
  if (!have_gpu()) {
    WARN("no CUDA device visible: NcclComm test skipped");
    return;
  }
  NcclComm world(MpiComm::world());
  auto logger = std::make_shared<CommLogger>();
  world.set_logger(logger);
  DeviceVector<float> v(std::vector<float>(256, 1.0f));
  world.all_reduce(v.span(), ReduceOp::sum);
  CHECK(logger->total(CommOp::all_reduce).bytes == 1024);
  CHECK(v.host()[17] == static_cast<float>(world.size()));
  if (world.size() > 1) {
    // A group's sends and receives are logged apart, as the other backends log them (its
    // receives were counted as sends).
    const int right = (world.rank() + 1) % world.size();
    const int left = (world.rank() + world.size() - 1) % world.size();
    DeviceVector<float> out(std::vector<float>(5, 2.0f)), in(5);
    world.group_start();
    world.send(std::span<const float>(out.span()), right);
    world.recv(in.span(), left);
    world.group_end();
    CHECK(logger->total(CommOp::send).bytes == 5 * sizeof(float));
    CHECK(logger->total(CommOp::recv).bytes == 5 * sizeof(float));
  }
  // Inside a group only sends and receives: a collective would complete before the group runs.
  world.group_start();
  CHECK_THROWS_AS(world.all_reduce(v.span(), ReduceOp::sum), CommError);
  world.group_end();
  if (world.size() > 1) {
    auto late = world.split(0, world.rank(), "late");
    // Every rank joins one op first: NCCL 2.22 and later connect a communicator's ranks inside
    // its first op, on the host and without a deadline, so a withheld first op would hang there.
    late.all_reduce(v.span(), ReduceOp::sum);
    late.set_options(CommOptions{.timeout_s = 1.0});
    if (world.rank() == 0) {
      CHECK_THROWS_AS(late.all_reduce(v.span(), ReduceOp::sum), CommError);  // aborted after
    }
    world.mpi().barrier();
  }
}
