#pragma once
// AdamW (Loshchilov & Hutter 2019) is Adam with decoupled weight decay; both share one kernel and
// live in adam.hpp. This header exists so `#include <optim/adamw.hpp>` works as users expect.

#include <optim/adam.hpp>
