// DeepSpeed-Ulysses sequence parallelism, layer by layer: the sequence <-> head all-to-alls put
// every element where the layout says and invert each other; UlyssesAttention at sp 1, 2 and 4
// equals CausalSelfAttention on the whole sequence, forward and backward (f64 1e-12; f32 and
// bf16 too), and parks; a rank fed another rank's positions differs (negative control); heads
// not divisible by sp are refused naming the keys; the communication of one attention forward
// and backward is 4 all-to-alls of 8*B*(T/sp)*C elements in all; the position embedding of a
// sequence shard adds the shard's positions.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/process_groups.hpp>
#include <parallel/sequence/sequence_all_to_all.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <parallel/sequence/ulysses_attention.hpp>
#include <parallel/tensor_parallel/tensor_parallel.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/rng.hpp>
#include <zero/nn/gpt_config.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/position_embedding.hpp>

#include "../support/per_rank.hpp"
#include "../support/worse.hpp"

using namespace zero;
using Catch::Matchers::Contains;
using parallel::LocalComm;
using parallel::SequenceParallel;

namespace {

std::vector<double> random_values(std::int64_t n, std::uint64_t seed) {
  std::vector<double> v(static_cast<std::size_t>(n));
  fill_normal(Tensor<double>(v.data(), Shape{n}), CounterRng(seed), 0, 0.0, 1.0);
  return v;
}

template <class V>
std::vector<V> converted(const std::vector<double>& v) {
  std::vector<V> out;
  for (double x : v) out.push_back(convert<V>(x));
  return out;
}

template <class V>
double max_diff(const std::vector<V>& a, const std::vector<V>& b) {
  if (a.size() != b.size()) return INFINITY;
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    w = zero::testing::worse(w, std::fabs(convert<double>(a[i]) - convert<double>(b[i])));
  }
  return w;
}

// Rows of positions [first, first + count) of each of B sequences of T positions, from a
// row-major [B*T, cols] matrix: [B*count, cols].
template <class V>
std::vector<V> position_rows(const std::vector<V>& m, std::int64_t batch, std::int64_t seq_len,
                             std::int64_t cols, std::int64_t first, std::int64_t count) {
  std::vector<V> out;
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto at = m.begin() + (b * seq_len + first) * cols;
    out.insert(out.end(), at, at + count * cols);
  }
  return out;
}

constexpr std::int64_t B = 2, T = 8, C = 16, NH = 4;

}  // namespace

TEST_CASE("Ulysses all-to-alls: the head split's layout, and heads_to_sequence inverts it",
          "[unit][ulysses]") {
  const std::int64_t pieces = 3;
  const auto whole = random_values(B * T * pieces * C, 7);  // [B, T, pieces*C]
  for (int sp : {1, 2, 4}) {
    struct Result {
      double layout = 0, round_trip = 0, accumulated = 0;
    };
    const auto results = testing::per_rank<Result>(sp, [&](LocalComm& comm) {
      const SequenceParallel group(comm);
      const std::int64_t Tl = T / sp, Cs = C / sp, r = comm.rank();
      Arena<> arena(1 << 20);
      const auto local = position_rows(whole, B, T, pieces * C, r * Tl, Tl);
      std::vector<double> heads(static_cast<std::size_t>(B * T * pieces * Cs));
      parallel::sequence_to_heads(group, arena, local.data(), heads.data(), B, Tl, pieces, C);
      Result res;
      // Every position of every sequence, this rank's channels of each piece, pieces packed.
      for (std::int64_t row = 0; row < B * T; ++row) {
        for (std::int64_t j = 0; j < pieces; ++j) {
          for (std::int64_t c = 0; c < Cs; ++c) {
            const double want =
                whole[static_cast<std::size_t>(row * pieces * C + j * C + r * Cs + c)];
            const double got = heads[static_cast<std::size_t>(row * pieces * Cs + j * Cs + c)];
            res.layout = std::max(res.layout, std::fabs(got - want));
          }
        }
      }
      std::vector<double> back(local.size(), -1.0);
      parallel::heads_to_sequence(group, arena, heads.data(), back.data(), B, Tl, pieces, C);
      res.round_trip = max_diff(back, local);
      // accumulate adds into what is there: local + local.
      parallel::heads_to_sequence(group, arena, heads.data(), back.data(), B, Tl, pieces, C, true);
      for (std::size_t i = 0; i < back.size(); ++i) {
        res.accumulated = std::max(res.accumulated, std::fabs(back[i] - 2 * local[i]));
      }
      return res;
    });
    INFO("sp " << sp);
    for (const Result& r : results) {
      CHECK(r.layout == 0.0);
      CHECK(r.round_trip == 0.0);
      CHECK(r.accumulated == 0.0);
    }
  }
}

namespace {

// One attention forward and backward: qkv [B*T, 3C] and dy [B*T, C], whole sequences.
struct AttentionData {
  std::vector<double> qkv = random_values(B * T * 3 * C, 11), dy = random_values(B * T * C, 12);
};

template <class Val>
struct AttentionResult {
  std::vector<Val> y, dqkv;
  std::int64_t seq_len_after = 0;  // ctx.seq_len after forward (must be the rank's own)
  std::int64_t macs = 0;
};

// Runs a layer forward and backward on [rows, 3C] with (batch, seq_len).
template <class Val>
AttentionResult<Val> run_attention(nn::Layer<Val>& layer, const std::vector<Val>& qkv,
                                   const std::vector<Val>& dy, std::int64_t seq_len) {
  const std::int64_t rows = B * seq_len;
  Arena<> arena(4 << 20);
  std::vector<Val> in = qkv;
  nn::StepContext<Val> ctx;
  ctx.arena = &arena;
  ctx.batch = B;
  ctx.seq_len = seq_len;
  ctx.x = Tensor<Val>(in.data(), Shape{rows, 3 * C});
  layer.forward(ctx);
  AttentionResult<Val> res;
  res.seq_len_after = ctx.seq_len;
  res.y.assign(ctx.x.begin(), ctx.x.end());
  const auto flops = layer.forward_flops({Shape{rows, 3 * C}, B, seq_len});
  res.macs = flops ? flops->macs : -1;
  std::vector<Val> g = dy, dx(in.size(), Val(0));
  ctx.dy = Tensor<Val>(g.data(), Shape{rows, C});
  ctx.dx = Tensor<Val>(dx.data(), Shape{rows, 3 * C});
  layer.backward(ctx);
  res.dqkv = dx;
  return res;
}

// Each rank of sp runs UlyssesAttention on positions of block `block(rank)` and returns its
// results; the whole layer's rows of that rank's block are what it must equal.
template <class Val>
std::vector<AttentionResult<Val>> ulysses_ranks(int sp, const AttentionData& data,
                                                int rank_offset = 0) {
  const auto qkv = converted<Val>(data.qkv), dy = converted<Val>(data.dy);
  return testing::per_rank<AttentionResult<Val>>(sp, [&](LocalComm& comm) {
    const SequenceParallel group(comm);
    const std::int64_t Tl = T / sp, block = (comm.rank() + rank_offset) % sp;
    parallel::UlyssesAttention<Val> layer(group, NH);
    return run_attention<Val>(layer, position_rows(qkv, B, T, 3 * C, block * Tl, Tl),
                              position_rows(dy, B, T, C, block * Tl, Tl), Tl);
  });
}

template <class Val>
AttentionResult<Val> whole_attention(const AttentionData& data) {
  nn::CausalSelfAttention<Val> whole(NH);
  return run_attention<Val>(whole, converted<Val>(data.qkv), converted<Val>(data.dy), T);
}

// Worst difference of the ranks' outputs and input gradients from the whole layer's rows.
template <class Val>
double worst_error(const std::vector<AttentionResult<Val>>& ranks, const AttentionResult<Val>& want,
                   int sp) {
  const std::int64_t Tl = T / sp;
  double w = 0;
  for (int r = 0; r < sp; ++r) {
    const auto& got = ranks[static_cast<std::size_t>(r)];
    w = zero::testing::worse(w, max_diff(got.y, position_rows(want.y, B, T, C, r * Tl, Tl)));
    w = zero::testing::worse(w,
                             max_diff(got.dqkv, position_rows(want.dqkv, B, T, 3 * C, r * Tl, Tl)));
  }
  return w;
}

}  // namespace

TEST_CASE("UlyssesAttention at sp 1, 2, 4 equals CausalSelfAttention on whole sequences (f64)",
          "[unit][ulysses]") {
  const AttentionData data;
  const auto want = whole_attention<double>(data);
  for (int sp : {1, 2, 4}) {
    const auto ranks = ulysses_ranks<double>(sp, data);
    const double error = worst_error(ranks, want, sp);
    std::int64_t macs = 0;
    for (const auto& r : ranks) {
      CHECK(r.seq_len_after == T / sp);  // the rank's own length is restored for later layers
      macs += r.macs;
    }
    INFO("sp " << sp << ": worst difference " << error);
    CHECK(error <= 1e-12);
    CHECK(macs == want.macs);  // the ranks' shares of the attention FLOPs add up to the whole
    if (sp == 1) continue;
    // Negative control: rank r fed rank r+1's positions (a wrong slice, or positions in the
    // wrong order) attends over a permuted sequence.
    const double wrong = worst_error(ulysses_ranks<double>(sp, data, 1), want, sp);
    INFO("wrong slice: " << wrong);
    CHECK(wrong > 1e-3);
  }
}

TEST_CASE("UlyssesAttention equals CausalSelfAttention bit for bit in f32 and bf16",
          "[unit][ulysses]") {
  // Each head's attention runs on the same numbers in the same order whatever sp; the
  // all-to-alls only move them, and the gradient is added into a zeroed buffer once.
  const AttentionData data;
  const auto want32 = whole_attention<float>(data);
  const auto want16 = whole_attention<bf16>(data);
  for (int sp : {2, 4}) {
    INFO("sp " << sp);
    CHECK(worst_error(ulysses_ranks<float>(sp, data), want32, sp) == 0.0);
    CHECK(worst_error(ulysses_ranks<bf16>(sp, data), want16, sp) == 0.0);
  }
}

TEST_CASE("UlyssesAttention parks: a parked forward resumed after another gives the same results",
          "[unit][ulysses]") {
  const AttentionData first, second{random_values(B * T * 3 * C, 21), random_values(B * T * C, 22)};
  const int sp = 2;
  const std::int64_t Tl = T / sp;
  struct Parked {
    double error = 0;
    int parks = 0;
  };
  const auto results = testing::per_rank<Parked>(sp, [&](LocalComm& comm) {
    const SequenceParallel group(comm);
    const std::int64_t first_pos = comm.rank() * Tl;
    auto local = [&](const std::vector<double>& m, std::int64_t cols) {
      return position_rows(m, B, T, cols, first_pos, Tl);
    };
    parallel::UlyssesAttention<double> layer(group, NH);
    const auto straight =
        run_attention<double>(layer, local(first.qkv, 3 * C), local(first.dy, C), Tl);
    // Forward of the first batch, parked; the second batch's forward and backward (on an arena
    // of its own, as the engine's parked passes); then the first one's backward.
    Arena<> arena_a(4 << 20);
    auto qkv = local(first.qkv, 3 * C);
    nn::StepContext<double> ctx;
    ctx.arena = &arena_a;
    ctx.batch = B;
    ctx.seq_len = Tl;
    ctx.x = Tensor<double>(qkv.data(), Shape{B * Tl, 3 * C});
    layer.forward(ctx);
    std::vector<double> y(ctx.x.begin(), ctx.x.end());
    std::any saved = layer.park();
    (void)run_attention<double>(layer, local(second.qkv, 3 * C), local(second.dy, C), Tl);
    layer.resume(std::move(saved));
    auto dy = local(first.dy, C);
    std::vector<double> dx(qkv.size(), 0.0);
    ctx.dy = Tensor<double>(dy.data(), Shape{B * Tl, C});
    ctx.dx = Tensor<double>(dx.data(), Shape{B * Tl, 3 * C});
    layer.backward(ctx);
    Parked p;
    p.parks = layer.parks() ? 1 : 0;
    p.error = std::max(max_diff(y, straight.y), max_diff(dx, straight.dqkv));
    return p;
  });
  for (const Parked& p : results) {
    CHECK(p.parks == 1);
    CHECK(p.error == 0.0);
  }
}

TEST_CASE(
    "Ulysses refuses heads not divisible by sp (by tp x sp with tensor parallelism) and "
    "sequences not divisible by sp, naming the keys",
    "[unit][ulysses]") {
  struct Messages {
    std::string layer, gpt, slice, with_tp, four_heads_with_tp;
  };
  const auto messages = testing::per_rank<Messages>(4, [&](LocalComm& comm) {
    const SequenceParallel group(comm);
    Messages m;
    m.layer = testing::thrown_message([&] { parallel::UlyssesAttention<double> layer(group, 6); });
    nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");  // 2 heads
    m.gpt = testing::thrown_message([&] { nn::LayerGPT<double> model(cfg, {}, group); });
    const std::vector<std::int32_t> tokens(2 * 6, 1);
    m.slice = testing::thrown_message([&] {
      (void)parallel::sequence_slice<std::int32_t>(tokens, 2, 6, group.size(), group.rank());
    });
    // tp 2 x sp 2 on the same ranks: each tp rank splits its heads over sp, so 2 heads do not
    // split and 4 do.
    parallel::ProcessGroups<LocalComm> groups(comm, parallel::Grid({.tp = 2, .cp = 2}));
    m.with_tp = testing::thrown_message([&] {
      nn::LayerGPT<double> model(cfg, parallel::TensorParallel(groups.tp()),
                                 SequenceParallel(groups.cp()));
    });
    nn::GPTConfig four = cfg;
    four.num_heads = 4;
    m.four_heads_with_tp = testing::thrown_message([&] {
      nn::LayerGPT<double> model(four, parallel::TensorParallel(groups.tp()),
                                 SequenceParallel(groups.cp()));
    });
    return m;
  });
  for (const Messages& m : messages) {
    CHECK_THAT(m.layer, Contains("num_heads") && Contains("= 6") && Contains("sp = 4"));
    CHECK_THAT(m.gpt, Contains("n_head (num_heads)") && Contains("= 2") && Contains("sp = 4"));
    CHECK_THAT(m.slice, Contains("seq_len 6") && Contains("sp = 4"));
    CHECK_THAT(m.with_tp, Contains("n_head (num_heads) = 2") &&
                              Contains("tensor_parallel.tp_size * sp = 2 * 2"));
    CHECK(m.four_heads_with_tp == testing::nothing_thrown);
  }
  // The same layer at sp 1 takes any head count.
  CHECK(testing::thrown_message([] { parallel::UlyssesAttention<double> layer({}, 6); }) ==
        testing::nothing_thrown);
}

TEST_CASE("Ulysses communication: 4 all-to-alls of 8*B*(T/sp)*C elements per attention",
          "[unit][ulysses]") {
  // Per rank, with e bytes per element and nccl-tests' S (the whole send buffer):
  //   forward:  qkv 3*B*(T/sp)*C*e, then the output B*(T/sp)*C*e;
  //   backward: the output gradient B*(T/sp)*C*e, then the qkv gradient 3*B*(T/sp)*C*e;
  // bus bytes (what a rank sends to the others) (sp-1)/sp of each. Nothing else.
  const AttentionData data;
  const auto e = static_cast<std::uint64_t>(sizeof(double));
  for (int sp : {1, 2, 4}) {
    struct Volume {
      std::uint64_t forward_bytes = 0, backward_bytes = 0, forward_ops = 0, backward_ops = 0,
                    other_ops = 0;
      double bus_bytes = 0;
    };
    const auto volumes = testing::per_rank<Volume>(sp, [&](LocalComm& comm) {
      auto logger = std::make_shared<parallel::CommLogger>();
      comm.set_logger(logger);
      const SequenceParallel group(comm);
      const std::int64_t Tl = T / sp, first = comm.rank() * Tl;
      parallel::UlyssesAttention<double> layer(group, NH);
      auto qkv = position_rows(data.qkv, B, T, 3 * C, first, Tl);
      auto dy = position_rows(data.dy, B, T, C, first, Tl);
      Arena<> arena(4 << 20);
      nn::StepContext<double> ctx;
      ctx.arena = &arena;
      ctx.batch = B;
      ctx.seq_len = Tl;
      ctx.x = Tensor<double>(qkv.data(), Shape{B * Tl, 3 * C});
      layer.forward(ctx);
      Volume v;
      const parallel::CommStats f = logger->total(parallel::CommOp::all_to_all);
      v.forward_bytes = f.bytes;
      v.forward_ops = f.count;
      std::vector<double> dx(qkv.size(), 0.0);
      ctx.dy = Tensor<double>(dy.data(), Shape{B * Tl, C});
      ctx.dx = Tensor<double>(dx.data(), Shape{B * Tl, 3 * C});
      layer.backward(ctx);
      comm.set_logger(nullptr);
      const parallel::CommStats all = logger->total(parallel::CommOp::all_to_all);
      v.backward_bytes = all.bytes - f.bytes;
      v.backward_ops = all.count - f.count;
      v.bus_bytes = all.bus_bytes;
      v.other_ops = logger->total().count - all.count;
      return v;
    });
    const std::uint64_t local = B * (T / sp) * C * e;  // B*(T/sp)*C elements' bytes
    const std::uint64_t forward = sp > 1 ? 3 * local + local : 0;
    INFO("sp " << sp);
    for (const Volume& v : volumes) {
      CHECK(v.forward_bytes == forward);
      CHECK(v.backward_bytes == forward);
      CHECK(v.forward_ops == (sp > 1 ? 2u : 0u));
      CHECK(v.backward_ops == (sp > 1 ? 2u : 0u));
      CHECK(v.other_ops == 0u);
      CHECK(v.bus_bytes == static_cast<double>(2 * forward) * (sp - 1) / sp);
    }
  }
}

TEST_CASE("PositionEmbedding of sequence shard r adds positions r*T/sp up to (r+1)*T/sp",
          "[unit][ulysses]") {
  // The table and the whole rows; shard r of sp = 4 must equal rows [r*Tl, (r+1)*Tl) of the
  // whole layer's output, and its table gradient the whole gradient's rows there (zero elsewhere).
  const std::int64_t sp = 4, Tl = T / sp, max_positions = 16;
  const auto table = random_values(max_positions * C, 31), x = random_values(B * T * C, 32),
             dy = random_values(B * T * C, 33);
  struct Out {
    std::vector<double> y, table_grad;
  };
  auto run = [&](std::int64_t shard, std::int64_t shards, std::int64_t seq_len,
                 const std::vector<double>& in, const std::vector<double>& g) {
    nn::PositionEmbedding<double> layer("wpe", max_positions, C);
    layer.set_sequence_shard(shard, shards);
    std::vector<double> values = table, grads(table.size(), 0.0);
    const nn::ParamView<double> view{Tensor<double>(values.data(), Shape{max_positions, C}),
                                     Tensor<double>(grads.data(), Shape{max_positions, C})};
    layer.bind(std::span<const nn::ParamView<double>>(&view, 1));
    Arena<> arena(1 << 20);
    std::vector<double> input = in, d = g, dx(in.size(), 0.0);
    nn::StepContext<double> ctx;
    ctx.arena = &arena;
    ctx.batch = B;
    ctx.seq_len = seq_len;
    ctx.x = Tensor<double>(input.data(), Shape{B * seq_len, C});
    layer.forward(ctx);
    Out o{std::vector<double>(ctx.x.begin(), ctx.x.end()), {}};
    ctx.dy = Tensor<double>(d.data(), Shape{B * seq_len, C});
    ctx.dx = Tensor<double>(dx.data(), Shape{B * seq_len, C});
    layer.backward(ctx);
    o.table_grad = grads;
    return o;
  };
  const Out whole = run(0, 1, T, x, dy);
  std::vector<double> summed(table.size(), 0.0);
  for (std::int64_t r = 0; r < sp; ++r) {
    const Out part = run(r, sp, Tl, position_rows(x, B, T, C, r * Tl, Tl),
                         position_rows(dy, B, T, C, r * Tl, Tl));
    INFO("shard " << r);
    CHECK(max_diff(part.y, position_rows(whole.y, B, T, C, r * Tl, Tl)) <= 1e-15);
    for (std::size_t i = 0; i < summed.size(); ++i) summed[i] += part.table_grad[i];
    if (r > 0) {  // negative control: the shard's rows with positions from 0
      const Out unshifted = run(0, sp, Tl, position_rows(x, B, T, C, r * Tl, Tl),
                                position_rows(dy, B, T, C, r * Tl, Tl));
      CHECK(max_diff(unshifted.y, position_rows(whole.y, B, T, C, r * Tl, Tl)) > 1e-3);
    }
  }
  CHECK(max_diff(summed, whole.table_grad) <= 1e-15);
  // 4 shards of seq_len 8 reach position 32 > 16: every shard refuses, not only the last ones
  // (shard 0 went on into the all-to-all while the others threw).
  for (std::int64_t r : {0, 3}) {
    CHECK_THAT(testing::thrown_message([&] { run(r, sp, T, x, dy); }),
               Contains("sequence length 32") && Contains("exceeds max_positions 16"));
  }
}
