// Tensor and sequence parallelism, layer by layer (f64): the region operators are adjoint pairs,
// each parallel layer equals its whole (tp = 1) counterpart forward and backward at tp 2 and 4,
// parts initialise as slices of the whole initialisation, and a GPT block split over tp equals
// the whole block, with negative controls (a missing all-reduce, a missing LayerNorm-gradient
// reduction) that the same comparison catches.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <parallel/comm/comm_logger.hpp>
#include <parallel/comm/local_comm.hpp>
#include <parallel/tensor_parallel/column_parallel_linear.hpp>
#include <parallel/tensor_parallel/region_layer.hpp>
#include <parallel/tensor_parallel/regions.hpp>
#include <parallel/tensor_parallel/row_parallel_linear.hpp>
#include <parallel/tensor_parallel/sequence_parallel_params.hpp>
#include <parallel/tensor_parallel/vocab_parallel_cross_entropy.hpp>
#include <parallel/tensor_parallel/vocab_parallel_embedding.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/rng.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/layers/activation.hpp>
#include <zero/nn/layers/attention.hpp>
#include <zero/nn/layers/layer_norm.hpp>
#include <zero/nn/layers/linear.hpp>
#include <zero/nn/layers/residual.hpp>
#include <zero/nn/layers/sequential.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cpu/cross_entropy.hpp>
#include <zero/ops/cpu/linear.hpp>

#include "../support/per_rank.hpp"
#include "../support/worse.hpp"

using namespace zero;
using parallel::LocalComm;
using parallel::Region;
using parallel::TensorParallel;

namespace {

std::vector<double> random_values(std::int64_t n, std::uint64_t seed) {
  std::vector<double> v(static_cast<std::size_t>(n));
  fill_normal(Tensor<double>(v.data(), Shape{n}), CounterRng(seed), 0, 0.0, 1.0);
  return v;
}

double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) w = zero::testing::worse(w, std::fabs(a[i] - b[i]));
  return w;
}

// The held part of a logical tensor `whole` under split.
std::vector<double> part_of(const nn::TensorSplit& split, const std::vector<double>& whole) {
  const std::int64_t n = split.part_shape().numel();
  std::vector<double> out(static_cast<std::size_t>(n));
  split.for_each_run(0, n, [&](std::int64_t logical, std::int64_t held, std::int64_t count) {
    std::copy_n(whole.begin() + logical, count, out.begin() + held);
  });
  return out;
}

// Rows [first, first + count) of a row-major [*, cols] matrix.
std::vector<double> rows_of(const std::vector<double>& m, std::int64_t cols, std::int64_t first,
                            std::int64_t count) {
  return {m.begin() + first * cols, m.begin() + (first + count) * cols};
}

}  // namespace

// Whether a region's input (output) is replicated: the same tensor on every rank, whose inner
// product counts once, rather than a tensor per rank, whose inner products add up over ranks.
// Megatron's pairs are adjoint on these spaces (an all-reduce's adjoint is the identity only
// because the gradient of a replicated output is itself replicated). gather_from_sp's output
// feeds a column-parallel layer, so each rank's gradient of it differs: a tensor per rank.
bool replicated_input(Region r) {
  return r == Region::copy_to_tp || r == Region::scatter_to_tp || r == Region::scatter_to_sp;
}
bool replicated_output(Region r) {
  return r == Region::reduce_from_tp || r == Region::gather_from_tp;
}

TEST_CASE("Region operators: each backward is the adjoint of its forward at tp 2 and 4",
          "[unit][tp]") {
  for (int tp : {2, 4}) {
    for (Region region : parallel::all_regions) {
      const std::int64_t rows = 8, cols = 12;
      struct Dots {
        double forward = 0, adjoint = 0, wrong = 0;
      };
      const auto dots = testing::per_rank<Dots>(tp, [&](LocalComm& comm) {
        const TensorParallel group(comm);
        const auto o = parallel::region_output_shape(region, tp, rows, cols);
        const auto rank = static_cast<std::uint64_t>(comm.rank());
        const auto x = random_values(rows * cols, replicated_input(region) ? 100 : 100 + rank);
        const auto y = random_values(o.rows * o.cols, replicated_output(region) ? 200 : 200 + rank);
        const bool counts_x = !replicated_input(region) || rank == 0;
        const bool counts_y = !replicated_output(region) || rank == 0;
        std::vector<double> ax(static_cast<std::size_t>(o.rows * o.cols));
        parallel::region_forward(region, group, x.data(), ax.data(), rows, cols);
        std::vector<double> aty(x.size(), 0.0);
        parallel::region_backward(region, group, y.data(), aty.data(), rows, cols);
        Dots d;
        d.forward = counts_y ? dot(ax.data(), y.data(), o.rows * o.cols) : 0.0;
        d.adjoint = counts_x ? dot(x.data(), aty.data(), rows * cols) : 0.0;
        // Negative control: copy_to_tp's backward taken as the identity is not its adjoint.
        if (region == Region::copy_to_tp) {
          std::vector<double> id(x.size(), 0.0);
          parallel::region_backward(Region::reduce_from_tp, group, y.data(), id.data(), rows, cols);
          d.wrong = counts_x ? dot(x.data(), id.data(), rows * cols) : 0.0;
        }
        return d;
      });
      double lhs = 0, rhs = 0, wrong = 0;
      for (const Dots& d : dots) {
        lhs += d.forward;
        rhs += d.adjoint;
        wrong += d.wrong;
      }
      INFO(parallel::name_of(region) << " at tp " << tp);
      CHECK(std::fabs(lhs - rhs) <= 1e-12 * (1 + std::fabs(lhs)));
      if (region == Region::copy_to_tp) CHECK(std::fabs(lhs - wrong) > 1e-3);
    }
  }
}

TEST_CASE("Region operators: gathers concatenate the ranks' blocks in rank order", "[unit][tp]") {
  const int tp = 4;
  const std::int64_t rows = 3, cols = 2;
  const auto results = testing::per_rank<std::vector<double>>(tp, [&](LocalComm& comm) {
    const TensorParallel group(comm);
    std::vector<double> x(rows * cols);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 100.0 * comm.rank() + static_cast<double>(i);
    std::vector<double> by_cols(rows * cols * tp), by_rows(rows * cols * tp);
    parallel::region_forward(Region::gather_from_tp, group, x.data(), by_cols.data(), rows, cols);
    parallel::region_forward(Region::gather_from_sp, group, x.data(), by_rows.data(), rows, cols);
    by_cols.insert(by_cols.end(), by_rows.begin(), by_rows.end());
    return by_cols;
  });
  for (int r = 0; r < tp; ++r) {
    const auto& got = results[static_cast<std::size_t>(r)];
    for (std::int64_t n = 0; n < rows; ++n) {
      for (int q = 0; q < tp; ++q) {
        for (std::int64_t c = 0; c < cols; ++c) {
          const double want = 100.0 * q + static_cast<double>(n * cols + c);
          CHECK(got[static_cast<std::size_t>((n * tp + q) * cols + c)] == want);  // columns
          CHECK(got[static_cast<std::size_t>(rows * cols * tp + (q * rows + n) * cols + c)] ==
                want);  // rows
        }
      }
    }
  }
}

TEST_CASE("TensorSplit: a rank's part initialises as the slice of the whole initialisation",
          "[unit][tp]") {
  for (int stride : {1, 3}) {
    const Shape whole{24, 5};
    nn::ParamSpec full{"transformer.h.0.attn.c_attn.weight", whole, nn::Init::normal, 0.02};
    std::vector<double> all(static_cast<std::size_t>(whole.numel()));
    nn::initialise(full, Tensor<double>(all.data(), whole), 0, 7);
    for (int parts : {2, 4}) {
      for (int index = 0; index < parts; ++index) {
        nn::ParamSpec spec = full;
        spec.split = nn::TensorSplit::of(whole, 0, parts, index, stride);
        spec.shape = spec.split.part_shape();
        std::vector<double> mine(static_cast<std::size_t>(spec.numel()));
        // In two pieces, as a data-parallel shard boundary would cut it.
        const std::int64_t cut = spec.numel() / 3;
        nn::initialise(spec, Tensor<double>(mine.data(), Shape{cut}), 0, 7);
        nn::initialise(spec, Tensor<double>(mine.data() + cut, Shape{spec.numel() - cut}), cut, 7);
        CHECK(mine == part_of(spec.split, all));
      }
    }
  }
  CHECK_THROWS_AS(nn::TensorSplit::of({10, 4}, 0, 4, 0), ShapeError);
  CHECK_THROWS_AS(nn::TensorSplit::of({12, 4}, 0, 2, 0, 4), ShapeError);  // 12 = 4 blocks of 3
}

namespace {

// A layer's forward and backward on one rank: binds the given values (zero gradients), runs x
// through it and dy back; returns [y, dx, grads...] flattened.
struct LayerRun {
  std::vector<double> y, dx;
  std::vector<std::vector<double>> grads;
  double loss = 0;
};

LayerRun run_layer(nn::Layer<double>& layer, std::vector<std::vector<double>> values,
                   const std::vector<double>& x, Shape x_shape, const std::vector<double>& dy,
                   std::int64_t batch, std::int64_t seq, const std::int32_t* tokens = nullptr,
                   const std::int32_t* targets = nullptr, double dx_start = 0.0) {
  const auto specs = layer.params();
  std::vector<std::vector<double>> grads;
  std::vector<nn::ParamView<double>> views;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    grads.emplace_back(values[i].size(), 0.0);
    views.push_back({Tensor<double>(values[i].data(), specs[i].shape),
                     Tensor<double>(grads[i].data(), specs[i].shape)});
  }
  layer.bind(views);
  Arena<> arena(8 << 20);
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  ctx.batch = batch;
  ctx.seq_len = seq;
  ctx.tokens = tokens;
  ctx.targets = targets;
  std::vector<double> input = x;
  if (!x.empty()) ctx.x = Tensor<double>(input.data(), x_shape);
  layer.forward(ctx);
  LayerRun r;
  r.loss = ctx.loss;
  r.y.assign(ctx.x.begin(), ctx.x.end());
  std::vector<double> dout = dy;
  std::vector<double> dx(x.size(), 0.0);
  ctx.dy = Tensor<double>(dout.data(), ctx.x.shape());
  ctx.dx = x.empty() ? Tensor<double>() : Tensor<double>(dx.data(), x_shape);
  if (targets != nullptr) {  // a loss layer writes dlogits into dx shaped like its input
    // (adding them to dx_start: overwrite_dx is false, as for a Residual branch's first layer)
    dx.assign(static_cast<std::size_t>(x_shape.numel()), dx_start);
    ctx.dx = Tensor<double>(dx.data(), x_shape);
  }
  layer.backward(ctx);
  r.dx = dx;
  r.grads = grads;
  return r;
}

}  // namespace

TEST_CASE("ColumnParallelLinear and RowParallelLinear equal a whole Linear at tp 2 and 4",
          "[unit][tp]") {
  const std::int64_t B = 2, T = 4, N = B * T, in = 8, out = 12;
  const auto W = random_values(out * in, 1), b = random_values(out, 2),
             x = random_values(N * in, 3);
  const auto dy = random_values(N * out, 4);
  nn::Linear<double> whole("fc", in, out);
  const LayerRun want = run_layer(whole, {W, b}, x, Shape{N, in}, dy, B, T);
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      for (int stride : {1, 3}) {
        if (out % (tp * stride) != 0) continue;
        const auto errors = testing::per_rank<double>(tp, [&](LocalComm& comm) {
          const TensorParallel group(comm, sp);
          parallel::ColumnParallelLinear<double> layer(group, "fc", in, out, true, 0.0, stride);
          const auto specs = layer.params();
          const std::int64_t rows = sp ? N / tp : N, first = sp ? comm.rank() * rows : 0;
          // Columns this rank holds: the bias's runs.
          std::vector<std::int64_t> columns;
          specs[1].for_each_run(0, out / tp, [&](std::int64_t l, std::int64_t, std::int64_t n) {
            for (std::int64_t k = 0; k < n; ++k) columns.push_back(l + k);
          });
          std::vector<double> my_dy;
          for (std::int64_t n = 0; n < N; ++n) {
            for (std::int64_t c : columns)
              my_dy.push_back(dy[static_cast<std::size_t>(n * out + c)]);
          }
          const LayerRun got =
              run_layer(layer, {part_of(specs[0].split, W), part_of(specs[1].split, b)},
                        rows_of(x, in, first, rows), Shape{rows, in}, my_dy, B, T);
          std::vector<double> want_y;
          for (std::int64_t n = 0; n < N; ++n) {
            for (std::int64_t c : columns)
              want_y.push_back(want.y[static_cast<std::size_t>(n * out + c)]);
          }
          return std::max({max_diff(got.y, want_y),
                           max_diff(got.dx, rows_of(want.dx, in, first, rows)),
                           max_diff(got.grads[0], part_of(specs[0].split, want.grads[0])),
                           max_diff(got.grads[1], part_of(specs[1].split, want.grads[1]))});
        });
        INFO("column-parallel, tp " << tp << (sp ? " with" : " without") << " SP, stride "
                                    << stride);
        for (double e : errors) CHECK(e <= 1e-12);
      }
      const auto errors = testing::per_rank<double>(tp, [&](LocalComm& comm) {
        const TensorParallel group(comm, sp);
        parallel::RowParallelLinear<double> layer(group, "fc", in, out);
        const auto specs = layer.params();
        const std::int64_t part = in / tp, c0 = comm.rank() * part;
        std::vector<double> my_x;
        for (std::int64_t n = 0; n < N; ++n) {
          for (std::int64_t c = 0; c < part; ++c)
            my_x.push_back(x[static_cast<std::size_t>(n * in + c0 + c)]);
        }
        const std::int64_t rows = sp ? N / tp : N, first = sp ? comm.rank() * rows : 0;
        const LayerRun got = run_layer(layer, {part_of(specs[0].split, W), b}, my_x, Shape{N, part},
                                       rows_of(dy, out, first, rows), B, T);
        std::vector<double> want_dx;
        for (std::int64_t n = 0; n < N; ++n) {
          for (std::int64_t c = 0; c < part; ++c)
            want_dx.push_back(want.dx[static_cast<std::size_t>(n * in + c0 + c)]);
        }
        return std::max({max_diff(got.y, rows_of(want.y, out, first, rows)),
                         max_diff(got.dx, want_dx),
                         max_diff(got.grads[0], part_of(specs[0].split, want.grads[0])),
                         max_diff(got.grads[1], want.grads[1])});
      });
      INFO("row-parallel, tp " << tp << (sp ? " with" : " without") << " SP");
      for (double e : errors) CHECK(e <= 1e-12);
    }
  }
}

TEST_CASE("VocabParallelEmbedding and VocabParallelCrossEntropy equal the whole-vocabulary layers",
          "[unit][tp]") {
  const std::int64_t B = 2, T = 6, N = B * T, V = 16, C = 4;
  const auto table = random_values(V * C, 5), dy = random_values(N * C, 6);
  const auto logits = random_values(N * V, 7);
  // Repeated ids and ids at every shard boundary; one ignored target.
  const std::vector<std::int32_t> ids{0, 3, 4, 7, 8, 11, 12, 15, 3, 3, 8, 0};
  const std::vector<std::int32_t> targets{15, 0, 4, 3, 8, 7, 12, 11, -1, 3, 8, 15};
  nn::TokenEmbedding<double> whole("wte", V, C);
  const LayerRun want = run_layer(whole, {table}, {}, Shape{}, dy, B, T, ids.data());
  std::vector<double> losses(N), want_dlogits(N * V);
  const double want_loss =
      ops::cpu::cross_entropy_forward<double>(losses.data(), logits.data(), targets.data(), N, V);
  ops::cpu::cross_entropy_backward<double>(want_dlogits.data(), logits.data(), targets.data(), N,
                                           V);
  for (int tp : {2, 4}) {
    const auto errors = testing::per_rank<double>(tp, [&](LocalComm& comm) {
      const TensorParallel group(comm);
      parallel::VocabParallelEmbedding<double> embedding(group, "wte", V, C);
      const auto specs = embedding.params();
      const LayerRun got =
          run_layer(embedding, {part_of(specs[0].split, table)}, {}, Shape{}, dy, B, T, ids.data());
      parallel::VocabParallelCrossEntropy<double> loss(group, V);
      const std::int64_t part = V / tp, first = comm.rank() * part;
      std::vector<double> mine;
      std::vector<double> want_mine;
      for (std::int64_t n = 0; n < N; ++n) {
        for (std::int64_t v = 0; v < part; ++v) {
          mine.push_back(logits[static_cast<std::size_t>(n * V + first + v)]);
          want_mine.push_back(want_dlogits[static_cast<std::size_t>(n * V + first + v)]);
        }
      }
      const LayerRun ce =
          run_layer(loss, {}, mine, Shape{N, part}, {}, B, T, nullptr, targets.data());
      // A gradient already in dx (a residual's skip gradient) is added to, not overwritten.
      const LayerRun onto_one =
          run_layer(loss, {}, mine, Shape{N, part}, {}, B, T, nullptr, targets.data(), 1.0);
      std::vector<double> want_onto_one = want_mine;
      for (double& g : want_onto_one) g += 1.0;
      return std::max({max_diff(got.y, want.y),
                       max_diff(got.grads[0], part_of(specs[0].split, want.grads[0])),
                       std::fabs(ce.loss - want_loss), max_diff(ce.dx, want_mine),
                       max_diff(onto_one.dx, want_onto_one)});
    });
    INFO("tp " << tp);
    for (double e : errors) CHECK(e <= 1e-12);
  }
}

TEST_CASE(
    "VocabParallelCrossEntropy over a padded vocabulary equals the whole-vocabulary loss over the "
    "real tokens",
    "[unit][tp]") {
  // 11 tokens in 16 columns: at tp 2 rank 1 holds tokens 8..10 and 5 padding columns, at tp 4
  // rank 3 holds only padding. The padding logits are 50, far above the others: in the softmax
  // they would take nearly all of it.
  const std::int64_t B = 2, T = 6, N = B * T, V = 16, tokens = 11;
  auto logits = random_values(N * V, 8);
  for (std::int64_t n = 0; n < N; ++n) {
    for (std::int64_t v = tokens; v < V; ++v) logits[static_cast<std::size_t>(n * V + v)] = 50.0;
  }
  const std::vector<std::int32_t> targets{10, 0, 4, 3, 8, 7, -1, 9, 10, 3, 8, 1};
  std::vector<double> losses(N), want_dlogits(N * V);
  const double want_loss = ops::cpu::cross_entropy_forward<double>(
      losses.data(), logits.data(), targets.data(), N, tokens, nullptr, V);
  ops::cpu::cross_entropy_backward<double>(want_dlogits.data(), logits.data(), targets.data(), N,
                                           tokens, 1.0, -1, nullptr, V);  // zeros in the padding
  for (int tp : {2, 4}) {
    const auto errors = testing::per_rank<double>(tp, [&](LocalComm& comm) {
      parallel::VocabParallelCrossEntropy<double> loss(TensorParallel(comm), V);
      loss.set_vocabulary(tokens);
      const std::int64_t part = V / tp, first = comm.rank() * part;
      std::vector<double> mine, want_mine;
      for (std::int64_t n = 0; n < N; ++n) {
        for (std::int64_t v = 0; v < part; ++v) {
          mine.push_back(logits[static_cast<std::size_t>(n * V + first + v)]);
          want_mine.push_back(want_dlogits[static_cast<std::size_t>(n * V + first + v)]);
        }
      }
      const LayerRun ce =
          run_layer(loss, {}, mine, Shape{N, part}, {}, B, T, nullptr, targets.data());
      // Added onto a gradient already in dx, the padding's share is zero there too.
      const LayerRun onto_one =
          run_layer(loss, {}, mine, Shape{N, part}, {}, B, T, nullptr, targets.data(), 1.0);
      std::vector<double> want_onto_one = want_mine;
      for (double& g : want_onto_one) g += 1.0;
      return std::max({std::fabs(ce.loss - want_loss), max_diff(ce.dx, want_mine),
                       max_diff(onto_one.dx, want_onto_one)});
    });
    INFO("tp " << tp);
    for (double e : errors) CHECK(e <= 1e-12);
  }
  // Negative control: the same layer without the vocabulary set has the padding in its softmax.
  const auto unmasked = testing::per_rank<double>(2, [&](LocalComm& comm) {
    parallel::VocabParallelCrossEntropy<double> loss(TensorParallel(comm), V);
    std::vector<double> mine;
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t v = 0; v < V / 2; ++v) {
        mine.push_back(logits[static_cast<std::size_t>(n * V + comm.rank() * V / 2 + v)]);
      }
    }
    return run_layer(loss, {}, mine, Shape{N, V / 2}, {}, B, T, nullptr, targets.data()).loss;
  });
  CHECK(unmasked[0] - want_loss > 40.0);
  // A target in the padding is refused; so is a vocabulary past the columns.
  const auto refused = testing::per_rank<std::string>(2, [&](LocalComm& comm) {
    parallel::VocabParallelCrossEntropy<double> loss(TensorParallel(comm), V);
    loss.set_vocabulary(tokens);
    const std::vector<double> row(V / 2, 0.5);
    const std::int32_t padding = 12;
    return testing::thrown_message([&] {
             (void)run_layer(loss, {}, row, Shape{1, V / 2}, {}, 1, 1, nullptr, &padding);
           }) +
           " | " + testing::thrown_message([&] { loss.set_vocabulary(V + 1); });
  });
  for (const std::string& m : refused) {
    CHECK_THAT(m, Catch::Contains("target 12 at position 0 is outside the vocabulary [0, 11)") &&
                      Catch::Contains("a vocabulary of 17 tokens must be in [1, 16]"));
  }
}

TEST_CASE("VocabParallelCrossEntropy: Megatron's numeric case", "[unit][tp]") {
  // Megatron's test at tp 4: every rank's logits are arange(0, 8) repeated to its 32 columns (a
  // vocabulary of 128), targets arange(0, 32, 2): losses 10.2309, 8.2309, 6.2309, 4.2309, ...
  const std::int64_t N = 16, V = 128, local = 32;
  const auto losses = testing::per_rank<std::vector<double>>(4, [&](LocalComm& comm) {
    const TensorParallel group(comm);
    parallel::VocabParallelCrossEntropy<double> loss(group, V);
    std::vector<double> row(local);
    for (std::int64_t v = 0; v < local; ++v)
      row[static_cast<std::size_t>(v)] = static_cast<double>(v % 8);
    std::vector<double> per_row;
    for (std::int64_t n = 0; n < N; ++n) {  // one row at a time: the layer's loss is a mean
      const std::int32_t target = static_cast<std::int32_t>(2 * n);
      per_row.push_back(run_layer(loss, {}, row, Shape{1, local}, {}, 1, 1, nullptr, &target).loss);
    }
    return per_row;
  });
  const double want[4] = {10.2309, 8.2309, 6.2309, 4.2309};
  for (const auto& rank : losses) {
    for (std::size_t n = 0; n < rank.size(); ++n)
      CHECK(rank[n] == Approx(want[n % 4]).margin(1e-3));
  }
}

TEST_CASE(
    "VocabParallelCrossEntropy refuses a training forward without targets, and targets "
    "for another number of rows",
    "[unit][tp]") {
  // On every rank, before its all-reduces: no rank waits for one that refused.
  const auto seen = testing::per_rank<std::string>(2, [&](LocalComm& comm) {
    const TensorParallel group(comm);
    parallel::VocabParallelCrossEntropy<double> loss(group, 8);
    const std::vector<double> row(4, 0.5);
    const std::vector<std::int32_t> targets{1, 2};
    return testing::thrown_message([&] {
             (void)run_layer(loss, {}, row, Shape{1, 4}, {}, 1, 1);
           }) +
           " | " + testing::thrown_message([&] {
             (void)run_layer(loss, {}, row, Shape{1, 4}, {}, 2, 1, nullptr, targets.data());
           });
  });
  for (const std::string& s : seen) {
    CHECK_THAT(s, Catch::Contains("VocabParallelCrossEntropy 'targets': a training forward needs "
                                  "the labels, and the micro-batch has no input 'targets'"));
    // Targets for another number of rows than the logits' are refused, not read past.
    CHECK_THAT(s, Catch::Contains("2 targets (batch x seq_len) for 1 rows of logits"));
  }
}

namespace {

// What a GPT block split over tp must equal: the whole block's output, input gradient and
// parameter gradients, for x [N, C] and dy [N, C].
// With dropout, a block whose attention draws every rank's heads at rank 0's place in the mask
// (masks per rank, not the whole block's) must not pass either.
enum class BlockFault { none, missing_row_reduce, missing_norm_reduce, unplaced_attention_mask };

// 128 rows: every arena allocation of the block is a multiple of the arena's 256-byte alignment
// at tp 1, 2 and 4 (a LayerNorm's statistics of 32 rows are 256 bytes), so held bytes add up.
constexpr std::int64_t block_batch = 2, block_seq = 64, block_rows = block_batch * block_seq;

nn::GPTConfig block_config(bool dropout = false) {
  nn::GPTConfig c = nn::GPTConfig::preset("tiny");  // C 16
  c.num_heads = 4;
  c.dropout = dropout ? 0.2 : 0.0;
  c.attn_dropout = dropout ? 0.3 : 0.0;
  return c;
}

// The block of add_gpt_block, by hand, with one fault: the attention's row-parallel projection
// replaced by a plain Linear on the rank's input columns (its partial sums never all-reduced),
// or, with SP, ln_1 without its gradient reduction over the group.
void add_faulty_block(nn::Sequential<double>& unit, const nn::GPTConfig& cfg,
                      const TensorParallel& tp, BlockFault fault) {
  const std::int64_t C = cfg.channels;
  const nn::DropoutShard rows =
      tp.sequence_parallel() ? nn::DropoutShard{tp.size(), tp.rank(), false} : nn::DropoutShard{};
  const std::string p = "transformer.h.1.";
  auto& attn = unit.add<nn::Residual<double>>(p + "attn");
  if (tp.sequence_parallel() && fault != BlockFault::missing_norm_reduce) {
    attn.add<parallel::SequenceParallelParams<double>>(
        tp, std::make_unique<nn::LayerNorm<double>>(p + "ln_1", C));
  } else {
    attn.add<nn::LayerNorm<double>>(p + "ln_1", C);
  }
  attn.add<parallel::ColumnParallelLinear<double>>(tp, p + "attn.c_attn", C, 3 * C, true, 0.02, 3);
  attn.add<nn::CausalSelfAttention<double>>(cfg.num_heads / tp.size(), cfg.attn_dropout, "h.1", 2,
                                            fault == BlockFault::unplaced_attention_mask
                                                ? nn::DropoutShard{}
                                                : nn::DropoutShard{tp.size(), tp.rank(), true});
  if (fault == BlockFault::missing_row_reduce) {
    attn.add<nn::Linear<double>>(p + "attn.c_proj", C / tp.size(), C);
  } else {
    attn.add<parallel::RowParallelLinear<double>>(tp, p + "attn.c_proj", C, C);
  }
  if (cfg.dropout > 0) attn.add<nn::Dropout<double>>(cfg.dropout, "h.1", 0, rows);
  auto& mlp = unit.add<nn::Residual<double>>(p + "mlp");
  if (tp.sequence_parallel()) {
    mlp.add<parallel::SequenceParallelParams<double>>(
        tp, std::make_unique<nn::LayerNorm<double>>(p + "ln_2", C));
  } else {
    mlp.add<nn::LayerNorm<double>>(p + "ln_2", C);
  }
  mlp.add<parallel::ColumnParallelLinear<double>>(tp, p + "mlp.c_fc", C, 4 * C);
  mlp.add<nn::GELU<double>>();
  mlp.add<parallel::RowParallelLinear<double>>(tp, p + "mlp.c_proj", 4 * C, C);
  if (cfg.dropout > 0) mlp.add<nn::Dropout<double>>(cfg.dropout, "h.1", 1, rows);
}

// The held values of spec from the whole tensor: its part, or (a faulty layer that declares no
// split) the rank's input columns.
std::vector<double> held_values(const nn::ParamSpec& spec, const std::vector<double>& whole,
                                const Shape& whole_shape, const TensorParallel& tp) {
  if (spec.split.is_split()) return part_of(spec.split, whole);
  if (spec.numel() == whole_shape.numel()) return whole;
  return part_of(nn::TensorSplit::of(whole_shape, 1, tp.size(), tp.rank()), whole);
}

struct BlockCheck {
  double error = 0;            // largest difference to the whole block
  std::size_t held_bytes = 0;  // arena bytes held between forward and backward
};

// Dropout masks of optimizer step 3 (any step but 0: a mask of the wrong step differs).
constexpr std::uint64_t block_step = 3;

// The block split over comm's ranks (with or without SP, with one fault or none), bound to the
// rank's part of the whole block's values and zeroed gradients, with the rank's rows of x and dy.
struct SplitBlock {
  SplitBlock(LocalComm& comm, bool sp, BlockFault fault,
             const std::vector<nn::ParamSpec>& whole_specs,
             const std::vector<std::vector<double>>& whole_values, const std::vector<double>& x,
             const std::vector<double>& dy, bool dropout)
      : tp(comm, sp), cfg(block_config(dropout)) {
    const std::int64_t C = cfg.channels;
    if (fault == BlockFault::none) {
      nn::add_gpt_block(block, cfg, 1, tp);
    } else {
      add_faulty_block(block, cfg, tp, fault);
    }
    specs = block.params();
    for (const auto& s : specs) {
      const std::size_t k = whole_index(s.name, whole_specs);
      whole_shapes.push_back(whole_specs[k].shape);
      values.push_back(held_values(s, whole_values[k], whole_specs[k].shape, tp));
      grads.emplace_back(values.back().size(), 0.0);
    }
    std::vector<nn::ParamView<double>> views;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      views.push_back({Tensor<double>(values[i].data(), specs[i].shape),
                       Tensor<double>(grads[i].data(), specs[i].shape)});
    }
    block.bind(views);
    rows = sp ? block_rows / tp.size() : block_rows;
    first = sp ? tp.rank() * rows : 0;
    input = rows_of(x, C, first, rows);
    dout = rows_of(dy, C, first, rows);
    ctx.arena = &arena;
    ctx.batch = block_batch;
    ctx.seq_len = block_seq;
    ctx.step = block_step;
  }
  static std::size_t whole_index(const std::string& name, const std::vector<nn::ParamSpec>& whole) {
    std::size_t k = 0;
    while (whole[k].name != name) ++k;
    return k;
  }
  // Forward of the rank's rows; returns the output.
  std::vector<double> forward() {
    x_run = input;  // a layer may write into its input
    ctx.x = Tensor<double>(x_run.data(), Shape{rows, cfg.channels});
    block.forward(ctx);
    return {ctx.x.begin(), ctx.x.end()};
  }
  // Backward of the rank's rows of dy (after forward); returns the input gradient.
  std::vector<double> backward() {
    dy_run = dout;
    ctx.dy = Tensor<double>(dy_run.data(), Shape{rows, cfg.channels});
    block.backward(ctx);
    std::vector<double> dx(ctx.dx.begin(), ctx.dx.end());
    arena.reset();
    return dx;
  }
  // The largest difference of the gradients to the rank's part of want, times `split` for the
  // parameters split over tp and `replicated` for those whole on every rank.
  double grads_error(const std::vector<nn::ParamSpec>& whole_specs,
                     const std::vector<std::vector<double>>& want, double split = 1,
                     double replicated = 1) const {
    double e = 0;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      std::vector<double> part =
          held_values(specs[i], want[whole_index(specs[i].name, whole_specs)], whole_shapes[i], tp);
      for (double& v : part) v *= specs[i].split.is_split() ? split : replicated;
      e = std::max(e, max_diff(grads[i], part));
    }
    return e;
  }

  TensorParallel tp;
  nn::GPTConfig cfg;
  nn::Sequential<double> block;
  std::vector<nn::ParamSpec> specs;
  std::vector<std::vector<double>> values, grads;
  std::vector<Shape> whole_shapes;
  std::int64_t rows = 0, first = 0;
  std::vector<double> input, dout;
  std::vector<double> x_run, dy_run;  // what forward and backward run on
  Arena<> arena{16 << 20};
  nn::StepContext<double> ctx;
};

BlockCheck check_block(LocalComm& comm, bool sp, BlockFault fault, const LayerRun& want,
                       const std::vector<nn::ParamSpec>& whole_specs,
                       const std::vector<std::vector<double>>& whole_values,
                       const std::vector<double>& x, const std::vector<double>& dy,
                       bool dropout = false) {
  SplitBlock b(comm, sp, fault, whole_specs, whole_values, x, dy, dropout);
  const std::int64_t C = b.cfg.channels;
  const std::vector<double> y = b.forward();
  BlockCheck r;
  r.held_bytes = b.arena.used_bytes();
  const std::vector<double> dx = b.backward();
  r.error = std::max(max_diff(y, rows_of(want.y, C, b.first, b.rows)),
                     max_diff(dx, rows_of(want.dx, C, b.first, b.rows)));
  r.error = std::max(r.error, b.grads_error(whole_specs, want.grads));
  return r;
}

struct WholeBlock {
  std::vector<nn::ParamSpec> specs;
  std::vector<std::vector<double>> values;
  std::vector<double> x, dy;
  LayerRun want;
  std::size_t held_bytes = 0;
};

WholeBlock whole_block(bool dropout = false) {
  WholeBlock w;
  const std::int64_t C = block_config().channels;
  nn::Sequential<double> block;
  nn::add_gpt_block(block, block_config(dropout), 1);
  w.specs = block.params();
  std::uint64_t seed = 11;
  for (const auto& s : w.specs) {
    w.values.push_back(random_values(s.numel(), seed++));
    for (double& v : w.values.back()) v *= 0.3;
  }
  w.x = random_values(block_rows * C, 40);
  w.dy = random_values(block_rows * C, 41);
  // The whole block through the same harness: a Sequential has no Layer base, so run it here.
  std::vector<std::vector<double>> grads;
  std::vector<nn::ParamView<double>> views;
  for (std::size_t i = 0; i < w.specs.size(); ++i) {
    grads.emplace_back(w.values[i].size(), 0.0);
    views.push_back({Tensor<double>(w.values[i].data(), w.specs[i].shape),
                     Tensor<double>(grads[i].data(), w.specs[i].shape)});
  }
  block.bind(views);
  Arena<> arena(16 << 20);
  nn::StepContext<double> ctx;
  ctx.arena = &arena;
  ctx.batch = block_batch;
  ctx.seq_len = block_seq;
  ctx.step = block_step;
  std::vector<double> input = w.x, dout = w.dy;
  ctx.x = Tensor<double>(input.data(), Shape{block_rows, C});
  block.forward(ctx);
  w.held_bytes = arena.used_bytes();
  w.want.y.assign(ctx.x.begin(), ctx.x.end());
  ctx.dy = Tensor<double>(dout.data(), Shape{block_rows, C});
  block.backward(ctx);
  w.want.dx.assign(ctx.dx.begin(), ctx.dx.end());
  w.want.grads = grads;
  return w;
}

}  // namespace

TEST_CASE(
    "A GPT block split over tp equals the whole block, a missing all-reduce or a missing "
    "LayerNorm-gradient reduction is caught",
    "[unit][tp]") {
  const WholeBlock w = whole_block();
  auto run = [&](int tp, bool sp, BlockFault fault) {
    return testing::per_rank<BlockCheck>(tp, [&](LocalComm& comm) {
      return check_block(comm, sp, fault, w.want, w.specs, w.values, w.x, w.dy);
    });
  };
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      INFO("tp " << tp << (sp ? " with" : " without") << " SP");
      for (const BlockCheck& r : run(tp, sp, BlockFault::none)) CHECK(r.error <= 1e-12);
      if (sp) continue;
      double worst = 0;
      for (const BlockCheck& r : run(tp, sp, BlockFault::missing_row_reduce)) {
        worst = zero::testing::worse(worst, r.error);
      }
      CHECK(worst > 1e-3);  // negative control: the partial sums were never added up
    }
    double worst = 0;
    for (const BlockCheck& r : run(tp, true, BlockFault::missing_norm_reduce)) {
      worst = zero::testing::worse(worst, r.error);
    }
    CHECK(worst > 1e-3);  // negative control: ln_1's gradients are one rank's rows only
  }
}

TEST_CASE(
    "With dropout, a GPT block split over tp (with and without SP) draws the whole block's "
    "masks: each rank its heads' and its rows' part",
    "[unit][tp]") {
  // Megatron draws the attention's masks per tensor-parallel rank (its model-parallel RNG), so
  // tp > 1 equals tp = 1 only in distribution; here every rank's heads and, under SP, its block
  // of rows are decided at their indices in the whole block's masks (nn::DropoutShard).
  const WholeBlock w = whole_block(/*dropout=*/true);
  const WholeBlock plain = whole_block(/*dropout=*/false);
  CHECK(max_diff(w.want.y, plain.want.y) > 1e-2);  // the masks drop something
  auto run = [&](int tp, bool sp, BlockFault fault) {
    const auto seen = testing::per_rank<BlockCheck>(tp, [&](LocalComm& comm) {
      return check_block(comm, sp, fault, w.want, w.specs, w.values, w.x, w.dy, true);
    });
    double worst = 0;
    for (const BlockCheck& r : seen) worst = zero::testing::worse(worst, r.error);
    return worst;
  };
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      INFO("tp " << tp << (sp ? " with" : " without") << " SP");
      CHECK(run(tp, sp, BlockFault::none) <= 1e-12);
      // negative control: every rank's heads drawn at rank 0's place
      CHECK(run(tp, sp, BlockFault::unplaced_attention_mask) > 1e-3);
    }
  }
}

TEST_CASE(
    "Sequence parallelism divides the activations held outside the tensor-parallel "
    "region by tp (measured from the arena)",
    "[unit][tp]") {
  // Held bytes M = R + P: R in the replicated region (LayerNorms, residuals: rows), P in the
  // tensor-parallel region (qkv, attention, MLP: columns or heads). Tensor parallelism divides P
  // by tp; sequence parallelism also R.
  const WholeBlock w = whole_block();
  auto held = [&](int tp, bool sp) {
    return testing::per_rank<BlockCheck>(tp,
                                         [&](LocalComm& comm) {
                                           return check_block(comm, sp, BlockFault::none, w.want,
                                                              w.specs, w.values, w.x, w.dy);
                                         })[0]
        .held_bytes;
  };
  // The whole block writes each residual's sum in its c_proj (Layer::adds_skip), so it holds no
  // buffer for either branch's output; the split block's row-parallel c_proj all-reduces f(x)
  // before the sum and holds one (N x C each). Counted back in, the whole block is R + P.
  const double branch_outputs =
      2.0 * static_cast<double>(block_rows * block_config().channels) * sizeof(double);
  const double whole = static_cast<double>(w.held_bytes) + branch_outputs;
  const double tp2 = static_cast<double>(held(2, false)), sp2 = static_cast<double>(held(2, true));
  const double replicated = 2 * (tp2 - sp2), parallel_region = 2 * (whole - tp2);
  CHECK(replicated > 0);
  CHECK(parallel_region > 0);
  CHECK(replicated + parallel_region == whole);
  CHECK(static_cast<double>(held(4, true)) == (replicated + parallel_region) / 4);
  CHECK(static_cast<double>(held(4, false)) == replicated + parallel_region / 4);
}

TEST_CASE("Communication of a GPT block over the tp group equals Megatron's formulas",
          "[unit][tp]") {
  // Per transformer layer, activations of N x C elements of e bytes (nccl-tests S):
  //   without SP: forward 2 all-reduces of N*C*e, backward 2 more (the column layers' dx);
  //   with SP: forward 2 all-gathers and 2 reduce-scatters of N*C*e; backward 4 all-gathers
  //   (the row layers' dy and the column layers' re-gathered inputs) and 2 reduce-scatters,
  //   plus the gradients of the parameters computed on row shards: ln_1 and ln_2 (2C each) and
  //   the two row-parallel biases (C each), all-reduced.
  const WholeBlock w = whole_block();
  const std::uint64_t e = sizeof(double), NC = block_rows * block_config().channels * e;
  const std::uint64_t C = static_cast<std::uint64_t>(block_config().channels) * e;
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) {
      struct Volume {
        std::uint64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0, ops = 0;
      };
      const auto volumes = testing::per_rank<Volume>(tp, [&](LocalComm& comm) {
        auto logger = std::make_shared<parallel::CommLogger>();
        comm.set_logger(logger);
        check_block(comm, sp, BlockFault::none, w.want, w.specs, w.values, w.x, w.dy);
        comm.set_logger(nullptr);
        Volume v;
        for (const auto& r : logger->records()) {
          v.ops += r.stats.count;
          if (r.op == parallel::CommOp::all_reduce) v.all_reduce += r.stats.bytes;
          if (r.op == parallel::CommOp::all_gather) v.all_gather += r.stats.bytes;
          if (r.op == parallel::CommOp::reduce_scatter) v.reduce_scatter += r.stats.bytes;
        }
        return v;
      });
      INFO("tp " << tp << (sp ? " with" : " without") << " SP");
      for (const Volume& v : volumes) {
        if (sp) {
          CHECK(v.all_gather == 6 * NC);
          CHECK(v.reduce_scatter == 4 * NC);
          CHECK(v.all_reduce == 2 * 2 * C + 2 * C);
          CHECK(v.ops == 6 + 4 + 4);
        } else {
          CHECK(v.all_reduce == 4 * NC);
          CHECK(v.all_gather + v.reduce_scatter == 0);
          CHECK(v.ops == 4);
        }
      }
    }
  }
}

TEST_CASE(
    "Under SP a GPT block's replicated gradients are summed over the window and all-reduced once, "
    "in its last backward, and a window that ended leaves nothing behind",
    "[unit][tp]") {
  // Megatron sums the LayerNorms' and the row-parallel biases' gradients (each rank's rows'
  // share) over the group once per step, in finalize_model_grads. Here the backwards before the
  // window's last (StepContext::window_end false) hold their share back: 3 backwards of the same
  // rows then equal 3 whole-block backwards, with the 4 all-reduces (ln_1, ln_2, the two
  // biases) all in the last, and none before.
  const WholeBlock w = whole_block();
  struct Seen {
    std::vector<std::uint64_t> all_reduces;  // per backward
    double held_back = 0;        // the largest replicated gradient after the first backward
    double split_after_one = 0;  // the largest split gradient then (not held back)
    double window_error = 0;     // after the window, against 3 whole backwards
    double moved_on_error = 0;   // a second window after a first that never ended
  };
  for (int tp : {2, 4}) {
    const auto seen = testing::per_rank<Seen>(tp, [&](LocalComm& comm) {
      Seen r;
      SplitBlock b(comm, true, BlockFault::none, w.specs, w.values, w.x, w.dy, false);
      for (int m = 0; m < 3; ++m) {
        b.ctx.window_end = m == 2;
        (void)b.forward();
        auto logger = std::make_shared<parallel::CommLogger>();
        comm.set_logger(logger);
        (void)b.backward();
        comm.set_logger(nullptr);
        r.all_reduces.push_back(logger->total(parallel::CommOp::all_reduce).count);
        if (m > 0) continue;
        for (std::size_t i = 0; i < b.specs.size(); ++i) {
          for (double g : b.grads[i]) {
            double& worst = b.specs[i].split.is_split() ? r.split_after_one : r.held_back;
            worst = std::max(worst, std::abs(g));
          }
        }
      }
      r.window_error = b.grads_error(w.specs, w.want.grads, 3, 3);
      // A window whose last backward never ran (the engine ended it after a failure): the next
      // window's sums start from nothing. The split gradients were not cleared here, so they
      // hold both backwards; the replicated ones only the second window's.
      SplitBlock c(comm, true, BlockFault::none, w.specs, w.values, w.x, w.dy, false);
      for (int window = 0; window < 2; ++window) {
        c.ctx.window = static_cast<std::uint64_t>(window);
        c.ctx.window_end = window == 1;
        (void)c.forward();
        (void)c.backward();
      }
      r.moved_on_error = c.grads_error(w.specs, w.want.grads, 2, 1);
      return r;
    });
    INFO("tp " << tp);
    for (const Seen& r : seen) {
      CHECK(r.all_reduces == std::vector<std::uint64_t>{0, 0, 4});
      CHECK(r.held_back == 0.0);
      CHECK(r.split_after_one > 1e-3);
      CHECK(r.window_error <= 1e-11);
      CHECK(r.moved_on_error <= 1e-11);
    }
  }
}
