#pragma once
// Pipeline-parallel schedules as data: for every pipeline rank ("stage") the list of what it
// does, in order: computes (forward, backward, or backward split into input and weight parts)
// and point-to-point messages to its neighbours. Nothing here communicates; an executor walks a
// stage's list and schedule_check.hpp proves the lists of all stages fit together.
//
// Units: micro-batch i runs through virtual stages 0 .. pp*v-1; virtual stage c*pp + s is model
// chunk c on stage s (Megatron's interleaving), so the activation of chunk c on stage s goes to
// stage (s+1) % pp, chunk c + (s == pp-1), and gradients flow back the same way. With pp == 1
// the chunks of the one stage hand activations and gradients to each other locally: no message.
//
// Messages have rendezvous semantics, as NCCL's send/recv: a send completes only when its peer
// posts the matching recv. Consecutive comm instructions linked by grouped_with_next are posted
// together as one group (one NCCL group / batch_isend_irecv) and complete together; that is how
// a schedule avoids the deadlock of two stages each sending to the other first.
//
// The schedules:
//   gpipe        all forwards, then all backwards (Huang et al. 2019); m activations live.
//   1f1b         PipeDream-flush, Megatron's forward_backward_pipelining_without_interleaving:
//                min(pp-s-1, m) warmup forwards, then one forward / one backward, then the
//                cooldown backwards; at most pp-s activations live on stage s.
//   interleaved  Megatron's forward_backward_pipelining_with_interleaving, v >= 2 chunks per
//                stage, micro-batches taken in groups of pp per chunk: the bubble shrinks by v
//                for v times the messages.
//   zb           ZB-H1 (Qi et al. 2023): the backward split into B (input gradient, on the
//                critical path) and W (weight gradient, deferrable); at most pp-s activations
//                live on stage s (from forward to W), as 1F1B.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <zero/core/error.hpp>

namespace zero::parallel::pipeline {

/// What one instruction of a stage's list does.
enum class Op : std::uint8_t {
  forward,
  backward,
  backward_input,
  backward_weight,
  send_activation,
  recv_activation,
  send_gradient,
  recv_gradient
};

/// Words for op, as messages print it ("recv gradient").
constexpr std::string_view name_of(Op op) {
  constexpr std::string_view names[] = {"forward",         "backward",        "backward input",
                                        "backward weight", "send activation", "recv activation",
                                        "send gradient",   "recv gradient"};
  return names[static_cast<int>(op) % 8];
}

/// True for the ops that compute (forward and the backward kinds).
constexpr bool is_compute(Op op) {
  return op <= Op::backward_weight;
}
/// True for send_activation and send_gradient.
constexpr bool is_send(Op op) {
  return op == Op::send_activation || op == Op::send_gradient;
}
/// True for recv_activation and recv_gradient.
constexpr bool is_recv(Op op) {
  return op == Op::recv_activation || op == Op::recv_gradient;
}

/// One step of a stage's list.
struct Instruction {
  Op op;
  int micro = 0;  ///< micro-batch 0..m-1
  int chunk = 0;  ///< model chunk on this stage, 0..v-1; its virtual stage is chunk*pp + stage
  int peer = -1;  ///< pipeline rank of the other side (send/recv only), else -1
  bool grouped_with_next = false;  ///< a comm op posted together with the next instruction
  friend bool operator==(const Instruction&, const Instruction&) = default;
};

/// "recv gradient (micro 3, chunk 1) from stage 2", "forward (micro 0, chunk 0)".
inline std::string to_string(const Instruction& in) {
  std::string out(name_of(in.op));
  out += " (micro " + std::to_string(in.micro) + ", chunk " + std::to_string(in.chunk) + ")";
  if (is_send(in.op)) out += " to stage " + std::to_string(in.peer);
  if (is_recv(in.op)) out += " from stage " + std::to_string(in.peer);
  return out;
}

/// Which schedule a Schedule follows.
enum class ScheduleKind : std::uint8_t { gpipe, one_f_one_b, interleaved, zero_bubble };

/// Every schedule kind.
inline constexpr ScheduleKind all_schedule_kinds[] = {
    ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
    ScheduleKind::zero_bubble};

/// The name parse_schedule_kind reads: "gpipe", "1f1b", "interleaved" or "zb".
constexpr std::string_view name_of(ScheduleKind kind) {
  constexpr std::string_view names[] = {"gpipe", "1f1b", "interleaved", "zb"};
  return names[static_cast<int>(kind) % 4];
}

/// Parses a schedule name (name_of's, or "zb-h1"); throws ConfigError listing the names.
inline ScheduleKind parse_schedule_kind(std::string_view text) {
  for (ScheduleKind k : all_schedule_kinds) {
    if (name_of(k) == text) return k;
  }
  if (text == "zb-h1") return ScheduleKind::zero_bubble;
  raise<ConfigError>("'", std::string(text),
                     "' is not a schedule; expected gpipe, 1f1b, interleaved or zb (zb-h1 is zb)");
}

/// Sizes a schedule is built for.
struct ScheduleShape {
  int stages = 1;          ///< pipeline ranks (pp)
  int micro_batches = 1;   ///< micro-batches per step (m)
  int virtual_stages = 1;  ///< model chunks per stage (v)
  friend bool operator==(const ScheduleShape&, const ScheduleShape&) = default;
};

/// Every stage's instruction list.
struct Schedule {
  ScheduleKind kind;
  ScheduleShape shape;
  std::vector<std::vector<Instruction>> stages;  ///< stages[s] = stage s's list
};

/// A model chunk on a stage.
struct StageChunk {
  int stage = 0;
  int chunk = 0;
  friend bool operator==(const StageChunk&, const StageChunk&) = default;
};

/// Virtual stage of chunk on stage: chunk * pp + stage.
constexpr int virtual_stage(const ScheduleShape& shape, StageChunk at) {
  return at.chunk * shape.stages + at.stage;
}

/// The chunk that consumes at's activation; none for the last virtual stage (the loss does).
constexpr std::optional<StageChunk> activation_target(const ScheduleShape& shape, StageChunk at) {
  if (virtual_stage(shape, at) + 1 >= shape.stages * shape.virtual_stages) return std::nullopt;
  const bool wraps = at.stage == shape.stages - 1;
  return StageChunk{wraps ? 0 : at.stage + 1, at.chunk + (wraps ? 1 : 0)};
}

/// The chunk that consumes at's input gradient; none for virtual stage 0.
constexpr std::optional<StageChunk> gradient_target(const ScheduleShape& shape, StageChunk at) {
  if (virtual_stage(shape, at) == 0) return std::nullopt;
  const bool wraps = at.stage == 0;
  return StageChunk{wraps ? shape.stages - 1 : at.stage - 1, at.chunk - (wraps ? 1 : 0)};
}

/// Why kind cannot run on shape, or empty when it can.
inline std::string shape_problem(ScheduleKind kind, const ScheduleShape& shape) {
  const std::string where = zero::detail::concat("pipeline schedule ", name_of(kind), ": ");
  if (shape.stages < 1)
    return zero::detail::concat(where, "stages is ", shape.stages, "; expected >= 1");
  if (shape.micro_batches < 1)
    return zero::detail::concat(where, "micro_batches is ", shape.micro_batches, "; expected >= 1");
  if (shape.virtual_stages < 1)
    return zero::detail::concat(where, "virtual_stages is ", shape.virtual_stages,
                                "; expected >= 1");
  if (kind != ScheduleKind::interleaved && shape.virtual_stages != 1)
    return zero::detail::concat(where, "virtual_stages is ", shape.virtual_stages,
                                "; this schedule runs one chunk per stage (virtual_stages 1), use "
                                "'interleaved' for more");
  if (kind == ScheduleKind::interleaved) {
    if (shape.virtual_stages < 2)
      return zero::detail::concat(
          where, "virtual_stages is ", shape.virtual_stages,
          "; interleaving needs >= 2 chunks per stage (use '1f1b' for one)");
    // Megatron takes micro-batches in groups of pp per chunk; a partial group would make a
    // stage wait for a chunk whose micro-batches are not in flight ("dependency bubbles").
    if (shape.micro_batches < shape.stages || shape.micro_batches % shape.stages != 0)
      return zero::detail::concat(
          where, "micro_batches is ", shape.micro_batches,
          "; the interleaved schedule takes micro-batches in groups of stages (", shape.stages,
          ") per chunk, so micro_batches must be a multiple of ", shape.stages,
          " and >= ", shape.stages);
  }
  return {};
}

/// Throws ConfigError when kind cannot run on shape (see shape_problem).
inline void validate_shape(ScheduleKind kind, const ScheduleShape& shape) {
  const std::string problem = shape_problem(kind, shape);
  expect<ConfigError>(problem.empty(), problem);
}

namespace detail {

/// A comm op a generator asks for: op on (micro, chunk) of the stage being built.
struct CommRequest {
  Op op;
  int micro, chunk;
};

/// Appends one stage's instructions. Comm requests that need no message (the ends of the
/// chain, or pp == 1 where a stage's chunks hand over locally) are dropped, so a generator can
/// ask for every one as Megatron's code does.
class ListBuilder {
 public:
  /// Builds stage's list of a shape into out.
  ListBuilder(const ScheduleShape& shape, int stage, std::vector<Instruction>& out)
      : shape_(shape), stage_(stage), out_(out) {}

  /// Appends a compute instruction.
  void compute(Op op, int micro, int chunk) { out_.push_back({op, micro, chunk, -1, false}); }

  /// Appends the requests that need a message, as one group.
  void group(const CommRequest* first, const CommRequest* last) {
    bool any = false;
    for (; first != last; ++first) {
      const int peer = peer_of(first->op, first->chunk);
      if (peer < 0) continue;
      if (any) out_.back().grouped_with_next = true;
      out_.push_back({first->op, first->micro, first->chunk, peer, false});
      any = true;
    }
  }
  /// Appends the requests that need a message, as one group.
  void group(std::initializer_list<CommRequest> comms) { group(comms.begin(), comms.end()); }

  /// The rank on the other side of op for chunk of this stage, or -1 when no message is needed.
  int peer_of(Op op, int chunk) const {
    const StageChunk at{stage_, chunk};
    const bool downstream = op == Op::send_activation || op == Op::recv_gradient;
    const std::optional<StageChunk> other =
        downstream ? activation_target(shape_, at) : gradient_target(shape_, at);
    if (!other || other->stage == stage_) return -1;
    return other->stage;
  }

 private:
  const ScheduleShape& shape_;
  int stage_;
  std::vector<Instruction>& out_;
};

/// GPipe on stage s: every forward, then every backward in micro-batch order.
inline void gpipe_stage(const ScheduleShape& shape, int s, std::vector<Instruction>& out) {
  ListBuilder b(shape, s, out);
  for (int i = 0; i < shape.micro_batches; ++i) {
    b.group({{Op::recv_activation, i, 0}});
    b.compute(Op::forward, i, 0);
    b.group({{Op::send_activation, i, 0}});
  }
  for (int i = 0; i < shape.micro_batches; ++i) {
    b.group({{Op::recv_gradient, i, 0}});
    b.compute(Op::backward, i, 0);
    b.group({{Op::send_gradient, i, 0}});
  }
}

/// Megatron's non-interleaved 1F1B on stage s, its p2p helpers as groups:
/// send_forward_recv_backward after a steady forward and send_backward_recv_forward after a
/// steady backward. Posted one by one, stage s's send_activation and stage s+1's
/// send_gradient would each wait for the other.
inline void one_f_one_b_stage(const ScheduleShape& shape, int s, std::vector<Instruction>& out) {
  ListBuilder b(shape, s, out);
  const int m = shape.micro_batches;
  const int warmup = std::min(shape.stages - s - 1, m);
  const int steady = m - warmup;
  for (int i = 0; i < warmup; ++i) {
    b.group({{Op::recv_activation, i, 0}});
    b.compute(Op::forward, i, 0);
    b.group({{Op::send_activation, i, 0}});
  }
  if (steady > 0) b.group({{Op::recv_activation, warmup, 0}});
  for (int k = 0; k < steady; ++k) {
    b.compute(Op::forward, k + warmup, 0);
    b.group({{Op::send_activation, k + warmup, 0}, {Op::recv_gradient, k, 0}});
    b.compute(Op::backward, k, 0);
    if (k == steady - 1) {
      b.group({{Op::send_gradient, k, 0}});
    } else {
      b.group({{Op::send_gradient, k, 0}, {Op::recv_activation, k + warmup + 1, 0}});
    }
  }
  for (int i = steady; i < m; ++i) {
    b.group({{Op::recv_gradient, i, 0}});
    b.compute(Op::backward, i, 0);
    b.group({{Op::send_gradient, i, 0}});
  }
}

/// Megatron's interleaved 1F1B on stage s. Virtual micro-batch k (0 .. m*v-1) is entry k of
/// get_schedule_table: micro-batches in groups of pp, every chunk of a group in turn; backward
/// k takes the same entry with chunk v-1-chunk. Stage s runs min(2(pp-s-1) + (v-1)pp, m*v)
/// warmup forwards, then forward/backward pairs, then the remaining backwards. Between two
/// batches (a warmup forward, a steady pair, a cooldown backward) it posts one group: this
/// batch's sends and the next batch's recvs, as Megatron's
/// send_forward_backward_recv_forward_backward. Grouping per op, as 1F1B does, deadlocks here
/// once m > pp.
inline void interleaved_stage(const ScheduleShape& shape, int s, std::vector<Instruction>& out) {
  ListBuilder b(shape, s, out);
  const int pp = shape.stages, v = shape.virtual_stages;
  const int total = shape.micro_batches * v;
  const int warmup = std::min(2 * (pp - s - 1) + (v - 1) * pp, total);
  struct Unit {
    int micro, chunk;
  };
  auto entry = [&](int k, bool forward) {
    const int group = k / (pp * v), within = k % (pp * v);
    const int chunk = within / pp;
    return Unit{group * pp + within % pp, forward ? chunk : v - 1 - chunk};
  };
  // Batch j holds forward j (when j < total) and backward j - warmup (when that is >= 0).
  const int batches = total + warmup;
  auto add_recvs = [&](int j, CommRequest* to) {
    if (j >= batches) return to;
    if (j < total) {
      const Unit u = entry(j, true);
      *to++ = {Op::recv_activation, u.micro, u.chunk};
    }
    if (j - warmup >= 0) {
      const Unit u = entry(j - warmup, false);
      *to++ = {Op::recv_gradient, u.micro, u.chunk};
    }
    return to;
  };
  CommRequest comms[4] = {};
  b.group(comms, add_recvs(0, comms));
  for (int j = 0; j < batches; ++j) {
    CommRequest* end = comms;
    if (j < total) {
      const Unit u = entry(j, true);
      b.compute(Op::forward, u.micro, u.chunk);
      *end++ = {Op::send_activation, u.micro, u.chunk};
    }
    if (j - warmup >= 0) {
      const Unit u = entry(j - warmup, false);
      b.compute(Op::backward, u.micro, u.chunk);
      *end++ = {Op::send_gradient, u.micro, u.chunk};
    }
    b.group(comms, add_recvs(j + 1, end));
  }
}

/// A compute of the ZB-H1 simulation: op on micro-batch micro over [start, start + 1).
struct TimedCompute {
  Op op;
  int micro;
  int start;
};

/// ZB-H1 as a greedy list simulation with unit costs (F = B = W = 1) and free messages: at
/// every time step each stage runs, in this order of preference, the backward input of its
/// oldest micro-batch whose output gradient is there (B is on the critical path), the next
/// forward if its input is there and fewer than pp-s activations are live (1F1B's peak: an
/// activation lives until its W), else its oldest pending backward weight. The result depends
/// on (pp, m) alone.
inline std::vector<std::vector<TimedCompute>> zero_bubble_timeline(int pp, int m) {
  constexpr int never = 1 << 30;
  const auto per_stage = [&](int value) {
    return std::vector<std::vector<int>>(static_cast<std::size_t>(pp),
                                         std::vector<int>(static_cast<std::size_t>(m), value));
  };
  std::vector<std::vector<int>> forward_end = per_stage(never), input_grad_end = per_stage(never);
  std::vector<int> next_forward(static_cast<std::size_t>(pp), 0);
  std::vector<int> next_backward(static_cast<std::size_t>(pp), 0);
  std::vector<int> next_weight(static_cast<std::size_t>(pp), 0);
  std::vector<std::vector<TimedCompute>> timeline(static_cast<std::size_t>(pp));
  for (auto& t : timeline) t.reserve(3 * static_cast<std::size_t>(m));
  long remaining = 3L * m * pp;
  for (int t = 0; remaining > 0; ++t) {
    // Work started at t ends at t + 1, so a stage never sees a choice made in the same step.
    for (int s = 0; s < pp; ++s) {
      const auto su = static_cast<std::size_t>(s);
      const int b = next_backward[su], f = next_forward[su], w = next_weight[su];
      const auto bu = static_cast<std::size_t>(b), fu = static_cast<std::size_t>(f);
      if (b < m && forward_end[su][bu] <= t && (s == pp - 1 || input_grad_end[su + 1][bu] <= t)) {
        input_grad_end[su][bu] = t + 1;
        timeline[su].push_back({Op::backward_input, b, t});
        ++next_backward[su];
      } else if (f < m && f - w < pp - s && (s == 0 || forward_end[su - 1][fu] <= t)) {
        forward_end[su][fu] = t + 1;
        timeline[su].push_back({Op::forward, f, t});
        ++next_forward[su];
      } else if (w < b) {
        timeline[su].push_back({Op::backward_weight, w, t});
        ++next_weight[su];
      } else {
        continue;
      }
      --remaining;
    }
    if (t > 4 * (m + pp) + 16) [[unlikely]]
      raise<Error>("zero_bubble_timeline: no progress at pp ", pp, ", m ", m, " (a bug)");
  }
  return timeline;
}

/// ZB-H1 lists from the simulation. Each message is placed at the instant T its producer
/// ends: the sender's list posts it right after the producer, the receiver's list where its
/// own timeline is at T (every compute takes one step, so every stage is between two computes
/// at every integer instant). Messages at the same instant on a stage form one group, ordered
/// by sender then kind. Every list thus posts its messages in increasing (T, sender, kind), the
/// same total order on all stages, so the earliest unmatched message always has both sides
/// posted: no deadlock, and each pair's sends and recvs come in the same order.
inline void zero_bubble_lists(const ScheduleShape& shape,
                              std::vector<std::vector<Instruction>>& out) {
  const int pp = shape.stages;
  const auto timeline = zero_bubble_timeline(pp, shape.micro_batches);
  struct Message {
    int at, sender, kind;  // sort key; kind 0 activation, 1 gradient
    Instruction in;
  };
  std::vector<std::vector<Message>> messages(static_cast<std::size_t>(pp));
  for (int s = 0; s < pp; ++s) {
    for (const TimedCompute& c : timeline[static_cast<std::size_t>(s)]) {
      const int at = c.start + 1;
      if (c.op == Op::forward && s + 1 < pp) {
        messages[static_cast<std::size_t>(s)].push_back(
            {at, s, 0, {Op::send_activation, c.micro, 0, s + 1, false}});
        messages[static_cast<std::size_t>(s + 1)].push_back(
            {at, s, 0, {Op::recv_activation, c.micro, 0, s, false}});
      } else if (c.op == Op::backward_input && s > 0) {
        messages[static_cast<std::size_t>(s)].push_back(
            {at, s, 1, {Op::send_gradient, c.micro, 0, s - 1, false}});
        messages[static_cast<std::size_t>(s - 1)].push_back(
            {at, s, 1, {Op::recv_gradient, c.micro, 0, s, false}});
      }
    }
  }
  for (int s = 0; s < pp; ++s) {
    auto& msgs = messages[static_cast<std::size_t>(s)];
    std::sort(msgs.begin(), msgs.end(), [](const Message& a, const Message& b) {
      if (a.at != b.at) return a.at < b.at;
      if (a.sender != b.sender) return a.sender < b.sender;
      return a.kind < b.kind;
    });
    const auto& computes = timeline[static_cast<std::size_t>(s)];
    auto& list = out[static_cast<std::size_t>(s)];
    list.reserve(computes.size() + msgs.size());
    std::size_t k = 0;
    // Appends the messages of instants up to `until`, one group per instant.
    auto post_messages = [&](int until) {
      for (; k < msgs.size() && msgs[k].at <= until; ++k) {
        if (k > 0 && msgs[k - 1].at == msgs[k].at && !is_compute(list.back().op))
          list.back().grouped_with_next = true;
        list.push_back(msgs[k].in);
      }
    };
    for (const TimedCompute& c : computes) {
      post_messages(c.start);
      list.push_back({c.op, c.micro, 0, -1, false});
    }
    post_messages(std::numeric_limits<int>::max());
  }
}

}  // namespace detail

/// Builds every stage's list of kind for shape; throws ConfigError when the shape does not
/// fit the kind (see shape_problem).
inline Schedule make_schedule(ScheduleKind kind, ScheduleShape shape) {
  validate_shape(kind, shape);
  Schedule schedule{kind, shape, {}};
  schedule.stages.resize(static_cast<std::size_t>(shape.stages));
  // At most 3 computes and 4 messages per (micro, chunk).
  for (auto& list : schedule.stages)
    list.reserve(7 * static_cast<std::size_t>(shape.micro_batches) *
                 static_cast<std::size_t>(shape.virtual_stages));
  if (kind == ScheduleKind::zero_bubble) {
    detail::zero_bubble_lists(shape, schedule.stages);
    return schedule;
  }
  for (int s = 0; s < shape.stages; ++s) {
    auto& list = schedule.stages[static_cast<std::size_t>(s)];
    switch (kind) {
      case ScheduleKind::gpipe:
        detail::gpipe_stage(shape, s, list);
        break;
      case ScheduleKind::one_f_one_b:
        detail::one_f_one_b_stage(shape, s, list);
        break;
      case ScheduleKind::interleaved:
        detail::interleaved_stage(shape, s, list);
        break;
      case ScheduleKind::zero_bubble:
        break;
    }
  }
  return schedule;
}

}  // namespace zero::parallel::pipeline
