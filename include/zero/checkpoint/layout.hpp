#pragma once
// The names on disk of a checkpoint directory (docs/checkpoints.md):
//   <dir>/latest                      the newest complete tag, one line
//   <dir>/<tag>/index.json            the index: logical tensors, their segments, engine state
//   <dir>/<tag>/rank-00000-of-00004.safetensors   one shard file per saving rank
//   <dir>/<tag>.tmp-<nonce>/          a save in progress (never read; removed by the next save)
// and the tag rules, reading and replacing `latest`, and listing complete tags.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <zero/core/error.hpp>
#include <zero/io/file.hpp>

namespace zero::checkpoint {

/// The index file inside a tag directory.
inline constexpr std::string_view index_file_name = "index.json";
/// The file naming the newest complete tag.
inline constexpr std::string_view latest_file_name = "latest";
/// Marks a tag directory still being written: "<tag>.tmp-<nonce>".
inline constexpr std::string_view temp_marker = ".tmp-";
/// Marks a replaced tag directory awaiting removal: "<tag>.old-<nonce>".
inline constexpr std::string_view old_marker = ".old-";
/// Longest tag accepted (a file name component with room for the markers).
inline constexpr std::size_t max_tag_chars = 200;

/// The shard file of rank among world ranks: "rank-00003-of-00008.safetensors".
inline std::string shard_file_name(int rank, int world_size) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", rank, world_size);
  return name;
}

/// Throws CheckpointError unless tag is a usable tag: 1..200 characters of [A-Za-z0-9._-], not
/// "." or "..", not "latest", not starting "latest.tmp.", and without the temporary or replaced
/// markers.
inline void validate_tag(std::string_view tag) {
  expect<CheckpointError>(!tag.empty() && tag.size() <= max_tag_chars, "checkpoint tag '", tag,
                          "' must have 1 to ", max_tag_chars, " characters");
  for (char c : tag) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    expect<CheckpointError>(ok, "checkpoint tag '", tag, "' has the character '", c,
                            "'; tags use letters, digits, '.', '_' and '-' only");
  }
  expect<CheckpointError>(tag != "." && tag != ".." && tag != latest_file_name, "checkpoint tag '",
                          tag, "' is reserved");
  expect<CheckpointError>(tag.find(temp_marker) == std::string_view::npos &&
                              tag.find(old_marker) == std::string_view::npos,
                          "checkpoint tag '", tag, "' contains '", temp_marker, "' or '",
                          old_marker, "', which mark incomplete directories");
  // The temporary file of `latest` (AtomicFile's "latest.tmp.<pid>..."): a later save clears
  // such names away as its own leftovers.
  expect<CheckpointError>(!tag.starts_with(std::string(latest_file_name) + ".tmp."),
                          "checkpoint tag '", tag, "' starts with '", latest_file_name,
                          ".tmp.', which marks a temporary file of '", latest_file_name, "'");
}

/// Reads the tag named by <dir>/latest; CheckpointError if the file is missing, empty or holds
/// an invalid tag.
inline std::string read_latest(const std::filesystem::path& dir) {
  const auto path = dir / latest_file_name;
  std::error_code ec;
  expect<CheckpointError>(std::filesystem::is_regular_file(path, ec), "no checkpoint to load in '",
                          dir.string(), "': '", path.string(),
                          "' does not exist (no save completed there; pass a tag explicitly)");
  const io::ReadFile file(path);
  expect<CheckpointError>(file.size() <= 4096, "'", path.string(), "' has ", file.size(),
                          " bytes; it should hold one tag (corrupt?)");
  std::string text(static_cast<std::size_t>(file.size()), '\0');
  file.read_at(0, text.data(), text.size(), "the latest tag");
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) {
    text.pop_back();
  }
  try {
    validate_tag(text);
  } catch (const CheckpointError& e) {
    raise<CheckpointError>("'", path.string(), "' does not hold a valid tag: ", e.what());
  }
  return text;
}

/// Replaces <dir>/latest with tag durably: temporary file, fsync, rename, fsync of dir.
inline void write_latest(const std::filesystem::path& dir, std::string_view tag) {
  validate_tag(tag);
  io::AtomicFile file(dir / latest_file_name);
  std::string line(tag);
  line.push_back('\n');
  file.write(line.data(), line.size());
  file.commit();
}

/// The complete tags in dir (directories holding an index, not temporary ones), sorted.
inline std::vector<std::string> list_tags(const std::filesystem::path& dir) {
  std::vector<std::string> tags;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.find(temp_marker) != std::string::npos || name.find(old_marker) != std::string::npos)
      continue;
    if (entry.is_directory(ec) && std::filesystem::exists(entry.path() / index_file_name, ec)) {
      tags.push_back(name);
    }
  }
  std::sort(tags.begin(), tags.end());
  return tags;
}

}  // namespace zero::checkpoint
