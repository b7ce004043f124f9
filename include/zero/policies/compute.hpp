#pragma once
// Compute<Device>: where the units run their kernels. Host (this header's default) needs
// nothing else; Cuda is defined in zero/core/cuda_device.cuh, which only nvcc sees, so it is
// declared here and used as a tag only.

#include <zero/core/device.hpp>

namespace zero {

struct Cuda;  // zero/core/cuda_device.cuh

/// Tag that every Compute<Device> carries, so policy lookup can find it.
struct compute_policy {};

/// Policy tag selecting the device that computes (Host or Cuda).
template <class Device>
struct Compute {
  using kind = compute_policy;
  using device = Device;  ///< Host or Cuda
};

}  // namespace zero
