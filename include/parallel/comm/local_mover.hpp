#pragma once
// The memory a LocalComm's ranks exchange, as a policy: BasicLocalComm<Mover> runs the same
// rendezvous, validation and deadlines over any memory, and asks its Mover for every byte it
// moves. HostMover (here) moves host memory with memcpy and the rank-order fold of
// reduce_op.hpp: that is LocalComm. CudaMover (cuda_local_comm.cuh) moves device memory with
// copies and a fold kernel on a per-rank stream: that is CudaLocalComm, N ranks as threads
// sharing one GPU, which NCCL refuses.
//
// A Mover is made once per rank and per split group, on the rank's thread, from the Place
// current_place() returned on the thread that called run (the device, for CudaMover). Its calls
// around one collective:
//   begin(ctx, deadline)  the rank's buffers are ready to be read by every rank (for a device:
//                         the work ordered before the op on the mover's stream has finished);
//   copy / reduce ...     the rank's own share of the data movement, on any rank's buffers;
//   end(ctx, deadline)    that movement has finished (before the release frees the
//                         buffers to their owners).
// to_host / from_host (ctx, deadline) move a point-to-point message through the host mailbox
// and have finished when they return. Every wait past the deadline is a CommError naming the op.

#include <concepts>
#include <cstddef>
#include <cstring>
#include <string_view>

#include <parallel/comm/comm_options.hpp>
#include <parallel/comm/local_world.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <zero/core/dtype.hpp>

namespace zero::parallel {

// clang-format off
/// What BasicLocalComm needs of the memory its ranks exchange (see the file comment).
template <class M>
concept LocalMover =
    requires(M& m, const M& cm, const detail::OpContext& ctx, CommClock::time_point deadline,
             void* dst, const void* src, std::size_t bytes, const float* const* in,
             float* const* out, ReduceOp op) {
      typename M::Place;
      { M::comm_name } -> std::convertible_to<std::string_view>;
      { M::max_ranks } -> std::convertible_to<int>;
      { M::current_place() } -> std::same_as<typename M::Place>;
      { cm.place() } -> std::same_as<typename M::Place>;
      m.begin(ctx, deadline);
      m.copy(dst, src, bytes);
      m.reduce(op, in, 2, bytes, out, 2);
      m.end(ctx, deadline);
      m.to_host(dst, src, bytes, ctx, deadline);
      m.from_host(dst, src, bytes, ctx, deadline);
    };
// clang-format on

/// Host memory: plain copies and reduce_in_rank_order; nothing to wait for.
class HostMover {
 public:
  /// Where a rank's memory lives: nowhere in particular on the host.
  struct Place {};
  /// The prefix of this communicator's errors.
  static constexpr std::string_view comm_name = "LocalComm";
  /// As many ranks as threads.
  static constexpr int max_ranks = 1 << 20;

  /// The place of the calling thread.
  static Place current_place() { return {}; }
  /// A mover for place.
  explicit HostMover(Place = {}) {}
  /// The place this mover was made for.
  Place place() const { return {}; }

  /// Host buffers are ready once posted.
  void begin(const detail::OpContext&, CommClock::time_point) {}
  /// dst[0, bytes) = src[0, bytes).
  void copy(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  /// outputs[o][i] = op over ranks, in rank order, of inputs[r][i] (reduce_in_rank_order).
  template <class T>
  void reduce(ReduceOp op, const T* const* inputs, int ranks, std::size_t count, T* const* outputs,
              int n_outputs) {
    reduce_in_rank_order<T>(op, inputs, ranks, count, outputs, n_outputs);
  }
  /// Every move above finished when it returned.
  void end(const detail::OpContext&, CommClock::time_point) {}
  /// dst (host) = src (a rank's buffer).
  void to_host(void* dst, const void* src, std::size_t bytes, const detail::OpContext&,
               CommClock::time_point) {
    std::memcpy(dst, src, bytes);
  }
  /// dst (a rank's buffer) = src (host).
  void from_host(void* dst, const void* src, std::size_t bytes, const detail::OpContext&,
                 CommClock::time_point) {
    std::memcpy(dst, src, bytes);
  }
};

static_assert(LocalMover<HostMover>);

}  // namespace zero::parallel
