// [cuda] The CUDA AdamW (optim/cuda/adamw.cuh) against the host AdamW (optim/adam.hpp, scalar
// path), and every optimizer whose passes go through run_fused (AdamW, Adam, SGD, RMSprop,
// Adagrad, Lion) on the GPU's fused executor (optim/cuda/fused_executor.cuh) against the same
// optimizer on the host: several steps over a shard whose size and offsets exercise the
// unaligned head, the 128-bit body and the tail, with fp32, bf16 and f16 gradients and bf16
// (nearest and stochastic) and f16 write-back. Both sides run the same rule with correctly
// rounded operations, so the expected difference is zero; up to 1 ulp is tolerated (and
// reported) so that a compiler surprise shows as a number rather than a flood of failures.
//
// Exit codes: 0 pass, 1 fail, 77 no GPU (CTest SKIP_RETURN_CODE).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <optim/adagrad.hpp>
#include <optim/adam.hpp>
#include <optim/cuda/adamw.cuh>
#include <optim/cuda/fused_executor.cuh>
#include <optim/lion.hpp>
#include <optim/rmsprop.hpp>
#include <optim/sgd.hpp>

#include "device_presence.hpp"

namespace {

using namespace zero::optim;
using zero::bf16;
using zero::DType;
using zero::f16;

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what);
    ++failures;
  }
}

// Distance in units in the last place between two floats (0 for two NaNs).
std::int64_t ulp_distance(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return 0;
  auto key = [](float x) {
    std::int32_t i;
    std::memcpy(&i, &x, 4);
    return i < 0 ? static_cast<std::int64_t>(INT32_MIN) - i : static_cast<std::int64_t>(i);
  };
  const std::int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

std::int64_t ulp_distance16(std::uint16_t a, std::uint16_t b) {
  // Same-sign 16-bit floats order like integers; NaNs compare equal.
  auto nan = [](std::uint16_t x, bool bf) {
    return bf ? (x & 0x7fffu) > 0x7f80u : (x & 0x7fffu) > 0x7c00u;
  };
  if (nan(a, true) && nan(b, true)) return 0;
  return std::abs(static_cast<int>(a) - static_cast<int>(b));
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  ZERO_CUDA_CHECK(cudaMalloc(&d, host.size() * sizeof(T) + 64));
  ZERO_CUDA_CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> out(n);
  ZERO_CUDA_CHECK(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<float> data(std::size_t n, std::uint64_t seed, double scale) {
  zero::CounterRng rng(seed);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(scale * rng.normal(i));
    if (i % 29 == 5) out[i] = 0.0f;
    if (i % 31 == 7) out[i] = 2e-40f;  // denormal
  }
  return out;
}

// The distances of a comparison: the worst, and how many were not 0.
struct UlpTally {
  std::int64_t worst = 0, inexact = 0;
  void add(std::int64_t d) {
    worst = d > worst ? d : worst;
    inexact += d != 0;
  }
};

// The gradient of one step: total elements of dtype (from the same fp32 draw), on the host and on
// the device.
struct StepGrad {
  std::vector<unsigned char> host;
  void* device = nullptr;
  std::size_t element_bytes;

  StepGrad(std::size_t total, int step, DType dtype) : element_bytes(dtype == DType::f32 ? 4 : 2) {
    const auto g32 = data(total, 100 + step, 3.0);
    host.resize(total * element_bytes);
    for (std::size_t i = 0; i < total; ++i) {
      unsigned char* at = host.data() + i * element_bytes;
      if (dtype == DType::bf16) {
        const bf16 b(g32[i]);
        std::memcpy(at, &b, 2);
      } else if (dtype == DType::f16) {
        const f16 h(g32[i]);
        std::memcpy(at, &h, 2);
      } else {
        std::memcpy(at, &g32[i], 4);
      }
    }
    ZERO_CUDA_CHECK(cudaMalloc(&device, host.size()));
    ZERO_CUDA_CHECK(cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  StepGrad(const StepGrad&) = delete;
  StepGrad& operator=(const StepGrad&) = delete;
  ~StepGrad() { cudaFree(device); }
  const void* host_at(std::size_t offset) const { return host.data() + offset * element_bytes; }
  const void* device_at(std::size_t offset) const {
    return static_cast<const char*>(device) + offset * element_bytes;
  }
};

// A step over n elements starting at global index offset; write_back 0 none, 1 bf16 nearest,
// 2 bf16 stochastic (key), 3 f16 (pointers are the caller's).
FusedIo step_io(std::size_t n, DType grad_dtype, float scale, std::size_t offset, std::uint64_t key,
                int write_back) {
  FusedIo io;
  io.numel = n;
  io.grad_dtype = grad_dtype;
  io.grad_scale = scale;
  io.first_index = offset;
  io.rounding_key = key;
  io.lowp_dtype = write_back == 3 ? DType::f16 : DType::bf16;
  io.rounding = write_back == 2 ? Rounding::stochastic : Rounding::nearest_even;
  return io;
}

// io pointed at one side's parameters, gradient and low-precision copy (null: none).
FusedIo with_buffers(FusedIo io, float* param, const void* grad, std::uint16_t* lowp) {
  io.param = param;
  io.grad = grad;
  io.lowp = lowp;
  return io;
}

// One comparison: grad dtype, write-back kind, shard offset (for alignment) and size.
void run_case(DType grad_dtype, int write_back, std::size_t offset, std::size_t n) {
  const std::size_t total = offset + n;
  const AdamHyper hyper{1e-2, 0.9, 0.999, 1e-8, 0.1};
  // Two groups: decay on the first part, none on the rest (biases).
  AdamHyper no_decay = hyper;
  no_decay.weight_decay = 0.0;
  const std::size_t split = n / 3;
  std::vector<ParamGroup<AdamHyper>> groups{{{0, split}, hyper}, {{split, n - split}, no_decay}};

  AdamW host(n, groups);
  cuda::CudaAdamW device(n, groups);

  std::vector<float> p_host = data(total, 1, 1.0);
  float* p_dev_base = to_device(p_host);
  float* p_dev = p_dev_base + offset;
  std::vector<std::uint16_t> low_host(total, 0);
  std::uint16_t* low_dev_base = to_device(low_host);

  for (int step = 1; step <= 4; ++step) {
    const StepGrad grad(total, step, grad_dtype);
    const FusedIo io = step_io(n, grad_dtype, 0.125f, offset, 77, write_back);

    const FusedIo hio = with_buffers(io, p_host.data() + offset, grad.host_at(offset),
                                     write_back == 0 ? nullptr : low_host.data() + offset);
    host.step(hio, StepOptions{Isa::scalar, 1});

    const FusedIo dio = with_buffers(io, p_dev, grad.device_at(offset),
                                     write_back == 0 ? nullptr : low_dev_base + offset);
    device.step(dio);
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
  }

  const auto p_back = to_host(p_dev, n);
  const auto low_back = to_host(low_dev_base + offset, n);
  const auto dev_state = device.state_dict();
  UlpTally tally;
  for (std::size_t i = 0; i < n; ++i) {
    tally.add(ulp_distance(p_back[i], p_host[offset + i]));
    tally.add(ulp_distance(dev_state.buffers.at("exp_avg")[i], host.state("exp_avg")[i]));
    tally.add(ulp_distance(dev_state.buffers.at("exp_avg_sq")[i], host.state("exp_avg_sq")[i]));
    if (write_back != 0) tally.add(ulp_distance16(low_back[i], low_host[offset + i]));
  }
  std::printf("grad %s write-back %d offset %zu n %zu: %lld inexact values, worst %lld ulp\n",
              std::string(zero::name_of(grad_dtype)).c_str(), write_back, offset, n,
              static_cast<long long>(tally.inexact), static_cast<long long>(tally.worst));
  check(tally.worst <= 1, "CUDA AdamW within 1 ulp of the host AdamW");
  check(device.step_count() == host.step_count(), "step counters agree");
  ZERO_CUDA_CHECK(cudaFree(p_dev_base));
  ZERO_CUDA_CHECK(cudaFree(low_dev_base));
}

// One optimizer of optim/ stepped on the host and, its states moved to device memory, on the
// GPU's executor (what the engine does on a device): params, states and write-back compared.
template <class Opt, class Make>
void run_executor_case(const char* name, const Make& make, DType grad_dtype, int write_back,
                       std::size_t offset, std::size_t n) {
  const std::size_t total = offset + n;
  Opt host = make(n);
  Opt device = make(n);
  // The same non-trivial starting states on both sides, the device's in device memory.
  std::vector<float*> dev_states;
  std::vector<std::span<float>> bound;
  std::uint64_t seed = 40;
  std::vector<float> square_avg;
  for (const auto& s : host.state_names()) {
    std::vector<float> init = data(n, ++seed, 0.1);
    for (float& x : init) x = s == "exp_avg_sq" || s == "square_avg" || s == "sum" ? x * x : x;
    if (s == "square_avg") square_avg = init;
    // Centered RMSprop's variance square_avg - grad_avg^2 must stay >= 0, as it does in training
    // (a mean of squares is never below the square of the mean): a negative one makes sqrt's NaN,
    // whose sign and payload differ between x86 and the GPU.
    if (s == "grad_avg") {
      for (std::size_t i = 0; i < n; ++i) {
        init[i] = std::copysign(0.5f * std::sqrt(square_avg[i]), init[i]);
      }
    }
    std::copy(init.begin(), init.end(), host.state(s).begin());
    dev_states.push_back(to_device(init));
    bound.emplace_back(dev_states.back(), n);
  }
  device.release_state_storage();
  device.bind_state(std::span<const std::span<float>>(bound));
  cuda::CudaFusedExecutor executor;
  StepOptions on_device;
  on_device.executor = &executor;

  std::vector<float> p_host = data(total, 1, 1.0);
  float* p_dev_base = to_device(p_host);
  std::vector<std::uint16_t> low_host(total, 0);
  std::uint16_t* low_dev_base = to_device(low_host);
  for (int step = 1; step <= 3; ++step) {
    const StepGrad grad(total, step, grad_dtype);
    const FusedIo io = step_io(n, grad_dtype, step == 2 ? 1e-3f : 0.25f, offset, 91, write_back);
    const FusedIo hio = with_buffers(io, p_host.data() + offset, grad.host_at(offset),
                                     write_back == 0 ? nullptr : low_host.data() + offset);
    host.step(hio, StepOptions{Isa::scalar, 1});
    const FusedIo dio = with_buffers(io, p_dev_base + offset, grad.device_at(offset),
                                     write_back == 0 ? nullptr : low_dev_base + offset);
    device.step(dio, on_device);
    ZERO_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const auto p_back = to_host(p_dev_base + offset, n);
  const auto low_back = to_host(low_dev_base + offset, n);
  UlpTally tally;
  std::size_t nonfinite = 0;
  for (std::size_t i = 0; i < n; ++i) {
    tally.add(ulp_distance(p_back[i], p_host[offset + i]));
    if (write_back != 0) tally.add(ulp_distance16(low_back[i], low_host[offset + i]));
    nonfinite += std::isfinite(p_host[offset + i]) ? 0 : 1;
  }
  check(nonfinite == 0, "the host's parameters stay finite (a comparison of NaNs shows nothing)");
  for (std::size_t k = 0; k < dev_states.size(); ++k) {
    const auto st = to_host(dev_states[k], n);
    const auto want = host.state(host.state_names()[k]);
    for (std::size_t i = 0; i < n; ++i) tally.add(ulp_distance(st[i], want[i]));
    ZERO_CUDA_CHECK(cudaFree(dev_states[k]));
  }
  std::printf(
      "%s on the executor, grad %s write-back %d offset %zu n %zu: %lld inexact, worst "
      "%lld ulp\n",
      name, std::string(zero::name_of(grad_dtype)).c_str(), write_back, offset, n,
      static_cast<long long>(tally.inexact), static_cast<long long>(tally.worst));
  check(tally.worst <= 1, "the executor's pass within 1 ulp of the host's");
  check(device.step_count() == host.step_count(), "step counters agree");
  ZERO_CUDA_CHECK(cudaFree(p_dev_base));
  ZERO_CUDA_CHECK(cudaFree(low_dev_base));
}

// Every optimizer with a device pass, at each gradient type and write-back.
void run_executor_cases() {
  const auto each = [](const char* name, auto make) {
    using Opt = decltype(make(std::size_t{1}));
    for (DType gt : {DType::f32, DType::bf16, DType::f16}) {
      for (int wb : {0, 2, 3}) {
        run_executor_case<Opt>(name, make, gt, wb, 0, 40003);
        run_executor_case<Opt>(name, make, gt, wb, 1, 1029);
      }
    }
  };
  const auto two_groups = [](std::size_t n, auto hyper) {
    auto no_decay = hyper;
    no_decay.weight_decay = 0.0;
    using H = decltype(hyper);
    return std::vector<ParamGroup<H>>{{{0, n / 3}, hyper}, {{n / 3, n - n / 3}, no_decay}};
  };
  each("AdamW", [&](std::size_t n) {
    return AdamW(n, two_groups(n, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1}));
  });
  each("Adam", [](std::size_t n) { return Adam(n, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1}); });
  each("SGD Nesterov", [](std::size_t n) {
    return Sgd(n, SgdHyper{0.1, 0.01}, SgdOptions{0.9, 0.0, true});
  });
  each("SGD", [](std::size_t n) { return Sgd(n, SgdHyper{0.1, 0.01}); });
  each("RMSprop centered momentum", [](std::size_t n) {
    return Rmsprop(n, RmspropHyper{1e-2, 0.99, 1e-8, 0.01}, RmspropOptions{0.9, true});
  });
  each("RMSprop", [](std::size_t n) { return Rmsprop(n); });
  each("Adagrad", [](std::size_t n) { return Adagrad(n, AdagradHyper{0.1, 0.01, 1e-10, 0.01}); });
  each("Lion", [](std::size_t n) { return Lion(n, LionHyper{1e-3, 0.9, 0.99, 0.1}); });
}

}  // namespace

int main() {
  std::string why;
  int devices = 0;
  const auto presence = zero::test::cuda_presence(why, devices);
  if (presence == zero::test::CudaPresence::none) {
    std::printf("test_optim_cuda: no CUDA device found; skipping\n");
    return 77;
  }
  if (presence == zero::test::CudaPresence::broken) {
    std::printf("test_optim_cuda: a CUDA driver is installed but unusable (%s)\n", why.c_str());
    return 1;
  }
  try {
    for (DType gt : {DType::f32, DType::bf16, DType::f16}) {
      for (int wb : {0, 1, 2, 3}) {
        run_case(gt, wb, 0, 100003);  // aligned start, a tail
        run_case(gt, wb, 3, 4099);    // unaligned head
      }
    }
    run_executor_cases();
    // Negative control: a host step with a different lr must be visibly different, or the
    // comparison above could not fail.
    {
      const std::size_t n = 1024;
      std::vector<float> a = data(n, 1, 1.0), b = a, g = data(n, 2, 1.0);
      AdamW x(n, AdamHyper{1e-2, 0.9, 0.999, 1e-8, 0.1}),
          y(n, AdamHyper{1.1e-2, 0.9, 0.999, 1e-8, 0.1});
      x.step(FusedIo::over<float>(a, g));
      y.step(FusedIo::over<float>(b, g));
      UlpTally tally;
      for (std::size_t i = 0; i < n; ++i) tally.add(ulp_distance(a[i], b[i]));
      check(tally.worst > 1, "negative control: a 10% lr change exceeds the 1-ulp bound");
    }
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  std::printf(failures == 0 ? "test_optim_cuda: all checks passed\n"
                            : "test_optim_cuda: %d check(s) failed\n",
              failures);
  return failures == 0 ? 0 : 1;
}
