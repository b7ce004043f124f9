#pragma once
// BlockingCollectives<Derived>: the blocking collectives of a backend whose every collective has
// an async form, written once as "start the async op, wait for it". MpiComm and NcclComm derive
// from it; send/recv/barrier stay in the backends because grouping changes their meaning.

#include <cstddef>
#include <span>
#include <type_traits>

#include <parallel/comm/reduce_op.hpp>

namespace zero::parallel {

/// Mixin (CRTP) giving Derived blocking collectives over its *_async members.
template <class Derived>
class BlockingCollectives {
 public:
  /// recv[i] = op over ranks of send[i]; send and recv may be the same span.
  template <CommElement T>
  void all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, ReduceOp op) {
    self().template all_reduce_async<T>(send, recv, op).wait();
  }
  /// In-place all_reduce of buf.
  template <CommElement T>
  void all_reduce(std::span<T> buf, ReduceOp op) {
    self().template all_reduce_async<T>(buf, buf, op).wait();
  }
  /// recv (count) = op over ranks of chunk rank() of send (size()*count).
  template <CommElement T>
  void reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                      ReduceOp op) {
    self().template reduce_scatter_async<T>(send, recv, op).wait();
  }
  /// Chunk q of recv (size()*count) = send (count) of rank q.
  template <CommElement T>
  void all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    self().template all_gather_async<T>(send, recv).wait();
  }
  /// Every rank's buf = root's buf.
  template <CommElement T>
  void broadcast(std::span<T> buf, int root) {
    self().template broadcast_async<T>(buf, root).wait();
  }
  /// Chunk q of recv = chunk rank() of rank q's send.
  template <CommElement T>
  void all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv) {
    self().template all_to_all_async<T>(send, recv).wait();
  }
  /// Variable all_to_all (counts per rank, chunks packed in rank order).
  template <CommElement T>
  void all_to_all_v(std::span<const std::type_identity_t<T>> send,
                    std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) {
    self().template all_to_all_v_async<T>(send, send_counts, recv, recv_counts).wait();
  }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

}  // namespace zero::parallel
