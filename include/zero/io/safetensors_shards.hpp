#pragma once
// Hugging Face's sharded safetensors checkpoints: a model's weights in several files
// ("model-00001-of-00004.safetensors", ...) beside an index, "model.safetensors.index.json":
//   {"metadata": {"total_size": <bytes of every tensor's data>},
//    "weight_map": {"<tensor>": "<file in the index's directory>", ...}}
// which is what save_pretrained writes past its max_shard_size and how the Hub holds models
// past a few GB (Llama 3.1 8B: four files).
//
// SafetensorsShards reads one: given the index, the directory that holds it (or a directory
// with a single model.safetensors), or one safetensors file, it opens every file the index
// names, checks that each tensor is where the index says, and reads element ranges of any
// tensor with SafetensorsReader's calls (pread: a rank reads only its slice). Files and tensors
// the index does not name are ignored, as Hugging Face ignores them.
//
// SafetensorsShardWriter writes one from declared tensors whose data arrive in declaration
// order, as SafetensorsWriter does: the tensors are split, in order, into files of at most
// max_shard_bytes of data (a new file starts where the next tensor would pass the limit; a
// tensor larger than the limit has a file of its own: Hugging Face's rule). The files stay
// temporary until commit, which renames them into place, writes the index, and removes what an
// earlier export under the same name left (shards of another count; the index when one file
// replaces shards, the one file when shards replace it); an abandoned writer leaves nothing
// behind. Where everything fits in one file (or max_shard_bytes is 0) it
// writes the one file alone, under the path given, and no index.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>
#include <zero/core/tensor.hpp>
#include <zero/io/file.hpp>
#include <zero/io/json_file.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_writer.hpp>

namespace zero::io {

/// The name Hugging Face gives a model's single weights file and, with ".index.json", its index.
inline constexpr std::string_view hf_weights_name = "model.safetensors";

/// The index of file (a model's weights file, "model.safetensors" in save_pretrained's form):
/// the same path with ".index.json" appended.
inline std::filesystem::path shard_index_path(const std::filesystem::path& file) {
  std::filesystem::path index = file;
  index += ".index.json";
  return index;
}

/// Shard i (0-based) of n of file: "<stem>-0000{i+1}-of-0000{n}<extension>" beside it, as
/// Hugging Face names "model-00001-of-00004.safetensors" after "model.safetensors".
inline std::filesystem::path shard_path(const std::filesystem::path& file, int i, int n) {
  char numbers[32];
  std::snprintf(numbers, sizeof numbers, "-%05d-of-%05d", i + 1, n);
  return file.parent_path() / (file.stem().string() + numbers + file.extension().string());
}

/// True when name is a shard of file's name: "<stem>-NNNNN-of-NNNNN<extension>" (shard_path's).
inline bool is_shard_name(std::string_view name, const std::filesystem::path& file) {
  const std::string stem = file.stem().string(), extension = file.extension().string();
  constexpr std::string_view middle = "-of-";
  if (name.size() != stem.size() + 1 + 5 + middle.size() + 5 + extension.size() ||
      !name.starts_with(stem) || !name.ends_with(extension)) {
    return false;
  }
  const std::string_view numbers = name.substr(stem.size(), 1 + 5 + middle.size() + 5);
  const auto digits = [](std::string_view d) {
    return std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return numbers[0] == '-' && digits(numbers.substr(1, 5)) && numbers.substr(6, 4) == middle &&
         digits(numbers.substr(10, 5));
}

/// The files of a model's weights written as num_files files under the name file: file itself
/// (num_files 1), else its shards, then its index.
inline std::vector<std::filesystem::path> weights_files(const std::filesystem::path& file,
                                                        int num_files) {
  if (num_files <= 1) return {file};
  std::vector<std::filesystem::path> out;
  for (int i = 0; i < num_files; ++i) out.push_back(shard_path(file, i, num_files));
  out.push_back(shard_index_path(file));
  return out;
}

/// Read access to a model's weights in one safetensors file or in the shards of an index.
class SafetensorsShards {
 public:
  /// Opens path: an index (a name ending in ".index.json"), a directory (its
  /// model.safetensors.index.json, else its model.safetensors), or one safetensors file. Throws
  /// CheckpointError for a malformed index (naming it and the entry at fault), a tensor missing
  /// from the file the index names, or a directory with neither file; IoError for a file it
  /// cannot read.
  explicit SafetensorsShards(const std::filesystem::path& path) {
    std::filesystem::path target = path;
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      const std::filesystem::path single = path / hf_weights_name;
      const std::filesystem::path index = shard_index_path(single);
      if (std::filesystem::exists(index, ec)) {
        target = index;
      } else {
        expect<CheckpointError>(std::filesystem::exists(single, ec), "directory '", path.string(),
                                "' holds neither '", index.filename().string(), "' nor '",
                                single.filename().string(), "'");
        target = single;
      }
    }
    path_ = target;
    if (!target.string().ends_with(".index.json")) {
      files_.push_back(std::make_unique<SafetensorsReader>(target));
      for (const TensorInfo& t : files_.front()->tensors()) where_.emplace(t.name, 0);
      return;
    }
    open_index(target);
  }

  /// The path opened: the index, or the one file.
  const std::filesystem::path& path() const { return path_; }
  /// True when the weights came with an index (more files than one, or one named by an index).
  bool sharded() const { return sharded_; }
  /// The files, in the order the index first names them.
  std::size_t num_files() const { return files_.size(); }
  /// The reader of file i.
  const SafetensorsReader& file(std::size_t i) const { return *files_.at(i); }

  /// True when the weights hold a tensor called name.
  bool contains(std::string_view name) const { return where_.find(name) != where_.end(); }
  /// The names of every tensor, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(where_.size());
    for (const auto& [name, file] : where_) out.push_back(name);
    return out;
  }

  /// The reader of the file that holds name; CheckpointError naming the index and the tensor.
  const SafetensorsReader& reader_of(std::string_view name) const {
    const auto it = where_.find(name);
    if (it == where_.end()) {
      if (!sharded_) (void)files_.front()->info(name);  // the file's own message
      raise<CheckpointError>("safetensors index '", path_.string(), "' maps no tensor '", name,
                             "' (it maps ", where_.size(), " tensors)");
    }
    return *files_[it->second];
  }

  /// The entry for name in its file.
  const TensorInfo& info(std::string_view name) const { return reader_of(name).info(name); }

  /// SafetensorsReader::read_elements from the file that holds name.
  template <class T>
  void read_elements(std::string_view name, std::int64_t first, Tensor<T> out,
                     DTypeRule rule = DTypeRule::exact) const {
    reader_of(name).read_elements(name, first, out, rule);
  }

  /// SafetensorsReader::read_vector from the file that holds name.
  template <class T>
  std::vector<T> read_vector(std::string_view name, DTypeRule rule = DTypeRule::exact) const {
    return reader_of(name).template read_vector<T>(name, rule);
  }

 private:
  /// Reads the index, opens each file it names once and checks each tensor is in its file.
  void open_index(const std::filesystem::path& index) {
    sharded_ = true;
    const std::string where = index.string();
    const nlohmann::json j = read_json_file<CheckpointError, IoError>(index, "safetensors index");
    expect<CheckpointError>(
        j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
        "safetensors index '", where, "' has no \"weight_map\" object");
    const auto& map = j["weight_map"];
    expect<CheckpointError>(!map.empty(), "safetensors index '", where,
                            "': \"weight_map\" names no tensor");
    std::map<std::string, std::size_t, std::less<>> file_index;
    for (const auto& [tensor, value] : map.items()) {
      expect<CheckpointError>(value.is_string(), "safetensors index '", where, "': tensor '",
                              tensor, "' maps to ", value.dump(), ", not a file name");
      const std::string name = value.get<std::string>();
      const std::filesystem::path rel(name);
      const bool plain =
          !name.empty() && rel.is_relative() &&
          std::none_of(rel.begin(), rel.end(), [](const auto& part) { return part == ".."; });
      expect<CheckpointError>(plain, "safetensors index '", where, "': tensor '", tensor,
                              "' maps to '", name,
                              "'; a shard must be a file under the index's directory");
      auto [it, added] = file_index.emplace(name, files_.size());
      if (added) files_.push_back(std::make_unique<SafetensorsReader>(index.parent_path() / rel));
      const SafetensorsReader& file = *files_[it->second];
      expect<CheckpointError>(file.contains(tensor), "safetensors index '", where,
                              "' maps tensor '", tensor, "' to '", file.path().string(),
                              "', which has no such tensor");
      where_.emplace(tensor, it->second);
    }
  }

  std::filesystem::path path_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, std::size_t, std::less<>> where_;  // tensor -> its file in files_
};

/// Writes a model's weights as one safetensors file or, past max_shard_bytes, as Hugging Face's
/// shards and index (see the file comment). The calls are SafetensorsWriter's.
class SafetensorsShardWriter {
 public:
  /// Plans the files for tensors (declaration order) and creates the first. file is the single
  /// file's path ("model.safetensors"); the shards go beside it (shard_path) with its index
  /// (shard_index_path). metadata goes into every file's header. Throws as SafetensorsWriter.
  SafetensorsShardWriter(std::filesystem::path file, const std::vector<TensorDecl>& tensors,
                         std::map<std::string, std::string> metadata = {},
                         std::uint64_t max_shard_bytes = 0)
      : file_(std::move(file)), metadata_(std::move(metadata)) {
    std::uint64_t bytes_in_shard = 0;
    for (const TensorDecl& d : tensors) {
      std::uint64_t bytes = size_of(d.dtype);
      for (std::int64_t e : d.shape) {
        bytes *= static_cast<std::uint64_t>(std::max<std::int64_t>(e, 0));
      }
      total_bytes_ += bytes;
      const bool full = max_shard_bytes > 0 && !shards_.empty() && !shards_.back().empty() &&
                        bytes_in_shard + bytes > max_shard_bytes;
      if (shards_.empty() || full) {
        shards_.emplace_back();
        bytes_in_shard = 0;
      }
      shards_.back().push_back(d);
      bytes_in_shard += bytes;
      tensors_.push_back(d.name);
    }
    if (shards_.empty()) shards_.emplace_back();  // no tensors: one empty file
    open_next();
  }

  /// The number of files the tensors go into (1: no index).
  int num_files() const { return static_cast<int>(shards_.size()); }
  /// The files' paths (the single file, or the shards), then the index's where there is one.
  std::vector<std::filesystem::path> paths() const { return weights_files(file_, num_files()); }
  /// Every declared tensor's name, in order.
  const std::vector<std::string>& tensors() const { return tensors_; }
  /// The bytes of every tensor's data (the index's total_size).
  std::uint64_t total_bytes() const { return total_bytes_; }

  /// SafetensorsWriter::write into the file of tensor name (the files fill in turn).
  template <class T>
  void write(std::string_view name, Tensor<T> data, DTypeRule rule = DTypeRule::exact) {
    writers_.back()->write(name, data, rule);
    open_next();
  }

  /// Checks every tensor is written, then commits the files in order, writes the index when
  /// there are shards, and removes what an earlier export under the name left (remove_stale).
  /// Until then every file is a temporary one, so an abandoned writer leaves nothing behind (and
  /// replaces nothing).
  void commit() {
    const std::string_view next = writers_.back()->next_tensor();
    expect<CheckpointError>(next.empty(), "safetensors file '", file_.string(),
                            "': cannot commit before tensor '", next,
                            "' and the ones after it are written");
    for (auto& writer : writers_) writer->commit();
    if (num_files() > 1) write_index();
    remove_stale();
  }

 private:
  /// The index of the shards: total_size and every tensor's file.
  void write_index() const {
    nlohmann::ordered_json index;
    index["metadata"]["total_size"] = total_bytes_;
    nlohmann::ordered_json& map = index["weight_map"];
    for (int i = 0; i < num_files(); ++i) {
      for (const TensorDecl& d : shards_[static_cast<std::size_t>(i)]) {
        map[d.name] = path_of(i).filename().string();
      }
    }
    const std::string text = index.dump(2) + "\n";
    AtomicFile out(shard_index_path(file_));
    out.write(text.data(), text.size());
    out.commit();
  }

  std::filesystem::path path_of(int i) const {
    return num_files() == 1 ? file_ : shard_path(file_, i, num_files());
  }

  /// Removes what an earlier export under the same name left that this one did not replace, as
  /// save_pretrained does: shards of another count and, for one file, the index (a directory
  /// holding an index loads through it) or, for shards, the one file. The new files and index
  /// are in place by then; a stale index goes first, so an interrupted clean-up never leaves an
  /// index naming removed shards.
  void remove_stale() const {
    std::error_code ec;
    std::filesystem::remove(num_files() == 1 ? shard_index_path(file_) : file_, ec);
    std::vector<std::string> kept;
    for (const auto& p : paths()) kept.push_back(p.filename().string());
    std::filesystem::path dir = file_.parent_path();
    if (dir.empty()) dir = ".";
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (is_shard_name(name, file_) && std::find(kept.begin(), kept.end(), name) == kept.end()) {
        std::filesystem::remove(entry.path(), ec);
      }
    }
  }

  /// Opens the first file, or the next one once the last opened has all its tensors (a file of
  /// zero-size tensors only is complete when opened).
  void open_next() {
    while (writers_.size() < shards_.size() &&
           (writers_.empty() || writers_.back()->next_tensor().empty())) {
      const std::size_t i = writers_.size();
      writers_.push_back(
          std::make_unique<SafetensorsWriter>(path_of(static_cast<int>(i)), shards_[i], metadata_));
    }
  }

  std::filesystem::path file_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::vector<TensorDecl>> shards_;
  std::vector<std::string> tensors_;
  std::uint64_t total_bytes_ = 0;
  std::vector<std::unique_ptr<SafetensorsWriter>> writers_;
};

}  // namespace zero::io
