#pragma once
// MicroSteps: where an engine is inside its accumulation window, and the StepContext that flows
// between units. A micro-step runs the forward of every unit (in one call or in ranges that
// follow each other upwards from unit 0), then their backward (downwards, after the whole
// forward); unit 0's backward ends it. After gradient_accumulation_steps micro-steps the
// boundary is pending until the engine's step() finishes the window. Ranges out of this order
// are Errors naming the range and the unit expected, so a pipeline executor that drives slices
// wrongly is told where.
// A pipeline executor runs passes instead: one micro-batch (its index given) through one range,
// forward then backward, with other micro-batches' passes free to run in between: the pass in
// flight is parked (its arena, context and the units' saved state set aside in a ParkedPass,
// and a fresh arena taken for the next pass) and resumed before its backward, or, for a model
// that cannot park, discarded and run again. Each unit counts its own backward passes, so its
// accumulation boundary is its own last pass, whatever order the schedule runs micro-batches
// and ranges in. A backward may be split in two (zero-bubble schedules): the input half ends
// the pass, and the weight half, later, completes the units' gradients; a unit's passes count
// its weight halves. A pass counts against its units' window from its forward on (parked or
// not), so no more passes start than the window holds; a parked pass dropped gives its place
// back, and one kept past the end of its window cannot be resumed into the next.

#include <algorithm>
#include <any>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <zero/core/arena.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/engine/engine_options.hpp>
#include <zero/nn/context.hpp>
#include <zero/nn/kernels.hpp>

namespace zero::engine {

/// A contiguous range of units [first, last).
struct UnitRange {
  int first = 0;
  int last = 0;
  friend bool operator==(const UnitRange&, const UnitRange&) = default;
};

template <class T>
class MicroSteps;

/// The training passes of one accumulation window whose forward began and whose backward has
/// not run (the pass in flight and the parked ones), per unit, and the activation bytes the
/// parked ones hold. A window's MicroSteps and its parked passes share it: a parked pass dropped
/// takes itself out, and one whose window ended finds its ledger no longer the engine's.
struct OpenPasses {
  std::vector<int> per_unit;     // open passes through each unit (empty: none yet)
  std::size_t parked_bytes = 0;  // activation bytes of the parked ones

  int of(int u) const { return per_unit.empty() ? 0 : per_unit[static_cast<std::size_t>(u)]; }
  bool any() const {
    return std::any_of(per_unit.begin(), per_unit.end(), [](int n) { return n > 0; });
  }
  void open(UnitRange r, int num_units) {
    if (per_unit.empty()) per_unit.assign(static_cast<std::size_t>(num_units), 0);
    for (int u = r.first; u < r.last; ++u) ++per_unit[static_cast<std::size_t>(u)];
  }
  void close(UnitRange r) noexcept {
    for (int u = r.first; u < r.last; ++u) --per_unit[static_cast<std::size_t>(u)];
  }
};

/// A pass set aside between its forward and its backward (Engine::park_pass): its activation
/// arena, its context and what its units' forwards kept. Move-only; dropping it drops the pass
/// (its micro-batch may then start again).
template <class T>
class ParkedPass {
 public:
  ParkedPass() = default;
  ParkedPass(ParkedPass&&) = default;
  ParkedPass& operator=(ParkedPass&& other) noexcept {
    if (this != &other) {
      drop();
      arena_ = std::move(other.arena_);
      ctx_ = std::move(other.ctx_);
      range_ = other.range_;
      units_ = std::move(other.units_);
      window_ = std::move(other.window_);
    }
    return *this;
  }
  ~ParkedPass() { drop(); }
  /// True when it holds no pass.
  bool empty() const { return arena_ == nullptr; }
  /// The range the pass runs through.
  UnitRange range() const { return range_; }
  /// Bytes of activations it holds.
  std::size_t bytes() const { return arena_ ? arena_->used_bytes() : 0; }

 private:
  friend class MicroSteps<T>;
  // Gives the pass's place in its window back (nothing once resumed or moved from).
  void drop() noexcept {
    if (arena_ != nullptr && window_ != nullptr) {
      window_->close(range_);
      window_->parked_bytes -= arena_->used_bytes();
    }
    arena_.reset();
    window_.reset();
  }

  std::unique_ptr<BumpArena> arena_;
  nn::StepContext<T> ctx_;
  UnitRange range_;
  std::vector<std::any> units_;
  std::shared_ptr<OpenPasses> window_;  // the open passes of the window it was parked in
};

/// Makes an activation arena of the given bytes in the memory the units compute on (the
/// backend's make_arena).
using ArenaMaker = std::function<std::unique_ptr<BumpArena>(std::size_t bytes)>;

/// The micro-step state machine and the context of the micro-step in flight.
template <class T>
class MicroSteps {
 public:
  /// Activation arenas of activation_bytes from make_arena (host memory when none is given);
  /// every context it starts runs its layers on kernels (null: the host's) and draws its
  /// dropout masks under seed (nn::StepContext::seed).
  MicroSteps(std::size_t activation_bytes, int accumulation_steps, ArenaMaker make_arena = {},
             nn::Kernels<T>* kernels = nullptr, std::uint64_t seed = 0)
      : arena_bytes_(activation_bytes),
        make_arena_(make_arena ? std::move(make_arena) : host_arenas()),
        arena_(make_arena_(activation_bytes)),
        kernels_(kernels),
        seed_(seed),
        accumulation_(accumulation_steps) {}

  /// The context the units read and write.
  nn::StepContext<T>& ctx() { return ctx_; }
  const nn::StepContext<T>& ctx() const { return ctx_; }
  /// Micro-steps finished in this window.
  int done() const { return done_; }
  /// True when this micro-step is the window's last (its reductions are the boundary's).
  bool at_boundary() const { return done_ + 1 == accumulation_; }
  /// True once the window's last micro-step finished and step() has not run yet.
  bool boundary_pending() const { return boundary_pending_; }
  /// True with no micro-step (or pass) of a window done or in flight.
  bool between_steps() const {
    return done_ == 0 && !boundary_pending_ && phase_ == Phase::idle && !passes_started();
  }
  /// True while no micro-step is in flight.
  bool idle() const { return phase_ == Phase::idle; }
  /// True when the whole forward ran and no backward yet.
  bool forward_done() const { return phase_ == Phase::forward_done; }
  /// Highest bytes the activation arenas held at once so far (the running pass's arena and the
  /// parked passes').
  std::size_t activation_peak_bytes() const {
    return std::max(peak_, open_->parked_bytes + arena_->peak_bytes());
  }
  /// Micro-steps in this window whose loss was Inf/NaN.
  std::int64_t nonfinite_losses() const { return nonfinite_; }

  /// Starts a micro-step on batch: a fresh arena and context. rng_step selects dropout masks;
  /// loss_scale seeds the backward.
  void begin(const MicroBatch& batch, bool training, std::uint64_t rng_step, double loss_scale,
             int num_units) {
    ctx_ = batch.template context<T>(*arena_, training, rng_step, kernels_);
    ctx_.seed = seed_;
    ctx_.window = window_;
    ctx_.loss_scale = static_cast<compute_type_t<T>>(loss_scale);
    phase_ = Phase::forward;
    next_forward_ = 0;
    next_backward_ = num_units;
    num_units_ = num_units;
  }
  /// Checks that r may run forward now; a range from unit 0 must then begin() a micro-step.
  void check_forward(UnitRange r, int num_units) const {
    check_range(r, num_units, "forward_units");
    expect<Error>(!passes_started(),
                  "Engine::forward_units: this accumulation window runs "
                  "pipeline passes (forward_pass); finish it with step()");
    if (r.first == 0) {
      expect<Error>(phase_ == Phase::idle,
                    "Engine::forward: the last micro-step's backward has not run; call backward "
                    "(or backward_units down to unit 0) first");
      expect<Error>(!boundary_pending_,
                    "Engine::forward: the accumulation boundary was reached; call step() first");
    } else {
      expect<Error>(phase_ == Phase::forward && r.first == next_forward_,
                    "Engine::forward_units: ", "units [", r.first, ", ", r.last,
                    ") do not follow the forward run so far ", "(next unit ", next_forward_, ")");
    }
  }
  /// Records that r ran forward (counting a non-finite loss once the last unit ran).
  void forward_ran(UnitRange r) {
    next_forward_ = r.last;
    if (r.last == num_units_) {
      phase_ = ctx_.training ? Phase::forward_done : Phase::idle;
      if (ctx_.training && !std::isfinite(convert<double>(ctx_.loss))) ++nonfinite_;
    }
  }
  /// Checks that r may run backward now.
  void check_backward(UnitRange r, int num_units) const {
    check_range(r, num_units, "backward_units");
    expect<Error>(phase_ == Phase::forward_done || phase_ == Phase::backward,
                  "Engine::backward_units: the forward of every unit must run first");
    expect<Error>(r.last == next_backward_, "Engine::backward_units: units [", r.first, ", ",
                  r.last, ") do not follow the backward run so far (next unit ", next_backward_ - 1,
                  ")");
  }
  /// Records that r ran backward; true when that ended the micro-step (unit 0 done).
  bool backward_ran(UnitRange r) {
    phase_ = Phase::backward;
    next_backward_ = r.first;
    if (r.first > 0) return false;
    phase_ = Phase::idle;
    if (++done_ == accumulation_) boundary_pending_ = true;
    return true;
  }
  /// Drops a micro-step whose forward threw, as if it had not begun (the window's earlier
  /// micro-steps stay); nothing when no forward is in flight.
  void abandon_forward() {
    if (phase_ == Phase::forward) {
      phase_ = Phase::idle;
      next_forward_ = 0;
    }
  }
  /// Drops the pass in flight, if any (an evaluation or pass whose forward threw).
  void abandon_pass() {
    if (phase_ == Phase::pass) close_pass();
  }
  /// Ends a window that failed part-way (a backward that threw): as finish_window, with no
  /// micro-step in flight either.
  void abandon_window() {
    finish_window();
    phase_ = Phase::idle;
    next_forward_ = 0;
  }
  /// Ends the window (after step(), or when a failed step left it).
  void finish_window() {
    ++window_;
    done_ = 0;
    boundary_pending_ = false;
    nonfinite_ = 0;
    unit_passes_.clear();
    unit_inputs_.clear();
    // Passes still parked belong to the window that ended: a fresh ledger leaves them out.
    open_ = std::make_shared<OpenPasses>();
    pass_counted_ = false;
    if (phase_ == Phase::pass) phase_ = Phase::idle;
  }

  // ---- pipeline passes ------------------------------------------------------------------------

  /// Checks that micro-batch `micro`'s pass through r may start now (no pass or micro-step in
  /// flight, the window open, micro inside it).
  void check_pass(UnitRange r, int micro, int num_units) const {
    check_range(r, num_units, "forward_pass");
    expect<Error>(phase_ == Phase::idle, "Engine::forward_pass: units [", r.first, ", ", r.last,
                  "): ",
                  phase_ == Phase::pass ? "the last pass was neither run backward nor discarded"
                                        : "a micro-step of forward_units is in flight");
    expect<Error>(done_ == 0,
                  "Engine::forward_pass: this window ran forward_units micro-steps; "
                  "finish it with step() first");
    expect<Error>(!boundary_pending_,
                  "Engine::forward_pass: the accumulation boundary was reached; call step() first");
    expect<Error>(0 <= micro && micro < accumulation_, "Engine::forward_pass: micro-batch ", micro,
                  " is outside the window of ", accumulation_, " (gradient_accumulation_steps)");
    for (int u = r.first; u < r.last; ++u) {
      expect<Error>(inputs_of(u) + open_->of(u) < accumulation_, "Engine::forward_pass: unit ", u,
                    " already has the window's ", accumulation_, " passes (", inputs_of(u),
                    " ran backward, ", open_->of(u),
                    " parked or in flight; drop a parked pass to run its micro-batch again)");
    }
  }
  /// Starts a pass through r: a fresh arena and context (training: dropout on and a backward
  /// to follow; rng_step selects the dropout masks of its micro-batch).
  void begin_pass(const MicroBatch& batch, std::uint64_t rng_step, double loss_scale, UnitRange r,
                  int num_units, bool training = true) {
    ctx_ = batch.template context<T>(*arena_, training, rng_step, kernels_);
    ctx_.seed = seed_;
    ctx_.window = window_;
    ctx_.loss_scale = static_cast<compute_type_t<T>>(loss_scale);
    if (unit_passes_.empty()) {
      unit_passes_.assign(static_cast<std::size_t>(num_units), 0);
      unit_inputs_.assign(static_cast<std::size_t>(num_units), 0);
    }
    phase_ = Phase::pass;
    pass_ = r;
    pass_counted_ = training;  // an evaluation takes no place in the window
    if (training) open_->open(r, num_units);
  }
  /// The range of the pass in flight; Error unless a pass's forward ran.
  UnitRange pass_in_flight(const char* what) const {
    expect<Error>(phase_ == Phase::pass, "Engine::", what,
                  ": no pass is in flight (forward_pass "
                  "first)");
    return pass_;
  }
  /// True when the pass in flight is unit u's last backward of the window.
  bool pass_at_boundary(int u) const { return passes_of(u) + 1 == accumulation_; }
  /// True when the backward in flight (a micro-step's, or a pass's whole backward or input
  /// half) is unit u's last of the window (nn::StepContext::window_end). An input half runs
  /// before the weight halves of earlier passes may have, so it counts input halves.
  bool last_backward_of_window(int u) const {
    return phase_ == Phase::pass ? inputs_of(u) + 1 == accumulation_ : at_boundary();
  }
  /// Records that the pass in flight ran its backward's input half (the whole backward is
  /// both halves), counting a non-finite loss when it held the last unit; the next pass may
  /// start.
  void pass_input_ran(int num_units) {
    for (int u = pass_.first; u < pass_.last; ++u) ++unit_inputs_[static_cast<std::size_t>(u)];
    if (pass_.last == num_units && !std::isfinite(convert<double>(ctx_.loss))) ++nonfinite_;
    close_pass();
  }
  /// Checks that a weight half over r may run: an input half over r left one.
  void check_weight_pass(UnitRange r, int num_units) const {
    check_range(r, num_units, "weight_pass");
    for (int u = r.first; u < r.last; ++u) {
      expect<Error>(weight_passes_outstanding(u) > 0, "Engine::weight_pass: units [", r.first, ", ",
                    r.last, "): unit ", u,
                    " has no backward_input_pass waiting for its weight half");
    }
  }
  /// Input halves of unit u whose weight half has not run.
  int weight_passes_outstanding(int u) const {
    return unit_inputs_.empty() ? 0 : inputs_of(u) - passes_of(u);
  }
  /// Records the weight half over r (after pass_input_ran, at once for a whole backward); true
  /// when that was every unit's last pass (the boundary is then pending).
  bool weight_pass_ran(UnitRange r, int num_units) {
    for (int u = r.first; u < r.last; ++u) ++unit_passes_[static_cast<std::size_t>(u)];
    for (int u = 0; u < num_units; ++u) {
      if (passes_of(u) < accumulation_) return false;
    }
    boundary_pending_ = true;
    return true;
  }
  /// Drops the pass in flight without its backward (its forward runs again before it).
  void discard_pass() {
    (void)pass_in_flight("discard_pass");
    close_pass();
  }
  /// Sets the pass in flight aside with units, what its units' forwards kept (in range order),
  /// and takes a fresh arena for the next pass.
  ParkedPass<T> park(std::vector<std::any> units) {
    (void)pass_in_flight("park_pass");
    fold_peak();
    ParkedPass<T> p;
    p.arena_ = std::exchange(arena_, take_arena());
    p.ctx_ = std::move(ctx_);
    ctx_ = {};
    p.range_ = pass_;
    p.units_ = std::move(units);
    p.window_ = open_;  // its place in the window goes with it
    open_->parked_bytes += p.bytes();
    phase_ = Phase::idle;
    return p;
  }
  /// Makes p the pass in flight again (no pass may be in flight); returns what its units kept,
  /// for the model to take back.
  std::vector<std::any> resume(ParkedPass<T>&& p) {
    expect<Error>(!p.empty(), "Engine::resume_pass: the parked pass is empty (resumed before?)");
    expect<Error>(p.window_ == open_, "Engine::resume_pass: units [", p.range_.first, ", ",
                  p.range_.last,
                  "): the pass was parked in an accumulation window that a failure ended (a "
                  "backward or an update that threw); run its forward again");
    expect<Error>(phase_ == Phase::idle, "Engine::resume_pass: units [", pass_.first, ", ",
                  pass_.last, ") of another pass are in flight; run or park it first");
    fold_peak();
    open_->parked_bytes -= p.bytes();
    p.window_.reset();  // its place in the window is the pass in flight's again
    pass_counted_ = true;
    arena_->reset();
    spare_arenas_.push_back(std::exchange(arena_, std::move(p.arena_)));
    ctx_ = std::move(p.ctx_);
    pass_ = p.range_;
    phase_ = Phase::pass;
    return std::move(p.units_);
  }

 private:
  enum class Phase : unsigned char { idle, forward, forward_done, backward, pass };

  // True once a pass of this window ran its backward or is parked.
  bool passes_started() const {
    for (int n : unit_inputs_) {
      if (n > 0) return true;
    }
    return open_->any();
  }
  // The pass in flight ends (backward ran, or dropped): it leaves the window's open passes.
  void close_pass() noexcept {
    if (pass_counted_) open_->close(pass_);
    pass_counted_ = false;
    phase_ = Phase::idle;
  }
  int passes_of(int u) const {
    return unit_passes_.empty() ? 0 : unit_passes_[static_cast<std::size_t>(u)];
  }
  int inputs_of(int u) const {
    return unit_inputs_.empty() ? 0 : unit_inputs_[static_cast<std::size_t>(u)];
  }

  // A cleared arena for the next pass: a spare one, else a new one of the configured size.
  std::unique_ptr<BumpArena> take_arena() {
    if (spare_arenas_.empty()) return make_arena_(arena_bytes_);
    std::unique_ptr<BumpArena> a = std::move(spare_arenas_.back());
    spare_arenas_.pop_back();
    return a;
  }
  // Records the running arena's high-water mark on top of what the parked passes hold (constant
  // since the last park or resume), before either changes.
  void fold_peak() {
    peak_ = std::max(peak_, open_->parked_bytes + arena_->peak_bytes());
    arena_->reset_peak();
  }

  static void check_range(UnitRange r, int num_units, const char* what) {
    expect<Error>(0 <= r.first && r.first < r.last && r.last <= num_units, "Engine::", what,
                  ": units [", r.first, ", ", r.last, ") are not a non-empty range of the ",
                  num_units, " units");
  }

  // Arenas of host memory: the default.
  static ArenaMaker host_arenas() {
    return [](std::size_t bytes) -> std::unique_ptr<BumpArena> {
      return std::make_unique<Arena<Host>>(bytes, "engine activations");
    };
  }

  std::size_t arena_bytes_;
  ArenaMaker make_arena_;
  std::unique_ptr<BumpArena> arena_;                      // the running pass's (or micro-step's)
  std::vector<std::unique_ptr<BumpArena>> spare_arenas_;  // of resumed passes, reused
  std::shared_ptr<OpenPasses> open_ = std::make_shared<OpenPasses>();  // this window's
  std::size_t peak_ = 0;     // activation_peak_bytes() before the last park or resume
  nn::Kernels<T>* kernels_;  // the layers' kernels (null: the host's)
  std::uint64_t seed_;       // every context's dropout seed
  nn::StepContext<T> ctx_;
  int accumulation_ = 1;
  int done_ = 0;
  bool boundary_pending_ = false;
  std::int64_t nonfinite_ = 0;
  Phase phase_ = Phase::idle;
  int next_forward_ = 0, next_backward_ = 0, num_units_ = 0;
  std::vector<int> unit_passes_;  // backward passes per unit in this window (pipeline passes)
  std::vector<int> unit_inputs_;  // of which the input half ran (split backwards run it first)
  UnitRange pass_;
  bool pass_counted_ = false;  // the pass in flight is a training pass (open_ counts it)
  std::uint64_t window_ = 0;   // windows ended so far (nn::StepContext::window)
};

}  // namespace zero::engine
