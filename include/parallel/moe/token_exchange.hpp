#pragma once
// The all-to-all token exchange of an expert-parallel MoE layer (Megatron's all-to-all token
// dispatcher, with DeepSpeed's capacity and dropping already applied by the router):
//
//   exchange_counts  an all_to_all of each rank's row count per global expert [E], so every
//                    rank knows how many rows each source sends each of its local experts;
//   dispatch         all_to_all_v of the rows (this rank's rows grouped by global expert, so
//                    the rows for rank q are contiguous), then a local regroup from
//                    [source][local expert] to [local expert][source]: each local expert's rows
//                    are consecutive, ready for its MLP;
//   combine          the inverse: regroup to [source][local expert], all_to_all_v back.
//
// Only kept rows travel (no capacity padding): per rank and MoE layer, a forward sends
// 8 E bytes of counts plus (R + R_e) C elements of rows, and a backward (R + R_e) C more,
// where R is the rows this rank routed and R_e the rows its experts received. The backward of
// dispatch is combine's pattern and vice versa, so the same two functions serve both passes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// Who sends which rows where in one MoE layer's exchange (see the file comment).
struct ExpertRows {
  int ranks = 1;                       ///< ep
  int local = 1;                       ///< experts per rank, E / ep
  std::vector<std::int64_t> sent;      ///< [E] rows this rank sends each global expert
  std::vector<std::int64_t> received;  ///< [ranks * local] rows from source s for local expert l
  std::vector<std::int64_t> expert_first;   ///< [local + 1] first row of each local expert
  std::int64_t rows_sent = 0;               ///< R: the sum of sent
  std::vector<std::size_t> send_counts;     ///< [ranks] elements to each rank (all_to_all_v)
  std::vector<std::size_t> receive_counts;  ///< [ranks] elements from each rank

  /// Rows this rank's experts receive (R_e).
  std::int64_t rows_received() const { return expert_first.back(); }
  /// Rows received for local expert l.
  std::int64_t expert_rows(int l) const {
    return expert_first[static_cast<std::size_t>(l) + 1] -
           expert_first[static_cast<std::size_t>(l)];
  }
};

/// Exchanges the row counts: sent[e] is how many rows of C elements this rank routes to global
/// expert e (E = ep * local entries). A collective over ep.
inline ExpertRows exchange_counts(AnyComm& ep, std::span<const std::int64_t> sent, std::int64_t C) {
  ExpertRows x;
  x.ranks = ep.size();
  const auto E = static_cast<int>(sent.size());
  expect<ShapeError>(E % x.ranks == 0, "exchange_counts: ", E, " experts over ", x.ranks,
                     " expert-parallel ranks");
  x.local = E / x.ranks;
  x.sent.assign(sent.begin(), sent.end());
  x.received.assign(sent.size(), 0);
  ep.all_to_all(std::span<const std::int64_t>(x.sent), std::span<std::int64_t>(x.received));
  x.expert_first.assign(static_cast<std::size_t>(x.local) + 1, 0);
  x.send_counts.assign(static_cast<std::size_t>(x.ranks), 0);
  x.receive_counts.assign(static_cast<std::size_t>(x.ranks), 0);
  for (int q = 0; q < x.ranks; ++q) {
    for (int l = 0; l < x.local; ++l) {
      const auto i = static_cast<std::size_t>(q * x.local + l);
      x.rows_sent += x.sent[i];
      x.send_counts[static_cast<std::size_t>(q)] += static_cast<std::size_t>(x.sent[i] * C);
      x.receive_counts[static_cast<std::size_t>(q)] += static_cast<std::size_t>(x.received[i] * C);
      x.expert_first[static_cast<std::size_t>(l) + 1] += x.received[i];
    }
  }
  for (int l = 0; l < x.local; ++l) {  // counts per expert -> first rows
    x.expert_first[static_cast<std::size_t>(l) + 1] += x.expert_first[static_cast<std::size_t>(l)];
  }
  return x;
}

namespace detail {
// Copies rows between the [source][local expert] order the all-to-all delivers (`by_source`)
// and the [local expert][source] order the experts read (`by_expert`), C elements per row.
template <class T>
void regroup_rows(const ExpertRows& x, T* by_source, T* by_expert, std::int64_t C,
                  bool to_experts) {
  std::int64_t at = 0;  // row in by_source
  for (int s = 0; s < x.ranks; ++s) {
    for (int l = 0; l < x.local; ++l) {
      const std::int64_t n = x.received[static_cast<std::size_t>(s * x.local + l)];
      // Rows from sources before s come first among expert l's rows.
      std::int64_t dst = x.expert_first[static_cast<std::size_t>(l)];
      for (int p = 0; p < s; ++p) dst += x.received[static_cast<std::size_t>(p * x.local + l)];
      T* a = by_source + at * C;
      T* b = by_expert + dst * C;
      if (to_experts) {
        std::copy(a, a + n * C, b);
      } else {
        std::copy(b, b + n * C, a);
      }
      at += n;
    }
  }
}
}  // namespace detail

/// Sends rows [R, C] (grouped by global expert, as counted in x.sent) to their experts' ranks;
/// expert_rows [R_e, C] receives the local experts' rows, expert by expert. scratch holds R_e * C
/// elements. A collective over ep.
template <class T>
void dispatch(AnyComm& ep, const ExpertRows& x, const T* rows, T* expert_rows, T* scratch,
              std::int64_t C) {
  const auto R = static_cast<std::size_t>(x.rows_sent * C);
  const auto Re = static_cast<std::size_t>(x.rows_received() * C);
  ep.all_to_all_v(std::span<const T>(rows, R), std::span<const std::size_t>(x.send_counts),
                  std::span<T>(scratch, Re), std::span<const std::size_t>(x.receive_counts));
  detail::regroup_rows(x, scratch, expert_rows, C, /*to_experts=*/true);
}

/// The inverse of dispatch: sends the experts' rows [R_e, C] back to the ranks that routed them;
/// rows [R, C] receives them in this rank's routing order. scratch holds R_e * C elements.
template <class T>
void combine(AnyComm& ep, const ExpertRows& x, T* expert_rows, T* rows, T* scratch,
             std::int64_t C) {
  const auto R = static_cast<std::size_t>(x.rows_sent * C);
  const auto Re = static_cast<std::size_t>(x.rows_received() * C);
  detail::regroup_rows(x, scratch, expert_rows, C, /*to_experts=*/false);
  ep.all_to_all_v(std::span<const T>(scratch, Re), std::span<const std::size_t>(x.receive_counts),
                  std::span<T>(rows, R), std::span<const std::size_t>(x.send_counts));
}

}  // namespace zero::parallel
