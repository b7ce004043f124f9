#pragma once
// read_json_file: a whole JSON file parsed, with errors that name the file and what it is (a
// Hugging Face config.json, a sharded checkpoint's index).

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>

namespace zero::io {

/// The JSON document in file, which messages call what ("Hugging Face config"): OpenError when
/// it cannot be opened, ParseError when it is not JSON (naming nlohmann's position).
template <class ParseError, class OpenError = ParseError>
nlohmann::json read_json_file(const std::filesystem::path& file, std::string_view what) {
  std::ifstream in(file);
  expect<OpenError>(in.good(), "cannot open ", what, " '", file.string(), "'");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    raise<ParseError>(what, " '", file.string(), "': invalid JSON: ", e.what());
  }
}

}  // namespace zero::io
