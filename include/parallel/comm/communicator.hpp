#pragma once
// The Communicator concept: what LocalComm, MpiComm and NcclComm provide, checked at compile
// time so a missing op is a compile error, not a run-time "not supported".
//
// Buffers are flat spans (host memory for LocalComm/MpiComm, device memory for NcclComm):
//   all_reduce(send[count], recv[count], op)         in place when both are the same span
//   reduce_scatter(send[size*count], recv[count], op) rank r gets the reduction of chunk r
//   all_gather(send[count], recv[size*count])        chunk q of recv is rank q's send
//   broadcast(buf[count], root)
//   all_to_all(send[size*count], recv[size*count])   chunk q of send goes to rank q
//   all_to_all_v(send, send_counts[size], recv, recv_counts[size])  chunks packed in rank order
//   send(buf, peer, tag), recv(buf, peer, tag), barrier()
// Each op has an *_async form returning a Work handle. Every rank of a group must issue the
// same collectives in the same order. A rank's async ops may run in issue order (LocalComm's
// progress thread, NcclComm's stream): a recv_async holds up the ops issued after it until its
// message arrives, so two ranks that each post recv_async to the other before send_async can
// deadlock. Post an exchange's sends first, as the pipeline executor does (NcclComm and
// LocalComm also take it between group_start and group_end, NCCL's grouped point-to-point).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include <parallel/comm/reduce_op.hpp>
#include <parallel/comm/work.hpp>

namespace zero::parallel {

/// The color a rank passes to split() to join no group (MPI_UNDEFINED); it gets a null comm.
inline constexpr int undefined_color = -1;

// Hand-formatted: clang-format 14 puts a requires-expression that follows `&&` at odd indents.
// clang-format off
/// A communicator that moves elements of type T with every collective, blocking and async.
template <class C, class T>
concept CommunicatorFor =
    CommElement<T> &&
    requires(C& c, const C& cc, std::span<T> buf, std::span<const T> in,
             std::span<const std::size_t> counts, ReduceOp op, int peer) {
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      { c.split(0, 0) } -> std::same_as<C>;
      c.all_reduce(in, buf, op);
      c.all_reduce(buf, op);
      c.reduce_scatter(in, buf, op);
      c.all_gather(in, buf);
      c.broadcast(buf, peer);
      c.all_to_all(in, buf);
      c.all_to_all_v(in, counts, buf, counts);
      c.send(in, peer, 0);
      c.recv(buf, peer, 0);
      c.barrier();
      { c.all_reduce_async(in, buf, op) } -> std::same_as<Work>;
      { c.reduce_scatter_async(in, buf, op) } -> std::same_as<Work>;
      { c.all_gather_async(in, buf) } -> std::same_as<Work>;
      { c.broadcast_async(buf, peer) } -> std::same_as<Work>;
      { c.all_to_all_async(in, buf) } -> std::same_as<Work>;
      { c.all_to_all_v_async(in, counts, buf, counts) } -> std::same_as<Work>;
      { c.send_async(in, peer, 0) } -> std::same_as<Work>;
      { c.recv_async(buf, peer, 0) } -> std::same_as<Work>;
      { c.barrier_async() } -> std::same_as<Work>;
    };

/// A communicator for every CommElement type (f64, f32, bf16, f16, i32, i64, u8).
template <class C>
concept Communicator =
    CommunicatorFor<C, double> && CommunicatorFor<C, float> && CommunicatorFor<C, bf16> &&
    CommunicatorFor<C, f16> && CommunicatorFor<C, std::int32_t> &&
    CommunicatorFor<C, std::int64_t> && CommunicatorFor<C, std::uint8_t>;
// clang-format on

}  // namespace zero::parallel
