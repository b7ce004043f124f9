#pragma once
// zero-requires: cuda
// CudaLocalComm: LocalComm's ranks-as-threads over device memory, so every collective the engine
// runs on NCCL can be tested with N ranks on one GPU (NCCL refuses two ranks on one device).
// It is BasicLocalComm<CudaMover>: the same rendezvous, validation, rank order and deadlines as
// LocalComm (local_comm.hpp); only the moves differ.
//
// Each rank's mover owns a non-blocking stream on the device that was current when run was
// called, which the rank's splits share (as NcclComm's do: a backend that orders the stream
// after its compute orders every group's ops). Make it wait for the producers of a rank's buffers
// before issuing an op on them (cudaStreamWaitEvent on mover().stream()), as with
// NcclComm::stream(). An op then:
//   1. waits, from the host, for that stream: the rank's inputs are final;
//   2. meets the other ranks; each enqueues its own share of the movement on its stream
//      (cudaMemcpyAsync between any ranks' buffers, and a fold kernel that reduces in rank order
//      with reduce_op.hpp's fold and finish_reduce, so results equal LocalComm's bit for bit);
//   3. waits for its stream again, then meets the others a second time, after which every rank's
//      buffers are back to their owners.
// Both waits poll against the op's deadline: a hung stream is a CommError naming the op, as a
// missing rank is. An op's Work therefore completes only once its data is on the device, so
// later work on any stream may read it. Point-to-point messages go through the host mailbox
// (a device-to-host copy on send, host-to-device on receive).
#if !defined(__CUDACC__)
#error "parallel/comm/cuda_local_comm.cuh needs nvcc; host-only code uses local_comm.hpp"
#endif

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <thread>

#include <cuda_runtime.h>

#include <parallel/comm/comm_options.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/comm/local_mover.hpp>
#include <parallel/comm/local_world.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <zero/core/cuda_check.cuh>
#include <zero/core/cuda_device.cuh>
#include <zero/core/error.hpp>
#include <zero/ops/cuda/common.cuh>

namespace zero::parallel {

namespace cuda_local_detail {

/// The most ranks a CudaLocalComm group holds: every rank's pointer travels in the fold kernel's
/// parameters.
inline constexpr int max_ranks = 32;

/// The buffers of one fold, by value in the kernel's parameters (512 bytes).
template <class T>
struct RankPointers {
  const T* inputs[max_ranks];
  T* outputs[max_ranks];
};

/// outputs[o][i] = finish(op, ((inputs[0][i] op inputs[1][i]) op ...)) in accumulate_t<T>, one
/// element per thread: reduce_in_rank_order's rule, element by element. An output may alias an
/// input only at the same index (in place), which each thread reads before it writes.
template <ReduceOp Op, class T>
__global__ void fold_ranks_kernel(RankPointers<T> p, int ranks, int n_outputs, std::int64_t count) {
  using Acc = accumulate_t<T>;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    Acc acc = ::zero::convert<Acc>(p.inputs[0][i]);
    for (int r = 1; r < ranks; ++r) acc = fold<Op>(acc, ::zero::convert<Acc>(p.inputs[r][i]));
    const T value = ::zero::convert<T>(finish_reduce<Op>(acc, ranks));
    for (int o = 0; o < n_outputs; ++o) p.outputs[o][i] = value;
  }
}

}  // namespace cuda_local_detail

/// Device memory on one GPU shared by every rank (see the file comment).
class CudaMover {
 public:
  /// The device the ranks' buffers live on, and the stream a rank's moves run on: none for a
  /// new rank (its mover makes one), its parent's for a split (place() carries it).
  struct Place {
    int device = 0;
    std::shared_ptr<const CudaStream> stream;
  };
  /// The prefix of this communicator's errors.
  static constexpr std::string_view comm_name = "CudaLocalComm";
  /// Every rank's pointer fits the fold kernel's parameters.
  static constexpr int max_ranks = cuda_local_detail::max_ranks;

  /// The calling thread's current device.
  static Place current_place() {
    Place place;
    ZERO_CUDA_CHECK(cudaGetDevice(&place.device));
    return place;
  }
  /// Makes place's device current on this thread and a non-blocking stream on it, unless place
  /// brings one.
  explicit CudaMover(Place place)
      : place_{place.device, place.stream ? std::move(place.stream) : make_stream(place)} {}
  /// The place this mover was made for, with its stream (a split's mover shares it).
  Place place() const { return place_; }
  /// The stream this rank's moves run on; order the producers of its buffers before it.
  cudaStream_t stream() const { return place_.stream->native(); }

  /// Waits until the work ordered on the stream before this op has finished.
  void begin(const detail::OpContext& ctx, CommClock::time_point deadline) {
    enter();
    wait(ctx, deadline, "the work ordered before it on the rank's stream");
  }
  /// Enqueues dst = src (any ranks' device buffers).
  void copy(void* dst, const void* src, std::size_t bytes) {
    enter();
    ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()));
  }
  /// Enqueues the rank-order fold of inputs[0..ranks) into outputs[0..n_outputs).
  template <class T>
  void reduce(ReduceOp op, const T* const* inputs, int ranks, std::size_t count, T* const* outputs,
              int n_outputs) {
    expect<CommError>(ranks >= 1 && ranks <= max_ranks && n_outputs >= 0 && n_outputs <= max_ranks,
                      comm_name, ": a fold over ", ranks, " ranks into ", n_outputs,
                      " outputs; at most ", max_ranks, " of each");
    if (count == 0) return;
    enter();
    cuda_local_detail::RankPointers<T> p{};
    for (int r = 0; r < ranks; ++r) p.inputs[r] = inputs[r];
    for (int o = 0; o < n_outputs; ++o) p.outputs[o] = outputs[o];
    const auto n = static_cast<std::int64_t>(count);
    visit_reduce_op(op, [&]<ReduceOp Op>() {
      cuda_local_detail::fold_ranks_kernel<Op, T>
          <<<ops::cuda::grid_for(n), ops::cuda::elementwise_threads, 0, stream()>>>(p, ranks,
                                                                                    n_outputs, n);
    });
    ZERO_CUDA_CHECK(cudaGetLastError());
  }
  /// Waits until this rank's moves have finished.
  void end(const detail::OpContext& ctx, CommClock::time_point deadline) {
    wait(ctx, deadline, "its own copies and folds");
  }
  /// dst (host) = src (device), finished on return (or a CommError past deadline). The stream's
  /// earlier work is waited for first: a copy into pageable memory returns only once it is done,
  /// so issued behind a kernel that never finishes it would block where no deadline reaches.
  void to_host(void* dst, const void* src, std::size_t bytes, const detail::OpContext& ctx,
               CommClock::time_point deadline) {
    wait(ctx, deadline, "the work ordered before its message's copy to the host");
    copy(dst, src, bytes);
    wait(ctx, deadline, "its message's copy to the host");
  }
  /// dst (device) = src (host), finished on return (or a CommError past deadline), after the
  /// stream's earlier work as to_host.
  void from_host(void* dst, const void* src, std::size_t bytes, const detail::OpContext& ctx,
                 CommClock::time_point deadline) {
    wait(ctx, deadline, "the work ordered before its message's copy from the host");
    copy(dst, src, bytes);
    wait(ctx, deadline, "its message's copy from the host");
  }

 private:
  static std::shared_ptr<const CudaStream> make_stream(const Place& place) {
    ZERO_CUDA_CHECK(cudaSetDevice(place.device));
    return std::make_shared<const CudaStream>();
  }
  /// Ops run on the rank's thread or its progress thread: both must be on the device.
  void enter() const { ZERO_CUDA_CHECK(cudaSetDevice(place_.device)); }
  /// Polls the stream until it is idle; past deadline, a CommError naming the op.
  void wait(const detail::OpContext& ctx, CommClock::time_point deadline,
            std::string_view what) const {
    for (;;) {
      const cudaError_t status = cudaStreamQuery(stream());
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) ZERO_CUDA_CHECK(status);
      if (CommClock::now() >= deadline) {
        raise<CommError>(comm_name, ": ", ctx.describe(), " passed its deadline waiting for ", what,
                         " on device ", place_.device,
                         "; raise CommOptions::timeout_s if the work is legitimately slow");
      }
      std::this_thread::yield();
    }
  }

  Place place_;  // with the stream
};

static_assert(LocalMover<CudaMover>);

/// N ranks as threads sharing one GPU (see the file comment).
using CudaLocalComm = BasicLocalComm<CudaMover>;

static_assert(Communicator<CudaLocalComm>);

}  // namespace zero::parallel
