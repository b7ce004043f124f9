#pragma once
// check_resumes: the checkpoint test every parallel layout runs. A run saves after 2 steps at
// one layout; resumed at the same layout for 2 more steps it equals the 4 steps never
// interrupted exactly, and resumed at each other layout it equals them up to f32 rounding (other
// reduction orders; a lost slice or optimizer state is far larger).
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "tp_test_util.hpp"

namespace zero::test {

/// run(layout, first_step, steps, load, save) trains `steps` steps from first_step at layout
/// (loading `load` first, saving to `save` at the end, when given) and returns the parameters
/// assembled over its ranks; describe(layout) names a layout in the failure messages. name
/// makes the checkpoint folder's name (under the temporary directory, removed after).
template <class Layout, class Run, class Describe>
void check_resumes(const std::string& name, const Layout& from, const std::vector<Layout>& to,
                   Run run, Describe describe) {
  const auto dir = std::filesystem::temp_directory_path() /
                   (name + "-" + std::to_string(static_cast<long>(::getpid())));
  std::filesystem::remove_all(dir);
  const std::filesystem::path none;
  const LogicalValues saved = run(from, 0, 2, none, dir);
  const LogicalValues straight = run(from, 0, 4, none, none);  // never interrupted
  const LogicalValues continued = run(from, 2, 2, dir, none);
  INFO("saved at " << describe(from));
  // The same layout resumes exactly (every state it saved came back).
  CHECK(max_difference(continued, straight) == 0.0);
  CHECK(max_difference(continued, saved) > 1e-4);  // the resumed steps did train
  for (const Layout& l : to) {
    INFO("resumed at " << describe(l));
    CHECK(max_difference(run(l, 2, 2, dir, none), continued) <= 2e-5);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace zero::test
