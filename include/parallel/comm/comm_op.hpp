#pragma once
// The kinds of communication operation, their names, and nccl-tests' bus-bandwidth factors
// (doc/PERFORMANCE.md), shared by the logger, error messages and the benchmark.

#include <cstdint>
#include <string_view>

namespace zero::parallel {

/// One kind of communication operation (NCCL's names).
enum class CommOp : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  all_to_all,
  all_to_all_v,
  send,
  recv,
  barrier,
  split,
};

/// Number of CommOp values (for tables indexed by op).
inline constexpr int comm_op_count = 10;

/// snake_case name of op, as in the API ("all_reduce", ...).
constexpr std::string_view name_of(CommOp op) {
  switch (op) {
    case CommOp::all_reduce:
      return "all_reduce";
    case CommOp::reduce_scatter:
      return "reduce_scatter";
    case CommOp::all_gather:
      return "all_gather";
    case CommOp::broadcast:
      return "broadcast";
    case CommOp::all_to_all:
      return "all_to_all";
    case CommOp::all_to_all_v:
      return "all_to_all_v";
    case CommOp::send:
      return "send";
    case CommOp::recv:
      return "recv";
    case CommOp::barrier:
      return "barrier";
    case CommOp::split:
      return "split";
  }
  return "?";
}

/// busbw = algbw * factor (nccl-tests): all_reduce 2(n-1)/n; reduce_scatter, all_gather and
/// all_to_all (n-1)/n, with algbw measured on the whole n*count buffer; 1 for the rest. The
/// factor turns algorithm bandwidth into the per-link bandwidth a ring would need.
constexpr double bus_factor(CommOp op, int ranks) {
  if (ranks <= 1)
    return op == CommOp::all_reduce || op == CommOp::reduce_scatter || op == CommOp::all_gather ||
                   op == CommOp::all_to_all || op == CommOp::all_to_all_v
               ? 0.0
               : 1.0;
  const double n = ranks;
  switch (op) {
    case CommOp::all_reduce:
      return 2.0 * (n - 1.0) / n;
    case CommOp::reduce_scatter:
    case CommOp::all_gather:
    case CommOp::all_to_all:
    case CommOp::all_to_all_v:
      return (n - 1.0) / n;
    default:
      return 1.0;
  }
}

}  // namespace zero::parallel
