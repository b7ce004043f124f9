#pragma once
// StageExecutor: runs one pipeline rank's instruction list (schedule.hpp) with its Engine's
// passes (Engine::forward_pass / backward_pass) and point-to-point messages on the pipeline
// group. Per micro-batch and chunk it keeps only what crosses the stage boundary: the input
// activation (received, or the tokens at virtual stage 0) from its forward until its backward,
// and the gradient received for its output until that backward. Layers keep the saved
// activations of one forward, so a forward that is not followed directly by its own backward
// is discarded once its output was copied out, and run again from the kept input just before
// the backward (GPipe's rematerialisation; the same dropout masks, which follow the
// micro-batch). Peak memory is therefore the schedule's live activations times one stage-input
// tensor, plus one micro-batch's activations inside the stage.
// Messages: each activation or gradient is a header (rank and extents) and the payload, tagged
// by kind, so any shape crosses. A group of comm instructions (grouped_with_next) is posted
// together, sends first, and waited on together, as an NCCL group: the static checker proved
// the schedule free of deadlock under those semantics, and posting sends first only removes
// waits.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/work.hpp>
#include <parallel/pipeline/schedule.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/micro_step.hpp>

namespace zero::parallel::pipeline {

/// Tags of the messages between stages: a header (rank, extents) then the payload, per kind.
enum BoundaryTag : int {
  activation_header_tag = 11,
  activation_tag = 12,
  gradient_header_tag = 13,
  gradient_tag = 14
};
/// A boundary tensor's header: its rank, then its extents.
using BoundaryHeader = std::array<std::int64_t, Shape::max_rank + 1>;

/// The header describing shape.
inline BoundaryHeader boundary_header(const Shape& shape) {
  BoundaryHeader h{};
  h[0] = shape.rank();
  for (int d = 0; d < shape.rank(); ++d) h[static_cast<std::size_t>(d) + 1] = shape[d];
  return h;
}

/// Sends t to peer as an activation (or a gradient) and waits until it left.
template <class T>
void send_boundary(AnyComm& comm, Tensor<const T> t, int peer, bool activation) {
  const BoundaryHeader h = boundary_header(t.shape());
  Work header = comm.send_async(std::span<const std::int64_t>(h), peer,
                                activation ? activation_header_tag : gradient_header_tag);
  Work payload = comm.send_async(std::span<const T>(t.data(), static_cast<std::size_t>(t.numel())),
                                 peer, activation ? activation_tag : gradient_tag);
  header.wait();
  payload.wait();
}
/// Receives an activation (or a gradient) from peer into `into`; returns its shape.
template <class T>
Shape recv_boundary(AnyComm& comm, std::vector<T>& into, int peer, bool activation) {
  BoundaryHeader h{};
  comm.recv_async(std::span<std::int64_t>(h), peer,
                  activation ? activation_header_tag : gradient_header_tag)
      .wait();
  const Shape shape = Shape::of(h.data() + 1, static_cast<int>(h[0]));
  into.assign(static_cast<std::size_t>(shape.numel()), T{});
  comm.recv_async(std::span<T>(into), peer, activation ? activation_tag : gradient_tag).wait();
  return shape;
}

/// What one run of a stage's list measured.
struct StageRun {
  double loss_sum = 0.0;          ///< sum of the micro-batches' losses (last virtual stage only)
  int losses = 0;                 ///< micro-batches whose loss this stage computed
  double busy_s = 0.0;            ///< seconds spent in forward and backward passes
  double wall_s = 0.0;            ///< seconds from the first instruction to the last
  int recomputed_forwards = 0;    ///< forwards run again before their backward
  int peak_live_activations = 0;  ///< most stage inputs held at once
};

/// Runs one pipeline rank's instructions over an engine of its StageModel (see file comment).
template <class Eng, class Stage>
class StageExecutor {
 public:
  using T = typename Eng::T;

  /// Rank stage of pp on the pipeline group pp_group (its rank there is the stage).
  StageExecutor(Eng& engine, const Stage& stage_model, AnyComm pp_group, int stage, int pp)
      : engine_(engine),
        stage_model_(stage_model),
        comm_(std::move(pp_group)),
        stage_(stage),
        pp_(pp),
        chunks_(stage_model.num_chunks()) {}

  /// Runs list over batches (one per micro-batch of the window; every stage gets the same
  /// batches: virtual stage 0 reads the tokens, the last the targets).
  StageRun run(std::span<const Instruction> list, std::span<const engine::MicroBatch> batches) {
    micro_ = static_cast<int>(batches.size());
    slots_.assign(static_cast<std::size_t>(micro_ * chunks_), Slot{});
    open_ = -1;
    StageRun out;
    const auto start = clock::now();
    live_ = 0;
    for (std::size_t i = 0; i < list.size();) {
      const Instruction& in = list[i];
      if (is_compute(in.op)) {
        const auto t0 = clock::now();
        compute(list, i, batches, out);
        out.busy_s += seconds(clock::now() - t0);
        ++i;
        continue;
      }
      std::size_t end = i;
      while (end + 1 < list.size() && list[end].grouped_with_next && !is_compute(list[end + 1].op))
        ++end;
      communicate(list.subspan(i, end + 1 - i));
      i = end + 1;
    }
    out.wall_s = seconds(clock::now() - start);
    out.peak_live_activations = peak_live_;
    return out;
  }

 private:
  using clock = std::chrono::steady_clock;
  static double seconds(clock::duration d) { return std::chrono::duration<double>(d).count(); }

  // What crosses the stage boundary for one (micro-batch, chunk).
  struct Slot {
    std::vector<T> input;  // the activation entering the chunk (empty at virtual stage 0)
    Shape input_shape;
    std::vector<T> output_grad;  // the gradient at the chunk's output (empty at the last)
    Shape output_grad_shape;
    std::vector<T> to_send;  // output activation or input gradient, kept until sent
    Shape to_send_shape;
    BoundaryHeader header{};
    bool forward_done = false, backward_done = false, holds_input = false;
  };

  Slot& slot(int micro, int chunk) {
    expect<Error>(0 <= micro && micro < micro_ && 0 <= chunk && chunk < chunks_,
                  "pipeline executor: stage ", stage_, ": micro-batch ", micro, " chunk ", chunk,
                  " is outside the ", micro_, " micro-batches and ", chunks_, " chunks");
    return slots_[static_cast<std::size_t>(micro * chunks_ + chunk)];
  }
  int virtual_stage(int chunk) const { return chunk * pp_ + stage_; }
  bool first_virtual(int chunk) const { return virtual_stage(chunk) == 0; }
  bool last_virtual(int chunk) const { return virtual_stage(chunk) == pp_ * chunks_ - 1; }
  static Tensor<T> view(std::vector<T>& data, const Shape& shape) {
    return data.empty() ? Tensor<T>{} : Tensor<T>(data.data(), shape);
  }
  static void keep(std::vector<T>& into, Shape& shape, const Tensor<T>& t) {
    shape = t.shape();
    into.assign(t.data(), t.data() + t.numel());
  }

  // Runs the forward of micro-batch m through chunk c, from the kept input.
  Tensor<T> run_forward(int m, int c, std::span<const engine::MicroBatch> batches) {
    Slot& s = slot(m, c);
    const Tensor<T> out =
        engine_.forward_pass(stage_model_.chunk_units(c), m, batches[static_cast<std::size_t>(m)],
                             view(s.input, s.input_shape));
    open_ = m * chunks_ + c;
    return out;
  }

  void compute(std::span<const Instruction> list, std::size_t i,
               std::span<const engine::MicroBatch> batches, StageRun& out) {
    const Instruction& in = list[i];
    Slot& s = slot(in.micro, in.chunk);
    const int id = in.micro * chunks_ + in.chunk;
    switch (in.op) {
      case Op::forward: {
        expect<Error>(!s.forward_done, "pipeline executor: stage ", stage_, " instruction ", i,
                      ": ", to_string(in), " ran before");
        expect<Error>(first_virtual(in.chunk) || !s.input.empty(), "pipeline executor: stage ",
                      stage_, " instruction ", i, ": ", to_string(in),
                      " has no input activation (no recv before it)");
        if (open_ >= 0) engine_.discard_pass();
        open_ = -1;
        const Tensor<T> y = run_forward(in.micro, in.chunk, batches);
        s.forward_done = true;
        s.holds_input = true;
        peak_live_ = std::max(peak_live_, ++live_);
        if (last_virtual(in.chunk)) {
          out.loss_sum += convert<double>(engine_.loss());
          ++out.losses;
        } else {
          keep(s.to_send, s.to_send_shape, y);
        }
        // Keep the pass open only when its own backward is the next computation.
        if (!next_compute_is_backward_of(list, i)) {
          engine_.discard_pass();
          open_ = -1;
        }
        return;
      }
      case Op::backward: {
        expect<Error>(s.forward_done && !s.backward_done, "pipeline executor: stage ", stage_,
                      " instruction ", i, ": ", to_string(in),
                      s.backward_done ? " ran before" : " comes before its forward");
        expect<Error>(last_virtual(in.chunk) || !s.output_grad.empty(), "pipeline executor: stage ",
                      stage_, " instruction ", i, ": ", to_string(in),
                      " has no output gradient (no recv before it)");
        if (open_ != id) {
          if (open_ >= 0) engine_.discard_pass();
          (void)run_forward(in.micro, in.chunk, batches);
          ++out.recomputed_forwards;
        }
        const Tensor<T> dx = engine_.backward_pass(view(s.output_grad, s.output_grad_shape));
        open_ = -1;
        s.backward_done = true;
        if (!first_virtual(in.chunk)) keep(s.to_send, s.to_send_shape, dx);
        // The boundary tensors of this micro-batch are no longer needed.
        std::vector<T>().swap(s.input);
        std::vector<T>().swap(s.output_grad);
        s.holds_input = false;
        --live_;
        return;
      }
      default:
        raise<ConfigError>("pipeline executor: stage ", stage_, " instruction ", i, ": ",
                           to_string(in),
                           ": layers compute input and weight gradients in one backward, so the "
                           "split backward of the zero-bubble schedule cannot run; use gpipe, "
                           "1f1b or interleaved");
    }
  }

  bool next_compute_is_backward_of(std::span<const Instruction> list, std::size_t i) const {
    for (std::size_t k = i + 1; k < list.size(); ++k) {
      if (!is_compute(list[k].op)) continue;
      return list[k].op == Op::backward && list[k].micro == list[i].micro &&
             list[k].chunk == list[i].chunk;
    }
    return false;
  }

  void communicate(std::span<const Instruction> group) {
    std::vector<Work> works;
    // Sends first: posting them early can only remove waits.
    for (const Instruction& in : group) {
      if (!is_send(in.op)) continue;
      Slot& s = slot(in.micro, in.chunk);
      expect<Error>(in.op == Op::send_activation ? s.forward_done : s.backward_done,
                    "pipeline executor: stage ", stage_, ": ", to_string(in),
                    " before the computation that produces it");
      s.header = boundary_header(s.to_send_shape);
      const bool act = in.op == Op::send_activation;
      works.push_back(comm_.send_async(std::span<const std::int64_t>(s.header), in.peer,
                                       act ? activation_header_tag : gradient_header_tag));
      works.push_back(comm_.send_async(std::span<const T>(s.to_send), in.peer,
                                       act ? activation_tag : gradient_tag));
    }
    for (const Instruction& in : group) {
      if (!is_recv(in.op)) continue;
      Slot& s = slot(in.micro, in.chunk);
      const bool act = in.op == Op::recv_activation;
      BoundaryHeader h{};
      comm_
          .recv_async(std::span<std::int64_t>(h), in.peer,
                      act ? activation_header_tag : gradient_header_tag)
          .wait();
      const Shape shape = Shape::of(h.data() + 1, static_cast<int>(h[0]));
      std::vector<T>& into = act ? s.input : s.output_grad;
      (act ? s.input_shape : s.output_grad_shape) = shape;
      into.assign(static_cast<std::size_t>(shape.numel()), T{});
      works.push_back(
          comm_.recv_async(std::span<T>(into), in.peer, act ? activation_tag : gradient_tag));
    }
    for (Work& w : works) w.wait();
    for (const Instruction& in : group) {
      if (is_send(in.op)) std::vector<T>().swap(slot(in.micro, in.chunk).to_send);
    }
  }

  Eng& engine_;
  const Stage& stage_model_;
  AnyComm comm_;
  int stage_, pp_, chunks_;
  int micro_ = 0;
  std::vector<Slot> slots_;
  int open_ = -1;  // the pass whose forward activations the engine still holds (-1: none)
  int live_ = 0, peak_live_ = 0;
};

}  // namespace zero::parallel::pipeline
