#pragma once
// Filling a config's "auto" values from the program's own settings, as the Hugging Face Trainer
// does for its DeepSpeed integration: batch sizes from the run's batch and accumulation (any
// given batch key wins and the others follow the batch-size rule), the optimizer's lr, betas,
// eps and weight decay, the schedule's warmup and length, clipping, the precision switches, and
// the bucket sizes from the hidden size (reduce = h^2, prefetch = 0.9 h^2, persistence = 10 h).
// The remaining size keys take DeepSpeed's defaults. Every choice is returned as a line to print.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <zero/config/config.hpp>
#include <zero/core/error.hpp>

namespace zero::config {

/// The program's settings that "auto" values are taken from.
struct AutoValues {
  std::int64_t train_batch_size = 8;         ///< global batch of the run
  std::int64_t gradient_accumulation = 1;    ///< micro-steps per step
  double lr = 1e-3;                          ///< optimizer.params.lr, scheduler's peak
  std::vector<double> betas = {0.9, 0.999};  ///< optimizer.params.betas
  double eps = 1e-8;                         ///< optimizer.params.eps
  double weight_decay = 0.0;                 ///< optimizer.params.weight_decay
  double gradient_clipping = 1.0;            ///< gradient_clipping (HF: max_grad_norm)
  std::int64_t warmup_steps = 0;             ///< scheduler warmup_num_steps
  std::int64_t total_steps = 1;              ///< scheduler total_num_steps
  std::string precision = "fp32";            ///< fp32, bf16 or fp16: fp16/bf16.enabled
  std::int64_t hidden_size = 0;              ///< model width, for the bucket sizes
};

namespace detail {
inline std::string number_text(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
}  // namespace detail

/// Fills every "auto" of c from v for a data-parallel size dp; returns "<key> = <value>" for each
/// choice. ConfigError names an "auto" key the program has no value for, or batch sizes that
/// cannot agree.
inline std::vector<std::string> fill_auto(Config& c, const AutoValues& v, std::int64_t dp) {
  std::vector<std::string> chosen;
  auto is_auto = [&](const std::string& key) {
    return std::find(c.auto_keys.begin(), c.auto_keys.end(), key) != c.auto_keys.end();
  };
  auto say = [&](const std::string& key, const std::string& value) {
    chosen.push_back(key + " = " + value);
  };
  // Batch sizes: a given key wins; an auto accumulation takes the program's, an auto global
  // batch the program's unless the micro-batch is given; the rest follows the batch rule.
  const bool t_auto = is_auto("train_batch_size"),
             m_auto = is_auto("train_micro_batch_size_per_gpu"),
             g_auto = is_auto("gradient_accumulation_steps");
  if (t_auto || m_auto || g_auto) {
    if (g_auto && !(c.train_batch_size && c.train_micro_batch_size_per_gpu)) {
      c.gradient_accumulation_steps = v.gradient_accumulation;
    }
    if (t_auto && !c.train_micro_batch_size_per_gpu) c.train_batch_size = v.train_batch_size;
    if (!c.train_batch_size && !c.train_micro_batch_size_per_gpu) {
      c.train_batch_size = v.train_batch_size;
    }
    const Config::BatchSizes b = c.resolve_batch(dp);
    c.train_batch_size = b.train;
    c.train_micro_batch_size_per_gpu = b.micro;
    c.gradient_accumulation_steps = b.accumulation;
    if (t_auto) say("train_batch_size", std::to_string(b.train));
    if (m_auto) say("train_micro_batch_size_per_gpu", std::to_string(b.micro));
    if (g_auto) say("gradient_accumulation_steps", std::to_string(b.accumulation));
  }
  if (is_auto("gradient_clipping")) {
    c.gradient_clipping = v.gradient_clipping;
    say("gradient_clipping", detail::number_text(v.gradient_clipping));
  }
  expect<ConfigError>(v.precision == "fp32" || v.precision == "bf16" || v.precision == "fp16",
                      "fill_auto: precision '", v.precision, "' is not one of fp32, bf16, fp16");
  if (!c.fp16.enabled) {
    c.fp16.enabled = v.precision == "fp16";
    say("fp16.enabled", *c.fp16.enabled ? "true" : "false");
  }
  if (!c.bf16_enabled) {
    c.bf16_enabled = v.precision == "bf16";
    say("bf16.enabled", *c.bf16_enabled ? "true" : "false");
  }
  expect<ConfigError>(!(*c.fp16.enabled && *c.bf16_enabled),
                      "fp16.enabled and bf16.enabled are both true: choose one precision");
  if (c.optimizer) {
    for (const auto& p : c.optimizer->auto_params) {
      const std::string key = "optimizer.params." + p;
      std::vector<double> value;
      if (p == "lr")
        value = {v.lr};
      else if (p == "betas")
        value = v.betas;
      else if (p == "eps")
        value = {v.eps};
      else if (p == "weight_decay")
        value = {v.weight_decay};
      else
        raise<ConfigError>(key,
                           ": \"auto\" is not filled in by the program (it fills lr, betas, "
                           "eps and weight_decay); give a value");
      c.optimizer->params[p] = value;
      if (p == "betas") c.optimizer->lists.insert(p);
      std::string text;
      for (double x : value) text += (text.empty() ? "" : ", ") + detail::number_text(x);
      say(key, value.size() == 1 ? text : "[" + text + "]");
    }
    c.optimizer->auto_params.clear();
  }
  if (c.scheduler) {
    for (const auto& p : c.scheduler->auto_params) {
      const std::string key = "scheduler.params." + p;
      double value = 0;
      if (p == "warmup_min_lr")
        value = 0.0;
      else if (p == "warmup_max_lr")
        value = v.lr;
      else if (p == "warmup_num_steps")
        value = static_cast<double>(v.warmup_steps);
      else if (p == "total_num_steps")
        value = static_cast<double>(v.total_steps);
      else
        raise<ConfigError>(key,
                           ": \"auto\" is not filled in by the program (it fills "
                           "warmup_min_lr, warmup_max_lr, warmup_num_steps and "
                           "total_num_steps); give a value");
      c.scheduler->params[p] = {value};
      say(key, detail::number_text(value));
    }
    c.scheduler->auto_params.clear();
  }
  auto& z = c.zero_optimization;
  const bool reduce_auto = !z.reduce_bucket_size, prefetch_auto = !z.stage3_prefetch_bucket_size,
             persistence_auto = !z.stage3_param_persistence_threshold;
  if (reduce_auto || prefetch_auto || persistence_auto) {
    expect<ConfigError>(v.hidden_size > 0,
                        "zero_optimization: \"auto\" bucket sizes need the model's hidden size, "
                        "which the program did not give");
    c.resolve_auto_buckets(v.hidden_size);  // HF's rules, in one place
    if (reduce_auto)
      say("zero_optimization.reduce_bucket_size", std::to_string(*z.reduce_bucket_size));
    if (prefetch_auto) {
      say("zero_optimization.stage3_prefetch_bucket_size",
          std::to_string(*z.stage3_prefetch_bucket_size));
    }
    if (persistence_auto) {
      say("zero_optimization.stage3_param_persistence_threshold",
          std::to_string(*z.stage3_param_persistence_threshold));
    }
  }
  for (const char* key : {"allgather_bucket_size", "sub_group_size", "stage3_max_live_parameters",
                          "stage3_max_reuse_distance"}) {
    if (is_auto(std::string("zero_optimization.") + key)) {
      say(std::string("zero_optimization.") + key, "DeepSpeed's default");
    }
  }
  c.auto_keys.clear();
  // Which keys take effect can depend on the filled precision (the fp16 loss-scale block).
  if (c.source.is_object()) {
    nlohmann::json filled = c.source;
    filled["fp16"]["enabled"] = *c.fp16.enabled;
    filled["bf16"]["enabled"] = *c.bf16_enabled;
    c.notices = no_effect_notices(filled);
  }
  return chosen;
}

}  // namespace zero::config
