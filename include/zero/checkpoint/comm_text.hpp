#pragma once
// The communicators save and load take: they agree through the text collectives
// (parallel/comm/text_collectives.hpp), every rank's report gathered everywhere and rank 0's
// decision broadcast, so all ranks reach success or the same error and none is left waiting in
// a collective another rank skipped.

#include <parallel/comm/text_collectives.hpp>

namespace zero::checkpoint {

/// A communicator save and load can use: any parallel::TextComm (every Communicator, and the
/// engine's type-erased parallel::AnyComm).
template <class C>
concept CheckpointComm = parallel::TextComm<C>;

}  // namespace zero::checkpoint
