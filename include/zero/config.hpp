#pragma once
// The DeepSpeed-compatible training config (see zero/config/config.hpp).
#include <zero/config/config.hpp>
