#pragma once
// Causal attention in tiles, shared by the host tests and the CUDA kernels: which tiles of the
// score matrix need the causal mask at all, and the order that starts the most work first.
//
// Entry (row, key) of a length-Tn sequence is visible when key <= row and both are below Tn.
// A tile of rows [row_first, row_first + rows) by keys [key_first, key_first + keys) is whole when
// every entry is visible: its last key is at most its first row and its last row is below Tn.
// Flash kernels skip the per-entry checks (index arithmetic, compares, selects on every score)
// on whole tiles, which are all but the diagonal ones; the results do not change.

#include <zero/core/macros.hpp>

namespace zero::ops {

/// True when every entry of the tile is visible under the causal mask of a length-Tn sequence.
/// False for an empty tile (rows or keys 0) and for any tile that reaches row Tn.
ZERO_HOST_DEVICE constexpr bool causal_tile_whole(int row_first, int rows, int key_first, int keys,
                                                  int Tn) {
  return rows > 0 && keys > 0 && key_first >= 0 && key_first + keys - 1 <= row_first &&
         row_first + rows <= Tn;
}

/// The tile a block takes when blocks start in order (index 0 first) and a tile of rows visits
/// the key tiles up to its own: the last row tile (the most key tiles) first. Longest-processing-
/// time order, so the light tiles fill the end of the launch instead of a heavy one running alone.
/// (A block's work is the tiles it visits; a partial last tile costs as much as a full one.)
ZERO_HOST_DEVICE constexpr int causal_row_tile_in_work_order(int index, int tiles) {
  return tiles - 1 - index;
}

/// The same for tiles of keys, each visiting the row tiles from its own on: the first first.
ZERO_HOST_DEVICE constexpr int causal_key_tile_in_work_order(int index, int /*tiles*/) {
  return index;
}

}  // namespace zero::ops
