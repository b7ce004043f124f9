#pragma once
// HostValueComm: the engine's collectives on values the host holds (a step's statistics, a
// program's own sums, a checkpoint's sizes, text and outcome, an exported unit's parts) over a
// communicator of the engine's memory. Where the communicator reads host memory (the backend's
// comm_reads_host_memory: LocalComm, MpiComm) they go to it directly; a device engine's
// communicator may move device memory only (NcclComm), so there each op copies its input into
// buffers the backend makes, runs on them, and copies the result back. A CheckpointComm, so
// checkpoint::save and checkpoint::load run over it.

#include <cstdint>
#include <span>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/reduce_op.hpp>

namespace zero::engine {

/// Collectives on host values over comm, staged through Backend's buffers where comm cannot
/// read host memory (see the file comment). Holds references: it lives for the calls it serves.
template <class Backend>
class HostValueComm {
 public:
  HostValueComm(parallel::AnyComm& comm, Backend& backend) : comm_(comm), backend_(backend) {}

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  /// values = op over the ranks of values, on every rank.
  template <class E>
  void all_reduce(std::span<E> values, parallel::ReduceOp op) {
    if constexpr (Backend::comm_reads_host_memory) {
      comm_.all_reduce(values, op);
    } else {
      auto staged = stage(std::span<const E>(values));
      backend_.comm_waits_for_compute();
      comm_.all_reduce(span(staged), op);
      finish(values, staged);
    }
  }
  /// out = every rank's in, rank after rank (out has size() times in's elements).
  template <class E>
  void all_gather(std::span<const E> in, std::span<E> out) {
    if constexpr (Backend::comm_reads_host_memory) {
      comm_.all_gather(in, out);
    } else {
      auto staged_in = stage(in);
      auto staged_out = backend_.template make_buffer<E>(out.size());
      backend_.comm_waits_for_compute();
      comm_.all_gather(std::span<const E>(span(staged_in)), span(staged_out));
      finish(out, staged_out);
    }
  }
  /// values = root's values, on every rank.
  template <class E>
  void broadcast(std::span<E> values, int root) {
    if constexpr (Backend::comm_reads_host_memory) {
      comm_.broadcast(values, root);
    } else {
      auto staged = stage(std::span<const E>(values));
      backend_.comm_waits_for_compute();
      comm_.broadcast(span(staged), root);
      finish(values, staged);
    }
  }

 private:
  template <class E>
  using Staged = typename Backend::template DeviceBuffer<E>;
  template <class E>
  static std::span<E> span(Staged<E>& b) {
    return std::span<E>(b.data(), b.size());
  }
  // A buffer of the backend's memory holding values (the copy is done when this returns).
  template <class E>
  Staged<E> stage(std::span<const E> values) {
    Staged<E> b = backend_.template make_buffer<E>(values.size());
    backend_.copy_from_host(span(b), values);
    return b;
  }
  // values = what the collective left in staged, once compute is ordered after it.
  template <class E>
  void finish(std::span<E> values, Staged<E>& staged) {
    backend_.compute_waits_for_comm();
    backend_.copy_to_host(values, std::span<const E>(span(staged)));
  }

  parallel::AnyComm& comm_;
  Backend& backend_;
};

}  // namespace zero::engine
