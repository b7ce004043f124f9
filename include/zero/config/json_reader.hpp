#pragma once
// JsonReader: typed access to one JSON object of a config, by key, with the key path in every
// error, DeepSpeed's "auto" (the program fills the value in) read as an empty optional, numbers
// written as floats accepted for integers when exact (DeepSpeed configs write 5e8), and every key
// that nobody read reported as unknown. Readers of one config share a log of the key paths they
// read and of those set to "auto", so the parser can check its reads against the key table.

#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <zero/core/error.hpp>

namespace zero::config {

/// Key paths that the readers of one config read, and those that were "auto".
struct ReadLog {
  std::vector<std::string> read;   ///< every present key path a reader took
  std::vector<std::string> autos;  ///< those set to "auto"
};

/// s in lower case (ASCII: DeepSpeed lowercases some of its string values).
inline std::string lowercase(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

/// Reads the keys of one JSON object; path is the object's key path ("" at the top).
class JsonReader {
 public:
  JsonReader(const nlohmann::json& object, std::string path,
             std::shared_ptr<ReadLog> log = std::make_shared<ReadLog>())
      : json_(object), path_(std::move(path)), log_(std::move(log)) {
    expect<ConfigError>(object.is_object() || object.is_null(), where(""),
                        ": expected an object, got ", object.dump());
  }

  /// The key path of key inside this object.
  std::string where(const std::string& key) const {
    if (key.empty()) return path_.empty() ? "<config>" : path_;
    return path_.empty() ? key : path_ + "." + key;
  }
  bool has(const std::string& key) const { return json_.is_object() && json_.contains(key); }
  /// True when key is present and null (DeepSpeed's None).
  bool is_null(const std::string& key) const { return has(key) && json_.at(key).is_null(); }
  /// True when key is present and set to "auto".
  bool is_auto(const std::string& key) const {
    return has(key) && json_.at(key).is_string() && json_.at(key).get<std::string>() == "auto";
  }
  /// This object's key path ("" at the top).
  const std::string& path() const { return path_; }
  /// True when key was read already.
  bool was_read(const std::string& key) const { return read_.contains(key); }
  /// The log shared by the readers of this config.
  const ReadLog& log() const { return *log_; }

  /// A boolean; empty when absent or "auto".
  std::optional<bool> boolean(const std::string& key) {
    const nlohmann::json* v = take(key);
    if (v == nullptr) return std::nullopt;
    expect<ConfigError>(v->is_boolean(), where(key), ": expected true or false, got ", v->dump());
    return v->get<bool>();
  }
  /// A number; empty when absent or "auto".
  std::optional<double> number(const std::string& key) {
    const nlohmann::json* v = take(key);
    if (v == nullptr) return std::nullopt;
    expect<ConfigError>(v->is_number(), where(key), ": expected a number, got ", v->dump());
    return v->get<double>();
  }
  /// An integer (a float with an integral value such as 5e8 is accepted); empty when absent/auto.
  std::optional<std::int64_t> integer(const std::string& key) {
    const nlohmann::json* v = take(key);
    if (v == nullptr) return std::nullopt;
    expect<ConfigError>(v->is_number(), where(key), ": expected an integer, got ", v->dump());
    const double d = v->get<double>();
    expect<ConfigError>(std::floor(d) == d && std::fabs(d) < 9.0e18, where(key),
                        ": expected an integer, got ", v->dump());
    return v->is_number_integer() ? v->get<std::int64_t>() : static_cast<std::int64_t>(d);
  }
  /// An integer that narrows to int (a size, count or rank number): integer(), and a
  /// ConfigError naming the key outside int's range (4294967297 would wrap to 1).
  std::optional<int> int32(const std::string& key) {
    const auto v = integer(key);
    if (!v) return std::nullopt;
    return within_int(*v, key);
  }
  /// v read from key, checked to fit an int.
  int within_int(std::int64_t v, const std::string& key) const {
    expect<ConfigError>(
        v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(), where(key),
        ": ", v, " is out of range (a 32-bit integer)");
    return static_cast<int>(v);
  }
  /// A string; empty when absent (a literal "auto" is returned as "auto" only via is_auto()).
  std::optional<std::string> string(const std::string& key) {
    const nlohmann::json* v = take(key);
    if (v == nullptr) return std::nullopt;
    expect<ConfigError>(v->is_string(), where(key), ": expected a string, got ", v->dump());
    return v->get<std::string>();
  }
  /// A string, empty also when null (DeepSpeed's None: the default).
  std::optional<std::string> string_or_null(const std::string& key) {
    const nlohmann::json* v = take(key);
    if (v == nullptr || v->is_null()) return std::nullopt;
    return string(key);
  }
  /// "auto" -> empty; absent -> fallback; otherwise the boolean.
  std::optional<bool> boolean_or_auto(const std::string& key, bool fallback) {
    if (is_auto(key)) {
      take(key);
      return std::nullopt;
    }
    return boolean(key).value_or(fallback);
  }
  /// "auto" -> empty; absent -> fallback; otherwise the number.
  std::optional<double> number_or_auto(const std::string& key, double fallback) {
    if (is_auto(key)) {
      take(key);
      return std::nullopt;
    }
    return number(key).value_or(fallback);
  }
  /// "auto" -> empty; absent -> fallback; otherwise the integer.
  std::optional<std::int64_t> integer_or_auto(const std::string& key,
                                              std::optional<std::int64_t> fallback) {
    if (is_auto(key)) {
      take(key);
      return std::nullopt;
    }
    const auto v = integer(key);
    return v ? v : fallback;
  }
  /// A list of numbers; empty when absent or "auto".
  std::optional<std::vector<double>> numbers(const std::string& key) {
    const nlohmann::json* v = take(key);
    if (v == nullptr) return std::nullopt;
    expect<ConfigError>(v->is_array(), where(key), ": expected a list of numbers, got ", v->dump());
    std::vector<double> out;
    for (const auto& e : *v) {
      expect<ConfigError>(e.is_number(), where(key), ": expected a list of numbers, got ",
                          v->dump());
      out.push_back(e.get<double>());
    }
    return out;
  }
  /// A nested object's reader (an empty object when absent).
  JsonReader object(const std::string& key) {
    read_.insert(key);
    static const nlohmann::json empty = nlohmann::json::object();  // immutable
    if (!has(key)) return JsonReader(empty, where(key), log_);
    return JsonReader(json_.at(key), where(key), log_);
  }
  /// The raw value of key (marks it read); null when absent.
  nlohmann::json raw(const std::string& key) {
    note(key);
    return has(key) ? json_.at(key) : nlohmann::json();
  }

  /// Key paths of keys present but never read.
  std::vector<std::string> unknown_keys() const {
    std::vector<std::string> out;
    if (!json_.is_object()) return out;
    for (const auto& [key, value] : json_.items()) {
      if (!read_.contains(key)) out.push_back(where(key));
    }
    return out;
  }

 private:
  // The value of key, marked read; null for absent or "auto".
  const nlohmann::json* take(const std::string& key) {
    note(key);
    if (!has(key) || is_auto(key)) return nullptr;
    return &json_.at(key);
  }

  // Marks key read and logs its path when present (and "auto").
  void note(const std::string& key) {
    read_.insert(key);
    if (!has(key)) return;
    log_->read.push_back(where(key));
    if (is_auto(key)) log_->autos.push_back(where(key));
  }

  const nlohmann::json& json_;
  std::string path_;
  std::set<std::string> read_;
  std::shared_ptr<ReadLog> log_;
};

}  // namespace zero::config
