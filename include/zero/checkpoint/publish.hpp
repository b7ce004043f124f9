#pragma once
// Making a fully written tag directory appear under its final name in one atomic step, and
// cleaning up what interrupted saves leave behind.
//
// A new tag: rename(<tag>.tmp-<nonce>, <tag>), then fsync of the parent directory.
// An existing tag (saving the same tag again): renameat2(RENAME_EXCHANGE) swaps the two
// directories atomically, so <tag> names the old complete checkpoint up to the instant it names
// the new one; the old one, now under the temporary name, is then removed. Where the file system
// cannot exchange (EINVAL), the fallback is two renames: <tag> -> <tag>.old-<nonce>, then the
// new one into place. A crash between them leaves no <tag> but a complete <tag>.old-<nonce>;
// remove_stale_entries (run by every save) and load (restore_replaced_tag, for the tag it opens)
// rename it back, so the old checkpoint is never lost; a second rename that fails puts the old
// one back at once.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <zero/checkpoint/layout.hpp>
#include <zero/core/error.hpp>
#include <zero/io/file.hpp>

namespace zero::checkpoint {

using io::sync_directory;

/// create_directories(dir), then an fsync of the parent of every directory it made, so a
/// checkpoint directory made by the first save survives a crash with the tag published in it.
inline void create_durable_directories(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> made;  // deepest first
  std::error_code ec;
  for (std::filesystem::path p = dir; !p.empty() && !std::filesystem::exists(p, ec);
       p = p.parent_path()) {
    made.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::filesystem::create_directories(dir);
  for (auto it = made.rbegin(); it != made.rend(); ++it) {
    const std::filesystem::path parent = it->parent_path().empty() ? "." : it->parent_path();
    sync_directory(parent);
  }
}

namespace detail {
/// The tag of name when name is "<tag><marker><nonce>", the form of the directories a save
/// makes (a valid tag, then 16 lowercase hex digits: make_nonce); empty otherwise.
inline std::string_view tag_of_leftover(std::string_view name, std::string_view marker) {
  constexpr std::size_t nonce_chars = 16;
  if (name.size() <= marker.size() + nonce_chars) return {};
  const std::size_t at = name.size() - nonce_chars - marker.size();
  if (name.substr(at, marker.size()) != marker) return {};
  for (char c : name.substr(at + marker.size())) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return {};
  }
  const std::string_view tag = name.substr(0, at);
  try {
    validate_tag(tag);
  } catch (const CheckpointError&) {
    return {};
  }
  return tag;
}
/// True when name is "latest.tmp.<pid>.<thread>" or "latest.tmp.<pid>.<thread>.<attempt>",
/// the temporary file io::AtomicFile writes `latest` under.
inline bool is_latest_leftover(std::string_view name) {
  const std::string prefix = std::string(latest_file_name) + ".tmp.";
  if (!name.starts_with(prefix)) return false;
  name.remove_prefix(prefix.size());
  int numbers = 0;
  while (!name.empty()) {
    const std::size_t dot = name.find('.');
    const std::string_view number = name.substr(0, dot);
    if (number.empty() || number.find_first_not_of("0123456789") != std::string_view::npos) {
      return false;
    }
    ++numbers;
    name = dot == std::string_view::npos ? std::string_view() : name.substr(dot + 1);
    if (dot != std::string_view::npos && name.empty()) return false;  // a trailing dot
  }
  return numbers == 2 || numbers == 3;
}

/// rename(from, to) or IoError naming both.
inline void rename_or_throw(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int code = errno;
    raise<IoError>("renaming '", from.string(), "' to '", to.string(),
                   "' failed: ", io::detail::errno_text(code));
  }
}
}  // namespace detail

/// Makes the complete directory temp appear as final (same parent), replacing an existing
/// final atomically where the file system allows (see the file comment). Durable on return.
inline void publish_directory(const std::filesystem::path& temp,
                              const std::filesystem::path& final) {
  const std::filesystem::path parent = final.parent_path().empty() ? "." : final.parent_path();
  std::error_code ec;
  if (!std::filesystem::exists(final, ec)) {
    detail::rename_or_throw(temp, final);
    sync_directory(parent);
    return;
  }
  if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, final.c_str(), RENAME_EXCHANGE) == 0) {
    sync_directory(parent);
    std::filesystem::remove_all(temp, ec);  // now the old checkpoint; garbage if this fails
    return;
  }
  const int code = errno;
  if (code != EINVAL && code != ENOSYS) {
    raise<IoError>("exchanging '", temp.string(), "' with '", final.string(),
                   "' failed: ", io::detail::errno_text(code));
  }
  std::string old_name = temp.filename().string();
  const auto marker = old_name.find(temp_marker);
  old_name.replace(marker, temp_marker.size(), old_marker);
  const std::filesystem::path old = parent / old_name;
  detail::rename_or_throw(final, old);
  try {
    detail::rename_or_throw(temp, final);
  } catch (const IoError&) {
    // The old checkpoint goes back under its name (if that fails too, a load or the next save
    // restores it: restore_replaced_tag); the caller removes the new one with its temporary.
    if (::rename(old.c_str(), final.c_str()) == 0) sync_directory(parent);
    throw;
  }
  sync_directory(parent);
  std::filesystem::remove_all(old, ec);
}

/// Renames "<tag>.old-*" in dir back to <tag> when <tag> is missing: what a crash (or a failed
/// second rename) inside publish_directory's two-rename fallback leaves, a complete checkpoint
/// under the old name. Returns whether it renamed one; IoError when the rename fails.
inline bool restore_replaced_tag(const std::filesystem::path& dir, const std::string& tag) {
  std::error_code ec;
  if (std::filesystem::exists(dir / tag, ec)) return false;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (detail::tag_of_leftover(name, old_marker) != tag || !entry.is_directory(ec)) continue;
    if (::rename(entry.path().c_str(), (dir / tag).c_str()) != 0) {
      const int code = errno;
      // Another load (or the interrupted save itself) put a <tag> back meanwhile.
      if (std::filesystem::exists(dir / tag, ec)) return false;
      raise<IoError>("renaming '", entry.path().string(), "' back to '", (dir / tag).string(),
                     "' failed: ", io::detail::errno_text(code));
    }
    sync_directory(dir);
    return true;
  }
  return false;
}

/// Removes what interrupted saves left in dir: "<tag>.tmp-<nonce>" directories and temporary
/// files of `latest`; a "<tag>.old-<nonce>" directory is renamed back to <tag> when <tag> is
/// missing (a crash inside the two-rename fallback of publish_directory) and removed otherwise.
/// Only those exact forms are touched (a valid tag, a 16-digit nonce, a directory; `latest`'s
/// temporary a file): a user's "notes.tmp-1" or "eval.old-run/" beside the checkpoints stays.
/// Only one save may run in a directory at a time: this would remove a concurrent save's
/// temporary.
inline void remove_stale_entries(const std::filesystem::path& dir) {
  std::error_code ec;
  // Listed first: the loop below changes the directory, which an iteration must not see.
  std::vector<std::filesystem::directory_entry> entries;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) entries.push_back(entry);
  for (const auto& entry : entries) {
    const std::string name = entry.path().filename().string();
    const auto path = dir / name;
    const bool directory = entry.is_directory(ec) && !entry.is_symlink(ec);
    if ((directory && !detail::tag_of_leftover(name, temp_marker).empty()) ||
        (detail::is_latest_leftover(name) && entry.is_regular_file(ec) && !entry.is_symlink(ec))) {
      std::filesystem::remove_all(path, ec);
    } else if (const auto tag = detail::tag_of_leftover(name, old_marker);
               directory && !tag.empty()) {
      const auto original = dir / std::string(tag);
      if (!std::filesystem::exists(original, ec)) {
        detail::rename_or_throw(path, original);
        sync_directory(dir);
      } else {
        std::filesystem::remove_all(path, ec);
      }
    }
  }
}

}  // namespace zero::checkpoint
