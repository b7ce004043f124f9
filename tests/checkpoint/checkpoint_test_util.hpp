#pragma once
// Shared by the checkpoint tests: a set of logical tensors of several dtypes and odd shapes
// with arbitrary bit patterns (compared bitwise), random segmentations of them over N saving
// ranks, and a collective save of such a segmentation on LocalComm.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <parallel/comm/local_comm.hpp>
#include <zero/checkpoint/checkpoint.hpp>

namespace zero::checkpoint::testing {

/// A logical tensor with its full data (what the saving ranks hold between them).
struct LogicalTensor {
  TensorSpec spec;
  std::vector<std::byte> bytes;  ///< numel * element size, arbitrary bits
};

/// Arbitrary but reproducible bits for element i of tensor k under version v (NaN patterns
/// included: everything is compared as bytes).
inline std::uint64_t bits_of(std::uint64_t v, std::uint64_t k, std::uint64_t i) {
  std::uint64_t x = (v + 1) * 0x9E3779B97F4A7C15ULL ^ (k + 7) * 0xC2B2AE3D27D4EB4FULL ^ i;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 29;
  return x;
}

/// The test tensors; version changes every value (for "which save is this?" checks).
inline std::vector<LogicalTensor> make_tensors(std::uint64_t version = 0, std::int64_t scale = 1) {
  const std::vector<TensorSpec> specs = {
      {"transformer.h.0.attn.c_attn.weight", DType::f32, {7, 5 * scale}},
      {"transformer.h.0.attn.c_attn.weight/exp_avg", DType::f32, {7, 5 * scale}},
      {"transformer.h.0.attn.c_attn.bias", DType::f32, {13}},
      {"transformer.wte.weight", DType::f32, {97, 3 * scale}},
      {"transformer.wte.weight/exp_avg_sq", DType::f32, {97, 3 * scale}},
      {"f64.state", DType::f64, {3, 4, 5}},
      {"bf16.weight", DType::bf16, {77}},
      {"scalar", DType::f32, {}},
      {"empty", DType::f32, {0, 4}},
      {"step.count", DType::i64, {2}},
  };
  std::vector<LogicalTensor> out;
  for (std::size_t k = 0; k < specs.size(); ++k) {
    LogicalTensor t{specs[k], {}};
    const std::size_t elem = size_of(t.spec.dtype);
    t.bytes.resize(static_cast<std::size_t>(t.spec.numel()) * elem);
    for (std::size_t i = 0; i < static_cast<std::size_t>(t.spec.numel()); ++i) {
      const std::uint64_t b = bits_of(version, k, i);
      std::memcpy(t.bytes.data() + i * elem, &b, elem);
    }
    out.push_back(std::move(t));
  }
  return out;
}

/// One rank's share of a random segmentation: (tensor index, first element, count).
struct Piece {
  std::size_t tensor = 0;
  std::int64_t offset = 0;
  std::int64_t count = 0;
};

/// Cuts every tensor at random points into 1..6 pieces and deals them to random ranks of n;
/// returns each rank's pieces (some ranks may hold nothing).
inline std::vector<std::vector<Piece>> random_segmentation(
    const std::vector<LogicalTensor>& tensors, int n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<Piece>> out(static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const std::int64_t numel = tensors[k].spec.numel();
    if (numel == 0) continue;
    const int cuts = std::uniform_int_distribution<int>(0, 5)(rng);
    std::vector<std::int64_t> at{0, numel};
    for (int c = 0; c < cuts; ++c) {
      at.push_back(std::uniform_int_distribution<std::int64_t>(1, numel)(rng));
    }
    std::sort(at.begin(), at.end());
    at.erase(std::unique(at.begin(), at.end()), at.end());
    for (std::size_t p = 0; p + 1 < at.size(); ++p) {
      const int rank = std::uniform_int_distribution<int>(0, n - 1)(rng);
      out[static_cast<std::size_t>(rank)].push_back({k, at[p], at[p + 1] - at[p]});
    }
  }
  return out;
}

/// Saves tensors from the pieces of comm's rank (all tensors declared on every rank).
template <class Comm>
SaveResult save_pieces(Comm& comm, const std::filesystem::path& dir, const std::string& tag,
                       const std::vector<LogicalTensor>& tensors, const std::vector<Piece>& pieces,
                       const nlohmann::json& engine, const SaveOptions& options = {}) {
  Writer writer;
  for (const auto& t : tensors) writer.add_tensor(t.spec);
  for (const Piece& p : pieces) {
    const LogicalTensor& t = tensors[p.tensor];
    const std::size_t elem = size_of(t.spec.dtype);
    writer.add_segment(
        {t.spec.name, p.offset, t.spec.dtype,
         std::span<const std::byte>(t.bytes).subspan(static_cast<std::size_t>(p.offset) * elem,
                                                     static_cast<std::size_t>(p.count) * elem)});
  }
  return writer.save(comm, dir, tag, engine, options);
}

/// Saves tensors with n LocalComm ranks under a random segmentation from seed.
inline void save_with_ranks(int n, const std::filesystem::path& dir, const std::string& tag,
                            const std::vector<LogicalTensor>& tensors, std::uint32_t seed,
                            const nlohmann::json& engine = nlohmann::json::object(),
                            const SaveOptions& options = {}) {
  const auto pieces = random_segmentation(tensors, n, seed);
  parallel::LocalComm::run(n, [&](parallel::LocalComm& comm) {
    save_pieces(comm, dir, tag, tensors, pieces[static_cast<std::size_t>(comm.rank())], engine,
                options);
  });
}

/// Reads elements [offset, offset + count) of t from reader in t's own dtype as bytes.
inline std::vector<std::byte> read_bytes(const Reader& reader, const LogicalTensor& t,
                                         std::int64_t offset, std::int64_t count) {
  std::vector<std::byte> out(static_cast<std::size_t>(count) * size_of(t.spec.dtype));
  visit_dtype(t.spec.dtype, [&](auto tag) {
    using T = decltype(tag);
    reader.read(t.spec.name, offset,
                std::span<T>(reinterpret_cast<T*>(out.data()), static_cast<std::size_t>(count)));
  });
  return out;
}

/// True when bytes equal elements [offset, offset + count) of t.
inline bool same_bytes(const LogicalTensor& t, std::int64_t offset,
                       const std::vector<std::byte>& bytes) {
  const std::size_t elem = size_of(t.spec.dtype);
  if (bytes.empty()) return true;  // memcmp wants valid pointers even for no bytes
  return std::memcmp(t.bytes.data() + static_cast<std::size_t>(offset) * elem, bytes.data(),
                     bytes.size()) == 0;
}

}  // namespace zero::checkpoint::testing
