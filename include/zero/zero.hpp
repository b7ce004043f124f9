#pragma once
// Umbrella header: everything in zero that compiles without nvcc.

#include <zero/core/arena.hpp>
#include <zero/core/buffer.hpp>
#include <zero/core/device.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/rng.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>
#include <zero/version.hpp>
