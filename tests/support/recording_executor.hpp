#pragma once
// A FusedExecutor for host tests (optim/fused_executor.hpp): it runs each group's pass on the
// host's scalar path, one group per call, and counts the elements it was handed. A test can so
// tell an optimizer or engine that routed its passes through an executor (the count grows) from
// one that ran them on its own threads (the count stays 0), and, with `owns`, check that every
// pointer handed over is memory the executor's "device" made.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <variant>

#include <optim/cpu/fused_driver.hpp>
#include <optim/fused_executor.hpp>
#include <zero/core/error.hpp>

namespace zero::testing {

/// Runs passes on the host's scalar path and counts them (see the file comment).
class RecordingExecutor final : public optim::FusedExecutor {
 public:
  /// owns(p) says whether p is memory this executor may touch; empty: any.
  explicit RecordingExecutor(std::function<bool(const void*)> owns = {}) : owns_(std::move(owns)) {}

  const char* where() const override { return "a test executor"; }
  void run(std::span<const optim::AnyRule> rules, std::span<const optim::Range> ranges,
           const optim::FusedIo& io, std::span<float* const> states,
           std::uint32_t step) const override {
    for (std::size_t k = 0; k < rules.size(); ++k) {
      std::visit(
          [&]<class Rule>(const Rule& rule) {
            if (ranges[k].count == 0) return;
            expect_owned(io.param, "the master");
            if constexpr (Rule::reads_grad) expect_owned(io.grad, "the gradient");
            for (int j = 0; j < Rule::states; ++j) expect_owned(states[j], "a state");
            const Rule one[1] = {rule};
            const optim::Range range[1] = {ranges[k]};
            optim::run_fused<Rule>(one, range, io, states, step,
                                   optim::StepOptions{optim::Isa::scalar, 1});
            elements += ranges[k].count;
          },
          rules[k]);
    }
  }

  /// Elements of every pass run so far.
  mutable std::atomic<std::size_t> elements = 0;

 private:
  void expect_owned(const void* p, const char* what) const {
    expect<Error>(!owns_ || owns_(p), "RecordingExecutor: ", what,
                  " is not in memory the executor's device made");
  }
  std::function<bool(const void*)> owns_;
};

}  // namespace zero::testing
