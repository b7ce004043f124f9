// The layers' kernel seam (nn/kernels.hpp): layers run the kernels of the pass's set
// (StepContext::kernels), the host set when none is given, and layers with host kernels only
// refuse a set on another device (all of GPT and of LayerLlama runs through the set). A recording
// set forwards to the host kernels and names each call, so these run on every machine; the same GPT
// block on nn::CudaKernels is tests/cuda/test_layers_cuda.cu.
#include <cstdint>
#include <cstring>
#include <map>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include <zero/core/arena.hpp>
#include <zero/core/rng.hpp>
#include <zero/nn/deferred_weight_grads.hpp>
#include <zero/nn/gpt.hpp>
#include <zero/nn/kernels.hpp>
#include <zero/nn/layer_gpt.hpp>
#include <zero/nn/layer_llama.hpp>
#include <zero/nn/layers/linear_cross_entropy.hpp>
#include <zero/nn/layers/rms_norm.hpp>
#include <zero/nn/layers/sequential_model.hpp>
#include <zero/nn/layers/token_embedding.hpp>
#include <zero/nn/llama_config.hpp>
#include <zero/nn/local_parameters.hpp>
#include <zero/ops/cpu/attention.hpp>
#include <zero/ops/cpu/elementwise.hpp>
#include <zero/ops/cpu/gelu.hpp>
#include <zero/ops/cpu/layer_norm.hpp>
#include <zero/ops/cpu/linear.hpp>

#include "recording_kernels.hpp"

using namespace zero;

namespace {

using test::RecordingKernels;

constexpr std::int64_t B = 2, T = 5, C = 16, NH = 2;

// One GPT block (nn::add_gpt_block, with dropout and attention dropout unless told otherwise) as
// a one-unit model.
template <class E>
nn::SequentialModel<E> gpt_block(bool checkpoint, bool dropout = true) {
  nn::GPTConfig cfg;
  cfg.vocab_size = 32;
  cfg.max_seq_len = T;
  cfg.num_layers = 1;
  cfg.num_heads = NH;
  cfg.channels = C;
  cfg.dropout = dropout ? 0.1 : 0.0;
  cfg.attn_dropout = dropout ? 0.1 : 0.0;
  nn::SequentialModel<E> m;
  nn::Sequential<E>& unit = m.add_unit();
  nn::add_gpt_block(unit, cfg, 0);
  unit.set_checkpoint(checkpoint);
  return m;
}

struct BlockRun {
  std::vector<float> y, dx, grads;
};

// Forward and backward of the block on one input and output gradient, through kernels (null:
// the context's default).
template <class E>
BlockRun run_block(nn::Kernels<E>* kernels, bool checkpoint, bool dropout = true) {
  nn::SequentialModel<E> m = gpt_block<E>(checkpoint, dropout);
  nn::LocalParameters<nn::SequentialModel<E>> p(m, 7);
  Arena<> arena(1 << 20);
  std::vector<E> x(B * T * C), dy(B * T * C);
  const CounterRng rng(11);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = convert<E>(rng.normal(i));
    dy[i] = convert<E>(rng.normal(x.size() + i) * 0.1);
  }
  nn::StepContext<E> ctx;
  ctx.arena = &arena;
  ctx.kernels = kernels;
  ctx.batch = B;
  ctx.seq_len = T;
  ctx.step = 3;
  ctx.x = Tensor<E>(x.data(), Shape{B * T, C});
  m.forward_unit(0, ctx);
  BlockRun r;
  for (E v : ctx.x) r.y.push_back(convert<float>(v));
  ctx.dy = Tensor<E>(dy.data(), Shape{B * T, C});
  m.backward_unit(0, ctx);
  for (E v : ctx.dx) r.dx.push_back(convert<float>(v));
  for (E v : p.unit_grads(0)) r.grads.push_back(convert<float>(v));
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEMPLATE_TEST_CASE("a GPT block runs on the kernel set of its pass", "[unit][nn][layers][kernels]",
                   float, bf16) {
  using E = TestType;
  for (const bool checkpoint : {false, true}) {
    INFO("activation checkpointing " << checkpoint);
    const BlockRun plain = run_block<E>(nullptr, checkpoint);
    RecordingKernels<E> recording;
    const BlockRun through = run_block<E>(&recording, checkpoint);
    // The same kernels in the same order: the same bits.
    CHECK(same_bits(plain.y, through.y));
    CHECK(same_bits(plain.dx, through.dx));
    CHECK(same_bits(plain.grads, through.grads));
    // Every kernel of the block went through the set: 4 linears (c_fc with the GELU after it in
    // one call), 2 LayerNorms, attention, 2 residual dropouts, 2 residual adds; in backward,
    // Sequential's gradient buffers and fills.
    CHECK(recording.calls["linear_forward"] == (checkpoint ? 6 : 3));
    CHECK(recording.calls["linear_gelu_forward"] == (checkpoint ? 2 : 1));
    CHECK(recording.calls["linear_forward_add"] == 0);
    CHECK(recording.calls["linear_backward"] == 4);
    CHECK(recording.calls["layer_norm_forward"] == (checkpoint ? 4 : 2));
    // Each residual's LayerNorm writes its input gradient from the skip path's (below).
    CHECK(recording.calls["layer_norm_backward"] == 0);
    CHECK(recording.calls["layer_norm_backward_from"] == 2);
    CHECK(recording.calls["attention_forward"] == (checkpoint ? 2 : 1));
    CHECK(recording.calls["attention_backward"] == 1);
    CHECK(recording.calls["gelu_forward"] == 0);
    CHECK(recording.calls["gelu_backward"] == 1);
    CHECK(recording.calls["dropout_forward"] == (checkpoint ? 4 : 2));
    CHECK(recording.calls["dropout_backward"] == 2);
    CHECK(recording.calls["add"] == (checkpoint ? 4 : 2));
    CHECK(recording.calls["allocate"] >= 2);
    // Gradient buffers zeroed before a layer adds into them: the two residual dropouts'; the
    // attention writes its input gradient (as LayerNorm, the linear layers and GELU do).
    CHECK(recording.calls["fill_zero"] == 2);
    // Copies: each residual starts its branch's input gradient from the skip path's, in the
    // residual's own input gradient (the unit writes it, so nothing is copied after), and the
    // branch's first layer, a LayerNorm, reads the skip path's where it would read that buffer,
    // so nothing is copied before either; checkpointing moves the unit's output down to its
    // mark.
    CHECK(recording.calls["copy"] == (checkpoint ? 1 : 0));
    CHECK(recording.calls["accumulate"] == 0);
  }
}

TEMPLATE_TEST_CASE(
    "a GPT block without dropout adds each residual inside its last linear layer "
    "and GELU inside c_fc",
    "[unit][nn][layers][kernels]", float, bf16) {
  using E = TestType;
  for (const bool checkpoint : {false, true}) {
    INFO("activation checkpointing " << checkpoint);
    const BlockRun plain = run_block<E>(nullptr, checkpoint, false);
    RecordingKernels<E> recording;
    const BlockRun through = run_block<E>(&recording, checkpoint, false);
    CHECK(same_bits(plain.y, through.y));
    CHECK(same_bits(plain.dx, through.dx));
    CHECK(same_bits(plain.grads, through.grads));
    // Both branches end in a Linear (c_proj), which writes x + f(x) itself: no residual add;
    // c_fc computes the GELU after it, and c_attn runs alone.
    CHECK(recording.calls["linear_forward_add"] == (checkpoint ? 4 : 2));
    CHECK(recording.calls["linear_gelu_forward"] == (checkpoint ? 2 : 1));
    CHECK(recording.calls["linear_forward"] == (checkpoint ? 2 : 1));
    CHECK(recording.calls["gelu_forward"] == 0);
    CHECK(recording.calls["add"] == 0);
    CHECK(recording.calls["linear_backward"] == 4);
    CHECK(recording.calls["dropout_forward"] == 0);
    CHECK(recording.calls["copy"] == (checkpoint ? 1 : 0));
    CHECK(recording.calls["fill_zero"] == 0);  // every layer writes its input gradient
  }
  // A set that fuses GELU's backward into c_proj's (as the device's does) runs the pair as one
  // call: the same bits here, where that call is the host's two kernels.
  for (const bool dropout : {true, false}) {
    for (const bool checkpoint : {false, true}) {
      INFO("fused GELU backward, dropout " << dropout << ", checkpointing " << checkpoint);
      const BlockRun plain = run_block<E>(nullptr, checkpoint, dropout);
      RecordingKernels<E> fusing;
      fusing.fuse_gelu_backward = true;
      const BlockRun through = run_block<E>(&fusing, checkpoint, dropout);
      CHECK(same_bits(plain.y, through.y));
      CHECK(same_bits(plain.dx, through.dx));
      CHECK(same_bits(plain.grads, through.grads));
      CHECK(fusing.calls["linear_backward_gelu"] == 1);
      CHECK(fusing.calls["gelu_backward"] == 0);
      CHECK(fusing.calls["linear_backward"] == 3);
    }
  }

  // The same bits as the fusions taken apart: the block written out with the host's ops.
  const BlockRun fused = run_block<E>(nullptr, false, false);
  nn::SequentialModel<E> m = gpt_block<E>(false, false);
  nn::LocalParameters<nn::SequentialModel<E>> p(m, 7);
  const Tensor<E> v = p.unit_values(0);
  std::vector<E> x(B * T * C);
  const CounterRng rng(11);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = convert<E>(rng.normal(i));
  // ln_1, c_attn, attention, c_proj (+ x), ln_2, c_fc, gelu, c_proj (+ h), in params() order.
  const E* w = v.data();
  auto next = [&](std::int64_t n) {
    const E* at = w;
    w += n;
    return at;
  };
  const E *ln1w = next(C), *ln1b = next(C), *attw = next(3 * C * C), *attb = next(3 * C),
          *projw = next(C * C), *projb = next(C), *ln2w = next(C), *ln2b = next(C),
          *fcw = next(4 * C * C), *fcb = next(4 * C), *fcpw = next(4 * C * C), *fcpb = next(C);
  const std::int64_t N = B * T;
  using Stat = compute_type_t<E>;
  std::vector<E> ln(N * C), qkv(N * 3 * C), att(N * C), proj(N * C), h(N * C), fc(N * 4 * C),
      g(N * 4 * C), y(N * C);
  std::vector<Stat> mean(N), rstd(N);
  std::vector<E> probs(static_cast<std::size_t>(B * NH * T * T));
  ops::cpu::layer_norm_forward(ln.data(), mean.data(), rstd.data(), x.data(), ln1w, ln1b, N, C);
  ops::cpu::linear_forward(qkv.data(), ln.data(), attw, attb, N, C, 3 * C);
  ops::cpu::attention_forward(att.data(), probs.data(), qkv.data(), B, T, C, NH);
  ops::cpu::linear_forward(proj.data(), att.data(), projw, projb, N, C, C);
  ops::cpu::add(h.data(), x.data(), proj.data(), N * C);
  ops::cpu::layer_norm_forward(ln.data(), mean.data(), rstd.data(), h.data(), ln2w, ln2b, N, C);
  ops::cpu::linear_forward(fc.data(), ln.data(), fcw, fcb, N, C, 4 * C);
  ops::cpu::gelu_forward(g.data(), fc.data(), N * 4 * C);
  ops::cpu::linear_forward(proj.data(), g.data(), fcpw, fcpb, N, 4 * C, C);
  ops::cpu::add(y.data(), h.data(), proj.data(), N * C);
  std::vector<float> expected;
  for (E e : y) expected.push_back(convert<float>(e));
  CHECK(same_bits(fused.y, expected));
}

// `passes` forward and backward passes of model (parameters p) over B sequences of T tokens of
// a vocabulary of vocab, through kernels (null: the context's default): each pass's loss, then
// every unit's gradient summed over the passes. training false runs the forwards as evaluations.
template <class E, class Model>
std::pair<std::vector<float>, std::vector<float>> run_model(Model& model,
                                                            nn::LocalParameters<Model>& p,
                                                            std::int64_t vocab,
                                                            nn::Kernels<E>* kernels, int passes,
                                                            bool training = true) {
  Arena<> arena(1 << 22);
  std::vector<std::int32_t> tokens(B * T), targets(B * T);
  for (std::int64_t i = 0; i < B * T; ++i) {
    tokens[i] = static_cast<std::int32_t>((7 * i + 3) % vocab);
    targets[i] = i == 4 ? -1 : static_cast<std::int32_t>((5 * i + 1) % vocab);
  }
  std::vector<float> losses;
  for (int pass = 0; pass < passes; ++pass) {
    arena.reset();
    nn::StepContext<E> ctx;
    ctx.arena = &arena;
    ctx.kernels = kernels;
    ctx.tokens = tokens.data();
    ctx.targets = targets.data();
    ctx.batch = B;
    ctx.seq_len = T;
    ctx.training = training;
    losses.push_back(convert<float>(model.forward(ctx)));
    model.backward(ctx);
  }
  std::vector<float> grads;
  for (int u = 0; u < model.num_units(); ++u) {
    for (E g : p.unit_grads(u)) grads.push_back(convert<float>(g));
  }
  return {losses, grads};
}

// The whole GPT (embedding unit, two blocks, the head with its loss over logits in chunks of 4
// rows), forward and backward, through kernels (null: the context's default): loss and every
// unit's gradient. training false runs the forward as an evaluation (no dropout; the head keeps
// only its losses and recomputes its logits in the backward).
template <class E>
std::pair<float, std::vector<float>> run_gpt(nn::Kernels<E>* kernels, bool training = true) {
  nn::GPTConfig cfg;
  cfg.vocab_size = 40;
  cfg.max_seq_len = 8;
  cfg.num_layers = 2;
  cfg.num_heads = NH;
  cfg.channels = C;
  cfg.dropout = 0.1;
  cfg.logits_chunk_bytes = 4 * 40 * static_cast<std::int64_t>(sizeof(E));
  nn::GPT<E> gpt(cfg);
  nn::LocalParameters<nn::GPT<E>> p(gpt, 3);
  auto [losses, grads] = run_model<E>(gpt, p, cfg.vocab_size, kernels, 1, training);
  return {losses[0], std::move(grads)};
}

TEMPLATE_TEST_CASE("all of GPT runs on the kernel set of its pass", "[unit][nn][gpt][kernels]",
                   float, bf16) {
  using E = TestType;
  const auto [loss, grads] = run_gpt<E>(nullptr);
  RecordingKernels<E> recording;
  const auto [loss_through, grads_through] = run_gpt<E>(&recording);
  CHECK(std::memcmp(&loss, &loss_through, sizeof(float)) == 0);
  CHECK(same_bits(grads, grads_through));
  CHECK(recording.calls["embedding_forward"] == 1);  // the token table
  CHECK(recording.calls["add_periodic_rows"] == 1);  // the positions
  CHECK(recording.calls["embedding_backward"] == 2);
  CHECK(recording.calls["count_valid_targets"] == 1);
  // 10 rows in chunks of 4, each chunk's loss and gradient in one call in the training forward.
  CHECK(recording.calls["cross_entropy_forward_backward"] == 3);
  CHECK(recording.calls["cross_entropy_forward"] == 0);
  CHECK(recording.calls["cross_entropy_mean"] == 1);
  CHECK(recording.calls["cross_entropy_backward"] == 0);
  // 4 per block (c_fc with its GELU in one call; with dropout after them, the c_proj layers add
  // no skip path) and the head's 3 chunks; the head's gradients came in the forward (a backward
  // product per chunk there, none in the head's backward).
  CHECK(recording.calls["linear_forward"] == 2 * 3 + 3);
  CHECK(recording.calls["linear_gelu_forward"] == 2);
  CHECK(recording.calls["linear_forward_add"] == 0);
  CHECK(recording.calls["linear_backward"] == 2 * 4 + 3);

  // A set that pads the logits rows, as the device pads GPT-2's 50257 (here 40 classes, rows 48
  // apart): the same bits, through one copy of the tied weight with 8 zero rows (the forward's
  // weight gradient has them of its own).
  RecordingKernels<E> padding;
  padding.logits_row_align = 16;
  const auto [loss_padded, grads_padded] = run_gpt<E>(&padding);
  CHECK(std::memcmp(&loss, &loss_padded, sizeof(float)) == 0);
  CHECK(same_bits(grads, grads_padded));
  CHECK(padding.calls["allocate"] == recording.calls["allocate"] + 1);
  CHECK(padding.calls["copy"] == recording.calls["copy"] + 1);
  CHECK(padding.calls["linear_forward"] == recording.calls["linear_forward"]);

  // After a forward that was not training, the head's backward computes the logits of its first
  // 2 chunks again, padded the same way: copies of the weight (forward, backward) and of its
  // gradient (copied back).
  const auto [eval_loss, eval_grads] = run_gpt<E>(nullptr, false);
  RecordingKernels<E> eval_recording, eval_padding;
  eval_padding.logits_row_align = 16;
  const auto [eval_loss_through, eval_grads_through] = run_gpt<E>(&eval_recording, false);
  const auto [eval_loss_padded, eval_grads_padded] = run_gpt<E>(&eval_padding, false);
  CHECK(std::memcmp(&eval_loss, &eval_loss_through, sizeof(float)) == 0);
  CHECK(std::memcmp(&eval_loss, &eval_loss_padded, sizeof(float)) == 0);
  CHECK(same_bits(eval_grads, eval_grads_through));
  CHECK(same_bits(eval_grads, eval_grads_padded));
  CHECK(eval_recording.calls["linear_forward"] == 2 * 3 + 3 + 2);
  CHECK(eval_padding.calls["allocate"] == eval_recording.calls["allocate"] + 3);
  CHECK(eval_padding.calls["copy"] == eval_recording.calls["copy"] + 4);
}

// A tiny LayerLlama (two blocks of grouped-query attention) over `passes` passes of one model
// (run_model).
template <class E>
std::pair<std::vector<float>, std::vector<float>> run_llama(nn::Kernels<E>* kernels, int passes) {
  const nn::LlamaConfig cfg = nn::LlamaConfig::preset("tiny");
  nn::LayerLlama<E> model(cfg);
  nn::LocalParameters<nn::LayerLlama<E>> p(model, 4);
  return run_model<E>(model, p, cfg.vocab_size, kernels, passes);
}

TEMPLATE_TEST_CASE("all of LayerLlama runs on the kernel set of its pass",
                   "[unit][nn][llama][kernels]", float, bf16) {
  using E = TestType;
  const auto [losses, grads] = run_llama<E>(nullptr, 2);
  RecordingKernels<E> recording;
  const auto [losses_through, grads_through] = run_llama<E>(&recording, 2);
  CHECK(same_bits(losses, losses_through));
  CHECK(same_bits(grads, grads_through));
  // Per pass: two norms a block and the final one; a rotary embedding, RepeatKv and SwiGLU a block.
  CHECK(recording.calls["rms_norm_forward"] == 2 * 5);
  CHECK(recording.calls["rms_norm_backward"] == 2 * 5);
  CHECK(recording.calls["rotary_forward"] == 2 * 2);
  CHECK(recording.calls["rotary_backward"] == 2 * 2);
  CHECK(recording.calls["repeat_kv_forward"] == 2 * 2);
  CHECK(recording.calls["repeat_kv_backward"] == 2 * 2);
  CHECK(recording.calls["swiglu_forward"] == 2 * 2);
  CHECK(recording.calls["swiglu_backward"] == 2 * 2);
  CHECK(recording.calls["attention_forward"] == 2 * 2);
  CHECK(recording.calls["copy_from_host"] == 0);  // the host reads the angle table itself

  // A set on another device gets each block's angle table copied once (cos, then sin), and
  // reads the copies in every later pass: the same bits.
  RecordingKernels<E> device(DeviceKind::cuda);
  const auto [losses_device, grads_device] = run_llama<E>(&device, 2);
  CHECK(same_bits(losses, losses_device));
  CHECK(same_bits(grads, grads_device));
  CHECK(device.calls["copy_from_host"] == 2 * 2);
  CHECK(device.calls["rotary_forward"] == 2 * 2);
}

TEST_CASE("a new kernel set at a freed set's address gets its own angle tables",
          "[unit][nn][llama][kernels]") {
  // The copies are keyed by the set's id, not its address: a copy kept for a set that is gone
  // would be another device's memory on a machine of several GPUs.
  const nn::LlamaConfig cfg = nn::LlamaConfig::preset("tiny");
  nn::LayerLlama<float> model(cfg);
  nn::LocalParameters<nn::LayerLlama<float>> p(model, 4);
  // Placement new into one buffer: the second set is made at the first one's address.
  alignas(RecordingKernels<float>) std::byte storage[sizeof(RecordingKernels<float>)];
  auto* set = new (storage) RecordingKernels<float>(DeviceKind::cuda);
  const std::uint64_t first_id = set->id();
  (void)run_model<float>(model, p, cfg.vocab_size, set, 1);
  CHECK(set->calls["copy_from_host"] == 2 * 2);
  set->~RecordingKernels();
  auto* again = new (storage) RecordingKernels<float>(DeviceKind::cuda);
  REQUIRE(static_cast<void*>(again) == static_cast<void*>(storage));
  CHECK(again->id() != first_id);
  (void)run_model<float>(model, p, cfg.vocab_size, again, 1);
  CHECK(again->calls["copy_from_host"] == 2 * 2);
  again->~RecordingKernels();
}

TEST_CASE("the host kernel set is the default and reports the host", "[unit][nn][kernels]") {
  nn::StepContext<float> ctx;
  CHECK(&nn::kernels_of(ctx) == &nn::host_kernels<float>());
  CHECK(nn::kernels_of(ctx).device() == DeviceKind::host);
  RecordingKernels<float> k;
  ctx.kernels = &k;
  CHECK(&nn::kernels_of(ctx) == &k);
  // Memory it hands out is writable, aligned host memory of the size asked.
  const nn::KernelMemory mem = nn::host_kernels<float>().allocate(1000);
  REQUIRE(mem.bytes != nullptr);
  CHECK(mem.size == 1000);
  CHECK(reinterpret_cast<std::uintptr_t>(mem.bytes.get()) % Host::default_alignment == 0);
  std::memset(mem.bytes.get(), 0x5a, 1000);
  // copy handles overlapping ranges (Sequential moves a checkpointed output down onto itself).
  std::vector<float> v{1, 2, 3, 4, 5};
  nn::host_kernels<float>().copy(v.data(), v.data() + 1, 4);
  CHECK(v == std::vector<float>{2, 3, 4, 5, 5});
}

TEST_CASE("the layers' fused forms refuse what they cannot do", "[unit][nn][layers][kernels]") {
  Arena<> arena(1 << 20);
  nn::StepContext<float> ctx;
  ctx.arena = &arena;
  ctx.batch = B;
  ctx.seq_len = T;
  std::vector<float> x(B * T * C, 0.5f);
  ctx.x = Tensor<float>(x.data(), Shape{B * T, C});
  const Tensor<const float> skip(x.data(), Shape{B * T, C});

  // A unit whose last layer cannot add a skip path refuses one, before it runs anything.
  nn::Sequential<float> unit;
  unit.add<nn::Linear<float>>("fc", C, C);
  unit.add<nn::GELU<float>>();
  CHECK_FALSE(unit.last_adds_skip());
  CHECK_THROWS_WITH(unit.forward(ctx, skip),
                    Catch::Contains("the last layer (GELU) cannot add a skip path"));
  CHECK(arena.used_bytes() == 0);

  // A Linear refuses a skip path shaped otherwise than its output.
  nn::Linear<float> wide("wide", C, 2 * C);
  CHECK(wide.adds_skip());
  CHECK_THROWS_AS(wide.forward_adding(ctx, skip), ShapeError);
  CHECK_THROWS_WITH(wide.forward_adding(ctx, skip), Catch::Contains("Linear 'wide'"));

  // Layers without a fused form say so; only GELU is fusable into the layer before it.
  nn::GELU<float> gelu;
  nn::ReLU<float> relu;
  CHECK(gelu.fusable_as() == nn::FusedActivation::gelu);
  CHECK(relu.fusable_as() == nn::FusedActivation::none);
  CHECK_FALSE(gelu.applies(nn::FusedActivation::gelu));
  CHECK_THROWS_WITH(gelu.forward_adding(ctx, skip),
                    Catch::Contains("GELU") && Catch::Contains("does not add a skip path"));
  CHECK_THROWS_WITH(relu.adopt_forward(ctx, ctx.x), Catch::Contains("only GELU"));
  CHECK_THROWS_WITH(gelu.forward_activating(ctx, nn::FusedActivation::gelu),
                    Catch::Contains("applies no activation"));
  CHECK_THROWS_WITH(wide.backward_activating(ctx, nn::FusedActivation::none, skip),
                    Catch::Contains("no fused backward"));
}

TEST_CASE("layers with host kernels only refuse a device kernel set", "[unit][nn][kernels]") {
  RecordingKernels<float> device(DeviceKind::cuda);
  Arena<> arena(1 << 20);
  nn::StepContext<float> ctx;
  ctx.arena = &arena;
  ctx.kernels = &device;
  std::vector<std::int32_t> tokens(B * T, 1);
  ctx.tokens = tokens.data();
  ctx.batch = B;
  ctx.seq_len = T;

  std::vector<float> x(B * T * C, 0.5f);
  ctx.x = Tensor<float>(x.data(), Shape{B * T, C});
  // ReLU has no device kernel; GELU and RMSNorm have, and run through the set.
  nn::ReLU<float> relu;
  CHECK_THROWS_WITH(relu.forward(ctx), Catch::Contains("ReLU has host kernels only") &&
                                           Catch::Contains("cuda device"));
  CHECK(arena.used_bytes() == 0);  // refused before it took anything
  nn::GELU<float> gelu;
  gelu.forward(ctx);
  CHECK(device.calls["gelu_forward"] == 1);
  ctx.x = Tensor<float>(x.data(), Shape{B * T, C});
  nn::RMSNorm<float> norm("norm", C);
  std::vector<float> weight(C, 1.f), grad(C, 0.f);
  const nn::ParamView<float> view{Tensor<float>(weight.data(), Shape{C}),
                                  Tensor<float>(grad.data(), Shape{C})};
  norm.bind(std::span<const nn::ParamView<float>>(&view, 1));
  norm.forward(ctx);
  CHECK(device.calls["rms_norm_forward"] == 1);

  // A split backward (zero-bubble pipelines) keeps host copies of its operands: host only.
  nn::DeferredWeightGrads<float> deferred;
  ctx.weight_grads = &deferred;
  std::vector<float> w(C * C, 0.f), dw(C * C, 0.f), dy(B * T * C, 0.f), dx(B * T * C, 0.f);
  CHECK_THROWS_WITH(nn::linear_backward<float>(ctx, dx.data(), dw.data(), nullptr, dy.data(),
                                               x.data(), w.data(), B * T, C, C),
                    Catch::Contains("split backward") && Catch::Contains("host kernels only"));

  // A named input in host memory cannot feed a device pass (the engine moves tokens and
  // targets only).
  ctx.weight_grads = nullptr;
  ctx.inputs.set("ids", Tensor<const std::int32_t>(tokens.data(), Shape{B, T}));
  nn::TokenEmbedding<float> wte("wte", 32, C, "ids");
  CHECK_THROWS_WITH(wte.forward(ctx), Catch::Contains("TokenEmbedding 'wte'") &&
                                          Catch::Contains("input 'ids' is host memory") &&
                                          Catch::Contains("runs on the cuda device"));
  // Given in the pass's device memory (tagged so; the recording set runs the host kernels), it
  // feeds the layer: the tag was dropped by Inputs, so no input could ever pass.
  ctx.inputs.set("ids", Tensor<const std::int32_t>(tokens.data(), Shape{B, T}, DeviceKind::cuda));
  CHECK(ctx.inputs.get<std::int32_t>("ids").device() == DeviceKind::cuda);
  std::vector<float> table(32 * C, 0.25f), table_grad(32 * C, 0.f);
  const nn::ParamView<float> table_view{Tensor<float>(table.data(), Shape{32, C}),
                                        Tensor<float>(table_grad.data(), Shape{32, C})};
  wte.bind(std::span<const nn::ParamView<float>>(&table_view, 1));
  CHECK_NOTHROW(wte.forward(ctx));
  CHECK(device.calls["embedding_forward"] == 1);
  CHECK(ctx.x.shape() == Shape{B, T, C});
  // A layer that converts its input on the host refuses device memory by name.
  std::vector<float> y(4);
  CHECK_THROWS_WITH(ctx.inputs.copy_as("ids", Tensor<float>(y.data(), Shape{4})),
                    Catch::Contains("'ids' is cuda memory"));
}

TEST_CASE("LinearCrossEntropy in a split backward over padded logits rows", "[unit][nn][kernels]") {
  constexpr std::int64_t N = 8, in = 4, classes = 5;
  std::vector<float> w(classes * in);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
  std::vector<float> x(N * in);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.05f * static_cast<float>(i % 9) - 0.2f;
  std::vector<std::int32_t> targets{1, 4, 0, 2, 3, 1, 0, 4};
  // Forward (training or not) and backward of the head through a set that pads its logits rows
  // 8 apart, in chunks of 3 rows (3, 3 and 2), the backward split when deferred is given: the
  // input and weight gradients.
  const auto run = [&](bool training, nn::DeferredWeightGrads<float>* deferred) {
    RecordingKernels<float> padding;
    padding.logits_row_align = 8;
    std::vector<float> dw(classes * in, 0.f), dx(N * in, 0.f);
    const nn::ParamView<float> view{Tensor<float>(w.data(), Shape{classes, in}),
                                    Tensor<float>(dw.data(), Shape{classes, in})};
    nn::LinearCrossEntropy<float> loss(
        "head", [&] { return view; }, in, classes, "targets", 3 * classes * 4);
    Arena<> arena(1 << 20);
    nn::StepContext<float> ctx;
    ctx.arena = &arena;
    ctx.kernels = &padding;
    ctx.targets = targets.data();
    ctx.batch = 1;
    ctx.seq_len = N;
    ctx.training = training;
    ctx.x = Tensor<float>(x.data(), Shape{N, in});
    loss.forward(ctx);
    ctx.weight_grads = deferred;
    ctx.dx = Tensor<float>(dx.data(), Shape{N, in});
    loss.backward(ctx);
    // A training forward takes each chunk's gradient with its loss; otherwise the backward
    // computes it.
    CHECK(padding.calls["cross_entropy_forward_backward"] == (training ? 3 : 0));
    CHECK(padding.calls["cross_entropy_backward"] == (training ? 0 : 3));
    return std::pair{dx, dw};
  };
  // A training forward computed the gradients: a split backward has no product left to defer
  // and gives the plain backward's gradients.
  nn::DeferredWeightGrads<float> deferred;
  const auto plain = run(true, nullptr);
  CHECK(run(true, &deferred) == plain);
  CHECK(deferred.empty());
  CHECK(plain.second != std::vector<float>(classes * in, 0.f));
  // After an evaluation forward the backward computes them, and a split one would keep the
  // address of the gradient's padded copy past its life: refused.
  CHECK_THROWS_WITH(run(false, &deferred),
                    Catch::Contains("split backward") && Catch::Contains("padded to 8"));
  CHECK(deferred.empty());
  const auto recomputed = run(false, nullptr);
  for (std::size_t i = 0; i < plain.first.size(); ++i) {
    CHECK(recomputed.first[i] == Approx(plain.first[i]).margin(1e-7));
  }
  for (std::size_t i = 0; i < plain.second.size(); ++i) {
    CHECK(recomputed.second[i] == Approx(plain.second[i]).margin(1e-7));
  }
}
