// Kill one rank of four, then resume at three (run by kill_rank_resume.cmake under mpiexec).
//
//   kill_rank_resume kill <dir>    4 ranks: stage-3 f64 SGD on the tiny GPT (accumulation 3),
//                                  checkpoint after step 2; in step 3 rank 3 SIGKILLs itself.
//                                  Each survivor must get a CommError naming world rank 3
//                                  within the deadline, and the engine must then refuse to go
//                                  on with that error. Survivors write <dir>/survivor_<r>.txt
//                                  ("ok ..." or "FAIL ..."), wait until all three files exist,
//                                  and leave with _Exit (MPI_Finalize would wait for the dead
//                                  rank).
//   kill_rank_resume resume <dir>  3 ranks (accumulation 4: the same 24-row global batch):
//                                  load the step-2 checkpoint, train steps 2..5 and, after each,
//                                  equal the uninterrupted single-process run (1e-10), with a
//                                  wrong-learning-rate negative control. Exit code: worst rank.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <parallel/comm/mpi_comm.hpp>

#include "../support/worse.hpp"
#include "engine_test_util.hpp"

using namespace zero;
using namespace zero::test;

namespace {

constexpr std::int64_t global_rows = 24;  // 12 micro-batches of 2 rows: 4x3 and 3x4
constexpr int checkpoint_after = 2;       // steps done when the checkpoint is saved
constexpr int steps_total = 6;
constexpr double timeout_s = 2.0;

using Eng = engine::Engine<nn::GPT<double>, ZeroStage<3>>;

Eng make_engine(nn::GPT<double>& model, parallel::MpiComm& comm) {
  engine::EngineOptions options;
  options.gradient_accumulation_steps = static_cast<int>(12 / comm.size());
  options.activation_bytes = 32 << 20;
  options.persistence_threshold = 0;
  options.prefetch_elems = 1;
  return Eng(
      model, comm, [](int, std::span<double> p, std::span<const double> g) { sgd(1.0, p, g); },
      options);
}

// One optimizer step (every micro-step of the window) of global step `step`.
void train_step(Eng& eng, parallel::MpiComm& comm, int step, int kill_rank = -1) {
  const GlobalBatch b(global_rows, step, tiny().vocab_size);
  const int accumulation = static_cast<int>(12 / comm.size());
  for (int m = 0; m < accumulation; ++m) {
    // The victim dies between micro-steps: its last collectives are done, the next are not.
    if (comm.rank() == kill_rank && m == 1) raise(SIGKILL);
    eng.forward(b.micro(m, comm.rank(), comm.size()));
    eng.backward();
  }
  eng.step();
}

double max_error(Eng& eng, const std::vector<std::vector<double>>& want) {
  double w = 0;
  for (int u = 0; u < eng.num_units(); ++u) {
    const auto got = eng.gather_unit_values(u);
    const auto& ref = want[static_cast<std::size_t>(u)];
    if (got.size() != ref.size()) return 1e300;
    for (std::size_t i = 0; i < got.size(); ++i)
      w = zero::testing::worse(w, std::fabs(got[i] - ref[i]));
  }
  return w;
}

int kill_phase(parallel::MpiComm& world, const std::filesystem::path& dir) {
  nn::GPT<double> model(tiny());
  Eng eng = make_engine(model, world);
  for (int step = 0; step < checkpoint_after; ++step) train_step(eng, world, step);
  eng.save_checkpoint(dir / "ckpt", "step" + std::to_string(checkpoint_after));
  std::string verdict = "FAIL: no CommError", error;
  double elapsed_s = 0;
  auto start = std::chrono::steady_clock::now();
  try {
    start = std::chrono::steady_clock::now();
    train_step(eng, world, checkpoint_after, /*kill_rank=*/3);
    verdict = "FAIL: step " + std::to_string(checkpoint_after) + " completed without rank 3";
  } catch (const CommError& e) {
    error = e.what();
    elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The wait that fails started at most one micro-step after `start`; the census adds at
    // most its grace (0.4 s here). Bound generously for a loaded machine.
    if (error.find("(world ranks [3]) never joined") == std::string::npos) {
      verdict = "FAIL: the error does not name world rank 3 as never joined";
    } else if (elapsed_s > 4 * timeout_s + 5) {
      verdict = "FAIL: took " + std::to_string(elapsed_s) + " s";
    } else {
      verdict = "ok";
    }
  }
  if (verdict == "ok") {
    // The engine refuses to go on with the first error, at once.
    const GlobalBatch b(global_rows, checkpoint_after, tiny().vocab_size);
    const auto again = std::chrono::steady_clock::now();
    try {
      eng.forward(b.micro(0, world.rank(), world.size()));
      verdict = "FAIL: forward after the failure was not refused";
    } catch (const CommError& e) {
      const std::string refused = e.what();
      if (refused.rfind("Engine::forward: refused", 0) != 0 ||
          refused.find(error) == std::string::npos) {
        verdict = "FAIL: unexpected refusal: " + refused;
      } else if (std::chrono::duration<double>(std::chrono::steady_clock::now() - again).count() >
                 1.0) {
        verdict = "FAIL: the refusal waited";
      }
    }
  }
  const auto survivor_file = [&](int r) {
    return dir / ("survivor_" + std::to_string(r) + ".txt");
  };
  {
    // Written under another name and renamed, so a survivor polling below never sees half a file.
    const auto partial = dir / ("survivor_" + std::to_string(world.rank()) + ".partial");
    std::ofstream(partial) << verdict << "\nelapsed_s " << elapsed_s << "\nerror " << error << "\n";
    std::filesystem::rename(partial, survivor_file(world.rank()));
  }
  std::cout << "rank " << world.rank() << ": " << verdict << " after " << elapsed_s
            << " s: " << error << std::endl;
  // A file barrier among the survivors (a collective would wait for the dead rank): Open MPI
  // kills the whole job as soon as one process leaves without MPI_Finalize, so a survivor that
  // left first would kill one still detecting the failure. Give up after 60 s; the script then
  // reports the rank that wrote nothing.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int r = 0; r < 3 && std::chrono::steady_clock::now() < deadline;) {
    if (std::filesystem::exists(survivor_file(r))) {
      ++r;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::_Exit(0);  // MPI_Finalize would wait for the dead rank
}

int resume_phase(parallel::MpiComm& world, const std::filesystem::path& dir) {
  nn::GPT<double> model(tiny());
  Eng eng = make_engine(model, world);
  eng.load_checkpoint(dir / "ckpt");
  int failures = 0;
  auto fail = [&](const std::string& what) {
    ++failures;
    std::cout << "rank " << world.rank() << ": FAIL: " << what << std::endl;
  };
  if (eng.steps() != checkpoint_after) fail("loaded step " + std::to_string(eng.steps()));
  for (int step = checkpoint_after; step < steps_total; ++step) {
    train_step(eng, world, step);
    const double err = max_error(eng, reference_sgd(global_rows, step + 1, 1.0));
    if (world.rank() == 0) std::cout << "step " << step << ": max error " << err << std::endl;
    if (!(err < 1e-10)) fail("step " + std::to_string(step) + " differs by " + std::to_string(err));
  }
  // Negative control: a different trajectory (lr 0.5) is told apart.
  const double wrong = max_error(eng, reference_sgd(global_rows, steps_total, 0.5));
  if (!(wrong > 1e-3)) fail("the lr-0.5 reference is within " + std::to_string(wrong));
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  auto world = parallel::MpiComm::world(argc, argv, parallel::CommOptions{.timeout_s = timeout_s});
  if (argc != 3) {
    std::cerr << "usage: kill_rank_resume kill|resume <dir>\n";
    return 2;
  }
  const std::string phase = argv[1];
  const std::filesystem::path dir = argv[2];
  int failures = 0;
  try {
    failures = phase == "kill" ? kill_phase(world, dir) : resume_phase(world, dir);
  } catch (const std::exception& e) {
    std::cout << "rank " << world.rank() << ": FAIL: " << e.what() << std::endl;
    failures = 1;
  }
  int worst = failures;
  MPI_Allreduce(&failures, &worst, 1, MPI_INT, MPI_MAX, world.native_handle());
  return worst == 0 ? 0 : 1;
}
