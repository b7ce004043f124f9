#pragma once
// Static checker of a pipeline schedule: proves, before anything runs, that every stage's list
// is complete and consistent and that all lists together finish under rendezvous messages, and
// reports each stage's busy time, finish time and peak of live activations.
//
// Structure (each list alone): every (micro, chunk) has exactly one forward and then one
// backward, or one backward input and later one backward weight; a compute comes after the
// recv of its input (or, with pp == 1, after the chunk before it on the same stage); a send
// comes after the compute that produced it; a message goes to the rank of the neighbouring
// virtual stage and every activation and gradient that another stage needs is sent.
//
// Execution (all lists together), NCCL's semantics on one communicator: a send completes when
// its peer has posted the matching recv and vice versa; a group's ops are posted together and
// the stage goes on when all completed; sends from a to b match recvs at b from a first come,
// first served whatever their kind, and the pair must agree on kind, micro and chunk.
// Computes take OpCosts time, messages none; a matched pair completes at the later post.
// The run is a dataflow evaluation: each stage runs until it blocks, and a stage blocked on a
// group resumes when the group's last op is matched, so the cost is linear in the number of
// instructions.

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include <parallel/pipeline/schedule.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel::pipeline {

/// A schedule's lists are inconsistent, incomplete, mismatched or deadlock; names the stage,
/// the instruction index and the instruction.
class ScheduleError : public Error {
 public:
  using Error::Error;
};

/// Time each compute takes (any unit; messages take none).
struct OpCosts {
  double forward = 1.0, backward = 2.0, backward_input = 1.0, backward_weight = 1.0;
  /// Added to a backward (or backward input) whose forward is not the computation just before
  /// it on its stage: StageExecutor runs that forward again first (layers keep one
  /// micro-batch's activations). 0 simulates a stage that keeps every live micro-batch's.
  double recompute_forward = 0.0;
};

/// What one stage did in the checked run.
struct StageReport {
  int peak_live_activations = 0;  ///< most (micro, chunk) between forward and (weight) backward
  double busy = 0.0;              ///< time spent computing
  double finish = 0.0;            ///< time its last instruction completed
  int recomputed_forwards = 0;    ///< backwards whose forward did not run just before
};

/// What check_schedule found.
struct ScheduleReport {
  std::vector<StageReport> stages;
  double makespan = 0.0;         ///< the latest finish
  double bubble_fraction = 0.0;  ///< (makespan - busiest stage's busy) / that busy
};

namespace detail {

/// "pipeline schedule 1f1b (pp 4, m 8, v 1)": the start of every message.
inline std::string schedule_label(const Schedule& s) {
  return zero::detail::concat("pipeline schedule ", name_of(s.kind), " (pp ", s.shape.stages,
                              ", m ", s.shape.micro_batches, ", v ", s.shape.virtual_stages, ")");
}

/// Where one (micro, chunk) of a stage is: the index of each instruction seen for it, or -1.
struct UnitSeen {
  int forward = -1, backward = -1, weight = -1;  // backward: full or input part
  int act_in = -1, grad_in = -1, act_out = -1, grad_out = -1;
  bool split = false;  // backward was a backward_input
};

/// Checks one stage's list alone (see the file comment); throws ScheduleError.
inline void check_stage_list(const Schedule& sched, int s, std::vector<UnitSeen>& seen) {
  const ScheduleShape& shape = sched.shape;
  const int pp = shape.stages, m = shape.micro_batches, v = shape.virtual_stages;
  const auto& list = sched.stages[static_cast<std::size_t>(s)];
  seen.assign(static_cast<std::size_t>(m) * static_cast<std::size_t>(v), UnitSeen{});
  const int last_vs = pp * v - 1;
  for (std::size_t idx = 0; idx < list.size(); ++idx) {
    const Instruction& in = list[idx];
    const int i = static_cast<int>(idx);
    auto fail = [&](const auto&... why) {
      raise<ScheduleError>(schedule_label(sched), ": stage ", s, " instruction ", i, " (",
                           to_string(in), "): ", why...);
    };
    if (in.micro < 0 || in.micro >= m) fail("micro ", in.micro, " is out of range 0..", m - 1);
    if (in.chunk < 0 || in.chunk >= v) fail("chunk ", in.chunk, " is out of range 0..", v - 1);
    const StageChunk at{s, in.chunk};
    const int vs = virtual_stage(shape, at);
    UnitSeen& u = seen[static_cast<std::size_t>(in.micro * v + in.chunk)];
    auto unit = [&] {
      return zero::detail::concat("(micro ", in.micro, ", chunk ", in.chunk, ")");
    };
    // The neighbours of this chunk, and whether they live on this stage (pp == 1).
    const auto next = activation_target(shape, at);
    const auto prev = gradient_target(shape, at);
    const bool next_local = next && next->stage == s, prev_local = prev && prev->stage == s;
    auto local_unit = [&](StageChunk c) {
      return seen[static_cast<std::size_t>(in.micro * v + c.chunk)];
    };
    if (is_compute(in.op)) {
      if (in.peer != -1) fail("a compute has peer ", in.peer, "; expected -1");
    } else {
      const bool downstream = in.op == Op::send_activation || in.op == Op::recv_gradient;
      const auto& other = downstream ? next : prev;
      if (!other) {
        fail("virtual stage ", vs, " is ", vs == 0 ? "the first" : "the last",
             downstream ? (in.op == Op::send_activation ? "; its output goes to the loss"
                                                        : "; its backward starts from the loss")
                        : (in.op == Op::recv_activation ? "; its input is the data"
                                                        : "; there is no input gradient to send"),
             ", expected no such message");
      }
      if (other->stage == s)
        fail("virtual stage ", virtual_stage(shape, *other),
             " is on this stage too, so the hand-over is local; expected no message");
      if (in.peer < 0 || in.peer >= pp)
        fail("peer ", in.peer, " is out of range; expected a stage 0..", pp - 1);
      if (in.peer != other->stage)
        fail("peer ", in.peer, " is not the rank of the neighbouring virtual stage ",
             virtual_stage(shape, *other), "; expected stage ", other->stage);
    }
    switch (in.op) {
      case Op::forward:
        if (u.forward >= 0) fail(unit(), " already ran its forward at instruction ", u.forward);
        if (vs > 0 && prev_local && local_unit(*prev).forward < 0)
          fail("its input, the forward of (micro ", in.micro, ", chunk ", prev->chunk,
               "), has not run before it");
        if (vs > 0 && !prev_local && u.act_in < 0)
          fail("its input activation was not received before it; expected recv activation ", unit(),
               " from stage ", prev->stage, " earlier in the list");
        u.forward = i;
        break;
      case Op::backward:
      case Op::backward_input:
        if (u.backward >= 0) fail(unit(), " already ran its backward at instruction ", u.backward);
        if (u.forward < 0)
          fail("it comes before the forward of ", unit(), "; expected the forward earlier");
        if (vs < last_vs && next_local && local_unit(*next).backward < 0)
          fail("its output gradient, from the backward of (micro ", in.micro, ", chunk ",
               next->chunk, "), has not run before it");
        if (vs < last_vs && !next_local && u.grad_in < 0)
          fail("its output gradient was not received before it; expected recv gradient ", unit(),
               " from stage ", next->stage, " earlier in the list");
        u.backward = i;
        u.split = in.op == Op::backward_input;
        break;
      case Op::backward_weight:
        if (u.weight >= 0)
          fail(unit(), " already ran its backward weight at instruction ", u.weight);
        if (u.backward < 0 || !u.split)
          fail("expected the backward input of ", unit(), " earlier in the list",
               u.backward >= 0 ? " (it ran a full backward)" : "");
        u.weight = i;
        break;
      case Op::send_activation:
        if (u.act_out >= 0)
          fail(unit(), "'s activation was already sent at instruction ", u.act_out);
        if (u.forward < 0) fail("it comes before the forward that produces it");
        u.act_out = i;
        break;
      case Op::send_gradient:
        if (u.grad_out >= 0)
          fail(unit(), "'s gradient was already sent at instruction ", u.grad_out);
        if (u.backward < 0) fail("it comes before the backward that produces it");
        u.grad_out = i;
        break;
      case Op::recv_activation:
        if (u.act_in >= 0)
          fail(unit(), "'s activation was already received at instruction ", u.act_in);
        u.act_in = i;
        break;
      case Op::recv_gradient:
        if (u.grad_in >= 0)
          fail(unit(), "'s gradient was already received at instruction ", u.grad_in);
        u.grad_in = i;
        break;
    }
  }
  // What is missing once the list ends.
  for (int micro = 0; micro < m; ++micro) {
    for (int chunk = 0; chunk < v; ++chunk) {
      const UnitSeen& u = seen[static_cast<std::size_t>(micro * v + chunk)];
      const StageChunk at{s, chunk};
      auto fail = [&](const auto&... why) {
        raise<ScheduleError>(schedule_label(sched), ": stage ", s, ", after its last instruction (",
                             static_cast<long>(list.size()) - 1, "): (micro ", micro, ", chunk ",
                             chunk, ") ", why...);
      };
      if (u.forward < 0) fail("has no forward; expected exactly one");
      if (u.backward < 0) fail("has no backward; expected one backward or backward input");
      if (u.split && u.weight < 0) fail("has a backward input but no backward weight");
      const auto next = activation_target(sched.shape, at);
      const auto prev = gradient_target(sched.shape, at);
      if (next && next->stage != s && u.act_out < 0)
        fail("never sends its activation; expected send activation to stage ", next->stage);
      if (prev && prev->stage != s && u.grad_out < 0)
        fail("never sends its input gradient; expected send gradient to stage ", prev->stage);
    }
  }
}

/// A comm op waiting for its partner.
struct Posted {
  int stage;
  int index;
  double time;
};

/// The messages from one rank to one neighbour. Matching happens when an op is posted, so at
/// any moment only one side (sends or recvs) has ops waiting.
struct Channel {
  std::vector<Posted> waiting;
  std::size_t head = 0;
  bool sends_wait = false;

  bool has(bool sends) const { return head < waiting.size() && sends_wait == sends; }
  Posted pop() {
    const Posted p = waiting[head++];
    if (head == waiting.size()) {
      waiting.clear();
      head = 0;
    }
    return p;
  }
  void push(bool sends, Posted p) {
    sends_wait = sends;
    waiting.push_back(p);
  }
};

/// One stage's progress in the run.
struct StageRun {
  std::size_t pc = 0;         // next instruction (or first of the open group)
  std::size_t group_end = 0;  // last instruction of the open group
  int pending = 0;            // ops of the open group not matched yet
  double clock = 0.0;         // when the stage is free
  double group_done = 0.0;    // when the open group's matched ops completed
  double busy = 0.0;
  int live = 0, peak = 0;
  int recomputed = 0;
  const Instruction* last_compute = nullptr;  // the compute before the next one
  bool blocked = false;                       // waiting for the open group
  bool finished = false;
};

}  // namespace detail

/// Checks s (see the file comment) and simulates it with costs; throws ScheduleError naming
/// the stage, instruction index and instruction of the first problem, the mismatched pair, or
/// every blocked stage of a deadlock.
inline ScheduleReport check_schedule(const Schedule& s, const OpCosts& costs = {}) {
  const ScheduleShape& shape = s.shape;
  const std::string label = detail::schedule_label(s);
  expect<ScheduleError>(shape.stages >= 1 && shape.micro_batches >= 1 && shape.virtual_stages >= 1,
                        label, ": every size must be >= 1");
  expect<ScheduleError>(s.stages.size() == static_cast<std::size_t>(shape.stages), label, ": has ",
                        s.stages.size(), " stage lists; expected one per stage (", shape.stages,
                        ")");
  const int pp = shape.stages;
  {
    std::vector<detail::UnitSeen> seen;
    for (int st = 0; st < pp; ++st) detail::check_stage_list(s, st, seen);
  }

  // Channel of the messages from a to b (neighbours, checked above): 2a toward a+1, 2a+1
  // toward a-1; with pp == 2 both neighbours are the same rank and share channel 2a.
  auto channel_of = [pp](int from, int to) {
    return static_cast<std::size_t>(2 * from + (to == (from + 1) % pp ? 0 : 1));
  };
  std::vector<detail::Channel> channels(2 * static_cast<std::size_t>(pp));
  std::vector<detail::StageRun> run(static_cast<std::size_t>(pp));
  std::vector<int> ready;
  ready.reserve(static_cast<std::size_t>(pp));
  for (int st = pp - 1; st >= 0; --st) ready.push_back(st);

  auto at = [&](int st, std::size_t i) -> const Instruction& {
    return s.stages[static_cast<std::size_t>(st)][i];
  };
  auto describe = [&](int st, std::size_t i) {
    return zero::detail::concat("stage ", st, " instruction ", i, " (", to_string(at(st, i)), ")");
  };
  // The partner of a send must be the same message seen from the other side.
  auto agree = [&](const detail::Posted& send, const detail::Posted& recv) {
    const Instruction& a = at(send.stage, static_cast<std::size_t>(send.index));
    const Instruction& b = at(recv.stage, static_cast<std::size_t>(recv.index));
    const bool act = a.op == Op::send_activation;
    const auto target = act ? activation_target(shape, {send.stage, a.chunk})
                            : gradient_target(shape, {send.stage, a.chunk});
    const bool ok = b.op == (act ? Op::recv_activation : Op::recv_gradient) && b.micro == a.micro &&
                    b.chunk == target->chunk;
    if (ok) [[likely]]
      return;
    raise<ScheduleError>(
        label, ": ", describe(send.stage, static_cast<std::size_t>(send.index)), " meets ",
        describe(recv.stage, static_cast<std::size_t>(recv.index)),
        "; sends from one stage to another match that stage's recvs in posting order, so both "
        "lists must post these messages in the same order (expected ",
        name_of(act ? Op::recv_activation : Op::recv_gradient), " (micro ", a.micro, ", chunk ",
        target->chunk, ") from stage ", send.stage, ")");
  };
  // Posts comm instruction i of stage st at time t; returns true when it matched at once.
  auto post = [&](int st, std::size_t i, double t) {
    const Instruction& in = at(st, i);
    const bool send = is_send(in.op);
    detail::Channel& ch =
        send ? channels[channel_of(st, in.peer)] : channels[channel_of(in.peer, st)];
    const detail::Posted me{st, static_cast<int>(i), t};
    if (!ch.has(!send)) {
      ch.push(send, me);
      return false;
    }
    const detail::Posted other = ch.pop();
    send ? agree(me, other) : agree(other, me);
    const double done = std::max(t, other.time);
    detail::StageRun& r = run[static_cast<std::size_t>(st)];
    r.group_done = std::max(r.group_done, done);
    detail::StageRun& o = run[static_cast<std::size_t>(other.stage)];
    o.group_done = std::max(o.group_done, done);
    if (--o.pending == 0) ready.push_back(other.stage);
    return true;
  };

  while (!ready.empty()) {
    const int st = ready.back();
    ready.pop_back();
    detail::StageRun& r = run[static_cast<std::size_t>(st)];
    const auto& list = s.stages[static_cast<std::size_t>(st)];
    if (r.blocked) {  // resumed: its open group is complete
      r.blocked = false;
      r.clock = r.group_done;
      r.pc = r.group_end + 1;
    }
    while (r.pc < list.size()) {
      const Instruction& in = list[r.pc];
      if (is_compute(in.op)) {
        double cost = 0.0;
        switch (in.op) {
          case Op::forward:
            cost = costs.forward;
            r.peak = std::max(r.peak, ++r.live);
            break;
          case Op::backward:
          case Op::backward_input: {
            cost = in.op == Op::backward ? costs.backward : costs.backward_input;
            if (in.op == Op::backward) --r.live;
            const Instruction* f = r.last_compute;
            if (f == nullptr || f->op != Op::forward || f->micro != in.micro ||
                f->chunk != in.chunk) {
              cost += costs.recompute_forward;
              ++r.recomputed;
            }
            break;
          }
          case Op::backward_weight:
            cost = costs.backward_weight;
            --r.live;
            break;
          default:
            break;
        }
        r.clock += cost;
        r.busy += cost;
        r.last_compute = &in;
        ++r.pc;
        continue;
      }
      std::size_t end = r.pc;
      while (end + 1 < list.size() && list[end].grouped_with_next && !is_compute(list[end + 1].op))
        ++end;
      r.group_end = end;
      r.group_done = r.clock;
      r.pending = 0;
      for (std::size_t i = r.pc; i <= end; ++i) {
        if (!post(st, i, r.clock)) ++r.pending;
      }
      if (r.pending > 0) {  // resumed by the post that matches its last op
        r.blocked = true;
        break;
      }
      r.clock = r.group_done;
      r.pc = end + 1;
    }
    if (r.pc >= list.size()) r.finished = true;
  }

  std::vector<detail::Posted> waiting;
  for (const detail::Channel& ch : channels)
    waiting.insert(waiting.end(), ch.waiting.begin() + static_cast<std::ptrdiff_t>(ch.head),
                   ch.waiting.end());
  if (!waiting.empty()) {
    std::sort(waiting.begin(), waiting.end(), [](const detail::Posted& a, const detail::Posted& b) {
      return a.stage != b.stage ? a.stage < b.stage : a.index < b.index;
    });
    std::vector<std::string> blocked;
    for (const detail::Posted& p : waiting) {
      const Instruction& in = at(p.stage, static_cast<std::size_t>(p.index));
      const detail::StageRun& peer = run[static_cast<std::size_t>(in.peer)];
      blocked.push_back(zero::detail::concat(
          describe(p.stage, static_cast<std::size_t>(p.index)), " waits for stage ", in.peer,
          peer.finished ? zero::detail::concat(", which has finished its list")
                        : zero::detail::concat(", which waits at instruction ", peer.pc)));
    }
    std::string what;
    for (const std::string& b : blocked) what += (what.empty() ? "" : "; ") + b;
    raise<ScheduleError>(label, ": deadlock, no stage can go on: ", what,
                         ". Post the send and the recv two stages wait on in one group "
                         "(grouped_with_next), as Megatron's send_forward_recv_backward does, or "
                         "reorder them");
  }

  ScheduleReport report;
  report.stages.resize(static_cast<std::size_t>(pp));
  for (int st = 0; st < pp; ++st) {
    const detail::StageRun& r = run[static_cast<std::size_t>(st)];
    report.stages[static_cast<std::size_t>(st)] = {r.peak, r.busy, r.clock, r.recomputed};
    report.makespan = std::max(report.makespan, r.clock);
  }
  // The time the busiest stage waits, as the executor measures it (PipelineStep): the pipeline
  // moves at that stage's pace, so its idle time is the bubble.
  double busiest = 0.0;
  for (const StageReport& r : report.stages) busiest = std::max(busiest, r.busy);
  if (busiest > 0.0) report.bubble_fraction = (report.makespan - busiest) / busiest;
  return report;
}

}  // namespace zero::parallel::pipeline
