#pragma once
// StageExecutor: runs one pipeline rank's instruction list (schedule.hpp) with its Engine's
// passes (Engine::forward_pass / backward_pass) and point-to-point messages on the pipeline
// group. Per micro-batch and chunk it keeps what crosses the stage boundary (the input
// activation, received or the tokens at virtual stage 0, from its forward until its backward,
// and the gradient received for its output until that backward) and, when the next
// computation is not its own backward, the pass itself parked (Engine::park_pass: the
// activations in their arena, as Megatron keeps every in-flight micro-batch's), resumed just
// before the backward. Peak memory is then the schedule's live activations times one pass's.
// A model that cannot park (nn::ParksPasses) has such a forward discarded once its output was
// copied out, and run again from the kept input just before the backward (GPipe's
// rematerialisation; the same dropout masks, which follow the micro-batch): one pass's
// activations inside the stage, at the price of a forward per recomputed micro-batch.
// Messages: each activation or gradient is a header (rank and extents) and the payload, tagged
// by kind, so any shape crosses. A group of comm instructions (grouped_with_next) is posted
// together, sends first, and waited on together, as an NCCL group: the static checker proved
// the schedule free of deadlock under those semantics, and posting sends first only removes
// waits.
// A split backward (the zero-bubble schedule) runs the input half at backward_input, sending
// the input gradient at once, and leaves the layers' weight-gradient products in a
// DeferredWeightGrads of the micro-batch until its backward_weight; the micro-batch counts as
// live until then. Those lists are reused across micro-batches and steps like boundary storage.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <parallel/comm/any_comm.hpp>
#include <parallel/comm/work.hpp>
#include <parallel/pipeline/schedule.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/engine/micro_step.hpp>
#include <zero/nn/deferred_weight_grads.hpp>

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

/// A tensor crossing a stage boundary: its values, its shape, and the header a send of it
/// posts (kept here until the send completed).
template <class T>
struct BoundaryTensor {
  std::vector<T> values;
  Shape shape;
  BoundaryHeader header{};

  /// A view of the values (empty when there are none).
  Tensor<T> view() { return values.empty() ? Tensor<T>{} : Tensor<T>(values.data(), shape); }
  /// Copies t in (reusing the values' storage).
  void assign(const Tensor<T>& t) {
    shape = t.shape();
    values.assign(t.data(), t.data() + t.numel());
  }
};

/// Posts the sends of t to peer, as an activation (or a gradient): its header (written into
/// header, which must live until the sends complete), then its values; the Works go into works.
template <class T>
void post_boundary_send(AnyComm& comm, BoundaryHeader& header, Tensor<const T> t, int peer,
                        bool activation, std::vector<Work>& works) {
  header = boundary_header(t.shape());
  works.push_back(comm.send_async(std::span<const std::int64_t>(header), peer,
                                  activation ? activation_header_tag : gradient_header_tag));
  works.push_back(comm.send_async(std::span<const T>(t.data(), static_cast<std::size_t>(t.numel())),
                                  peer, activation ? activation_tag : gradient_tag));
}
/// Receives the header of an activation (or a gradient) from peer, sizes t by it and posts the
/// receive of its values into works.
template <class T>
void post_boundary_recv(AnyComm& comm, BoundaryTensor<T>& t, int peer, bool activation,
                        std::vector<Work>& works) {
  BoundaryHeader h{};
  comm.recv_async(std::span<std::int64_t>(h), peer,
                  activation ? activation_header_tag : gradient_header_tag)
      .wait();
  t.shape = Shape::of(h.data() + 1, static_cast<int>(h[0]));
  t.values.resize(static_cast<std::size_t>(t.shape.numel()));
  works.push_back(
      comm.recv_async(std::span<T>(t.values), peer, activation ? activation_tag : gradient_tag));
}
/// Waits for every Work of works.
inline void wait_all(std::vector<Work>& works) {
  for (Work& w : works) w.wait();
  works.clear();
}

/// What one run of a stage's list measured.
struct StageRun {
  double loss_sum = 0.0;  ///< sum of the micro-batches' losses (last virtual stage only)
  /// Sum of the micro-batches' auxiliary losses (MoE routers) on the chunks before the last
  /// virtual stage, whose passes' loss does not hold them.
  double aux_sum = 0.0;
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
    slots_.resize(static_cast<std::size_t>(micro_ * chunks_));
    for (Slot& s : slots_) {
      s.forward_done = s.backward_done = false;
      s.parked = {};  // an earlier run that stopped part-way may have left one
      expect<Error>(s.deferred == nullptr, "pipeline executor: stage ", stage_,
                    ": an earlier run left a weight half undone");
    }
    open_ = -1;
    live_ = 0;
    StageRun out;
    const auto start = clock::now();
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
    return out;
  }

 private:
  using clock = std::chrono::steady_clock;
  static double seconds(clock::duration d) { return std::chrono::duration<double>(d).count(); }

  // What crosses the stage boundary for one (micro-batch, chunk).
  struct Slot {
    BoundaryTensor<T> input;        // the activation entering the chunk (none at virtual stage 0)
    BoundaryTensor<T> output_grad;  // the gradient at the chunk's output (none at the last)
    BoundaryTensor<T> to_send;      // output activation or input gradient, kept until sent
    // Left by backward_input until its backward_weight: a backward is whole once it ran and
    // none is left.
    std::unique_ptr<nn::DeferredWeightGrads<T>> deferred;
    engine::ParkedPass<T> parked;  // the pass between its forward and its backward, when parked
    bool forward_done = false, backward_done = false;
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
  // Boundary storage is reused across micro-batches and steps (a stage holds at most its peak
  // live activations of it), so the hot path does not allocate once warm.
  // The last of a free list (an empty X when there is none).
  template <class X>
  static X take(std::vector<X>& free) {
    if (free.empty()) return {};
    X x = std::move(free.back());
    free.pop_back();
    return x;
  }
  void give_back(std::vector<T>& v) {
    if (v.capacity() > 0) free_.push_back(std::move(v));
    v = {};
  }

  // Runs the forward of micro-batch m through chunk c, from the kept input.
  Tensor<T> run_forward(int m, int c, std::span<const engine::MicroBatch> batches) {
    Slot& s = slot(m, c);
    const Tensor<T> out = engine_.forward_pass(
        stage_model_.chunk_units(c), m, batches[static_cast<std::size_t>(m)], s.input.view());
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
        expect<Error>(first_virtual(in.chunk) || !s.input.values.empty(),
                      "pipeline executor: stage ", stage_, " instruction ", i, ": ", to_string(in),
                      " has no input activation (no recv before it)");
        discard_open_pass();
        const Tensor<T> y = run_forward(in.micro, in.chunk, batches);
        s.forward_done = true;
        out.peak_live_activations = std::max(out.peak_live_activations, ++live_);
        if (last_virtual(in.chunk)) {
          out.loss_sum += convert<double>(engine_.loss());
          ++out.losses;
        } else {
          out.aux_sum += static_cast<double>(engine_.aux_loss());
          s.to_send.values = take(free_);
          s.to_send.assign(y);
        }
        // Keep the pass open when its own backward is the next computation, else park it.
        if (!next_compute_is_backward_of(list, i)) {
          if (engine_.parks(stage_model_.chunk_units(in.chunk))) {
            s.parked = engine_.park_pass();
            open_ = -1;
          } else {
            discard_open_pass();
          }
        }
        return;
      }
      case Op::backward:
      case Op::backward_input: {
        expect<Error>(s.forward_done && !s.backward_done, "pipeline executor: stage ", stage_,
                      " instruction ", i, ": ", to_string(in),
                      s.backward_done ? " ran before" : " comes before its forward");
        expect<Error>(last_virtual(in.chunk) || !s.output_grad.values.empty(),
                      "pipeline executor: stage ", stage_, " instruction ", i, ": ", to_string(in),
                      " has no output gradient (no recv before it)");
        if (open_ != id) {
          discard_open_pass();
          if (!s.parked.empty()) {
            engine_.resume_pass(std::move(s.parked));  // leaves s.parked empty
            open_ = id;
          } else {
            (void)run_forward(in.micro, in.chunk, batches);
            ++out.recomputed_forwards;
          }
        }
        const bool split = in.op == Op::backward_input;
        Tensor<T> dx;
        if (split) {
          s.deferred = take(free_deferred_);
          if (!s.deferred) s.deferred = std::make_unique<nn::DeferredWeightGrads<T>>();
          dx = engine_.backward_input_pass(s.output_grad.view(), *s.deferred);
        } else {
          dx = engine_.backward_pass(s.output_grad.view());
        }
        open_ = -1;
        s.backward_done = true;
        if (!first_virtual(in.chunk)) {
          s.to_send.values = take(free_);
          s.to_send.assign(dx);
        }
        // The boundary tensors of this micro-batch are no longer needed.
        give_back(s.input.values);
        give_back(s.output_grad.values);
        if (!split) --live_;
        return;
      }
      case Op::backward_weight: {
        expect<Error>(s.deferred != nullptr, "pipeline executor: stage ", stage_, " instruction ",
                      i, ": ", to_string(in),
                      s.backward_done ? " ran before, or its backward was whole"
                                      : " comes before its backward input");
        engine_.weight_pass(stage_model_.chunk_units(in.chunk), *s.deferred);
        free_deferred_.push_back(std::move(s.deferred));
        --live_;
        return;
      }
      default:
        raise<Error>("pipeline executor: stage ", stage_, " instruction ", i, ": ", to_string(in),
                     " is not a computation");
    }
  }

  // Drops the pass whose activations the engine still holds, if any.
  void discard_open_pass() {
    if (open_ >= 0) engine_.discard_pass();
    open_ = -1;
  }

  bool next_compute_is_backward_of(std::span<const Instruction> list, std::size_t i) const {
    for (std::size_t k = i + 1; k < list.size(); ++k) {
      if (!is_compute(list[k].op)) continue;
      return (list[k].op == Op::backward || list[k].op == Op::backward_input) &&
             list[k].micro == list[i].micro && list[k].chunk == list[i].chunk;
    }
    return false;
  }

  void communicate(std::span<const Instruction> group) {
    // Sends first: posting them early can only remove waits.
    for (const Instruction& in : group) {
      if (!is_send(in.op)) continue;
      Slot& s = slot(in.micro, in.chunk);
      const bool act = in.op == Op::send_activation;
      expect<Error>(act ? s.forward_done : s.backward_done, "pipeline executor: stage ", stage_,
                    ": ", to_string(in), " before the computation that produces it");
      post_boundary_send(comm_, s.to_send.header, Tensor<const T>(s.to_send.view()), in.peer, act,
                         works_);
    }
    for (const Instruction& in : group) {
      if (!is_recv(in.op)) continue;
      Slot& s = slot(in.micro, in.chunk);
      const bool act = in.op == Op::recv_activation;
      BoundaryTensor<T>& into = act ? s.input : s.output_grad;
      into.values = take(free_);
      post_boundary_recv(comm_, into, in.peer, act, works_);
    }
    wait_all(works_);
    for (const Instruction& in : group) {
      if (is_send(in.op)) give_back(slot(in.micro, in.chunk).to_send.values);
    }
  }

  Eng& engine_;
  const Stage& stage_model_;
  AnyComm comm_;
  int stage_, pp_, chunks_;
  int micro_ = 0;
  std::vector<Slot> slots_;
  std::vector<std::vector<T>> free_;  // boundary storage to reuse
  std::vector<std::unique_ptr<nn::DeferredWeightGrads<T>>> free_deferred_;  // likewise
  std::vector<Work> works_;  // the open group's messages
  int open_ = -1;            // the pass whose forward activations the engine still holds (-1: none)
  int live_ = 0;             // stage inputs held now
};

}  // namespace zero::parallel::pipeline
