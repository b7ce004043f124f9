// Converts a zero checkpoint (any world size) into one consolidated safetensors file, offline
// and with bounded memory: the tensors are streamed segment by segment in chunks, never held
// whole (docs/checkpoints.md, "Export").
//
//   zero_to_safetensors <checkpoint-dir> [--tag TAG] [--out model.safetensors]
//                       [--dtype f32|bf16] [--chunk-mib 64] [--all] [--strip-prefix PREFIX]
//                       [--hf-gpt2] [--vocab N | --keep-padding]
//
// By default only the model's tensors are written (names without '/'; optimizer states are
// "<param>/exp_avg" and similar); --all writes every tensor. --tag defaults to `latest`.
// --hf-gpt2 writes GPT-2's four Conv1D weights per block transposed ([in, out]), the layout
// Hugging Face's GPT2LMHeadModel loads; zero keeps them [out, in]. A table padded past its
// vocabulary (a run at tensor-parallel size tp pads it to a multiple of tp: GPT-2's 50257 tokens
// as 50258 rows) is written as the rows in use its checkpoint records, unless --keep-padding;
// --vocab N writes the first N rows of the token embedding (the tensor named "*wte.weight")
// instead, for a checkpoint without the record. An optimizer state is written in its
// parameter's layout: transposed and trimmed with it.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <zero/checkpoint/checkpoint.hpp>
#include <zero/io/gpt2_layout.hpp>

#include "../cli_number.hpp"

namespace {

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s <checkpoint-dir> [--tag TAG] [--out FILE] [--dtype f32|bf16] "
               "[--chunk-mib N] [--all] [--strip-prefix PREFIX] [--hf-gpt2] "
               "[--vocab N | --keep-padding]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  namespace ckpt = zero::checkpoint;
  std::string dir, tag, out = "model.safetensors", dtype_name = "f32", strip;
  std::size_t chunk_mib = 64;
  std::int64_t vocab = 0;  // 0: every row of the token embedding
  bool all = false, hf_gpt2 = false, keep_padding = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* value = nullptr;
    if (a == "--all") {
      all = true;
    } else if (a == "--hf-gpt2") {
      hf_gpt2 = true;
    } else if (a == "--keep-padding") {
      keep_padding = true;
    } else if (a == "--tag" || a == "--out" || a == "--dtype" || a == "--chunk-mib" ||
               a == "--strip-prefix" || a == "--vocab") {
      if ((value = next()) == nullptr) return usage(argv[0]);
      if (a == "--tag") tag = value;
      if (a == "--out") out = value;
      if (a == "--dtype") dtype_name = value;
      try {
        if (a == "--chunk-mib") {
          chunk_mib = static_cast<std::size_t>(
              zero::examples::parse_integer("--chunk-mib", value, 1, std::int64_t{1} << 20));
        }
        if (a == "--vocab") {
          vocab = zero::examples::parse_integer("--vocab", value, 1, std::int64_t{1} << 40);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "zero_to_safetensors: %s\n", e.what());
        return 2;
      }
      if (a == "--strip-prefix") strip = value;
    } else if (!a.starts_with("--") && dir.empty()) {
      dir = a;
    } else {
      return usage(argv[0]);
    }
  }
  if (dir.empty() || (dtype_name != "f32" && dtype_name != "bf16") || (vocab > 0 && keep_padding)) {
    return usage(argv[0]);
  }
  try {
    const ckpt::Reader reader(dir, tag);
    std::vector<std::string> names;
    for (const auto& name : reader.names()) {
      if (all || name.find('/') == std::string::npos) names.push_back(name);
    }
    const ckpt::NameMapping mapping = [&](std::string_view name) {
      return !strip.empty() && name.starts_with(strip) ? std::string(name.substr(strip.size()))
                                                       : std::string(name);
    };
    ckpt::ExportOptions options;
    options.chunk_bytes = chunk_mib << 20;
    // A state ("<parameter>/exp_avg") keeps its parameter's layout: transposed and trimmed as it.
    if (hf_gpt2) {
      options.transpose = [](std::string_view name) {
        return zero::io::gpt2::is_conv1d_weight(ckpt::parameter_of(name));
      };
    }
    const auto is_token_table = [](std::string_view name) {
      return ckpt::parameter_of(name).ends_with("wte.weight");
    };
    if (vocab > 0) {
      bool found = false;
      for (const auto& name : names) found = found || is_token_table(name);
      if (!found) {
        std::fprintf(stderr,
                     "zero_to_safetensors: --vocab %lld: the checkpoint has no token embedding "
                     "(a tensor named *wte.weight) to trim\n",
                     static_cast<long long>(vocab));
        return 1;
      }
      options.leading_rows =
          [vocab, is_token_table](std::string_view name) -> std::optional<std::int64_t> {
        if (is_token_table(name)) return vocab;
        return std::nullopt;
      };
    } else if (!keep_padding) {
      options.leading_rows = ckpt::recorded_rows_limit(reader);
    }
    if (options.leading_rows) {
      for (const auto& name : names) {
        const auto rows = options.leading_rows(name);
        const auto& shape = reader.tensor(name).shape;
        if (rows && !shape.empty() && *rows < shape[0]) {
          std::printf("%s: the first %lld of its %lld rows (%s)\n", name.c_str(),
                      static_cast<long long>(*rows), static_cast<long long>(shape[0]),
                      vocab > 0 ? "--vocab" : "its rows in use; --keep-padding writes them all");
        }
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const auto result = ckpt::export_safetensors(
        reader, names, out, dtype_name == "bf16" ? zero::DType::bf16 : zero::DType::f32, mapping,
        options);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("checkpoint %s (tag %s, saved by %d ranks): %zu tensors -> %s (%s)\n",
                reader.path().c_str(), reader.tag().c_str(), reader.saved_world_size(),
                result.tensors, out.c_str(), dtype_name.c_str());
    std::printf(
        "bytes written: %llu in %.2f s (%.2f GB/s); peak buffer: %zu bytes (chunk %zu MiB)\n",
        static_cast<unsigned long long>(result.bytes_written), s,
        static_cast<double>(result.bytes_written) / s / 1e9, result.peak_buffer_bytes, chunk_mib);
    return 0;
  } catch (const std::exception& e) {  // zero::Error, and bad_alloc or filesystem_error too:
    // returning (rather than terminating) unwinds the writer, which removes its temporary file
    std::fprintf(stderr, "zero_to_safetensors: %s\n", e.what());
    return 1;
  }
}
