#pragma once
// The two all-to-alls of DeepSpeed-Ulysses on zero's row layout (rows = (batch, position),
// batch-major; columns = features). A row of `pieces` blocks of C channels (packed q|k|v: 3
// pieces; an attention output: 1) is split over the sp ranks by channel: rank r's share of each
// piece is channels [r*C/sp, (r+1)*C/sp), which are heads [r*nh/sp, (r+1)*nh/sp).
//   sequence_to_heads: [B*T/sp, pieces*C] (this rank's positions, every channel)
//                   -> [B*T, pieces*C/sp] (every position, this rank's channels, pieces packed)
//   heads_to_sequence: the inverse.
// Each is one all-to-all of B*T/sp*pieces*C elements (the whole send buffer, nccl-tests' S) with
// a rearrangement on each side. An all-to-all only permutes elements, so each one's adjoint is
// its inverse: the backward of sequence_to_heads is heads_to_sequence (adding into the input
// gradient) and the other way round, DeepSpeed's "scatter and gather indices swapped". The send
// and receive buffers come from the arena and are released before returning.

#include <cstdint>
#include <cstring>
#include <span>

#include <parallel/comm/any_comm.hpp>
#include <parallel/sequence/sequence_parallel.hpp>
#include <zero/core/arena.hpp>
#include <zero/core/error.hpp>
#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::parallel {

namespace detail {

// Checks the shared shape rules and returns C/sp.
inline std::int64_t channels_per_rank(const SequenceParallel& sp, std::int64_t batch,
                                      std::int64_t local_len, std::int64_t pieces,
                                      std::int64_t channels, const char* what) {
  expect<ShapeError>(batch > 0 && local_len > 0 && pieces > 0 && channels > 0, what,
                     ": batch, local seq_len, pieces and channels must be positive (got ", batch,
                     ", ", local_len, ", ", pieces, ", ", channels, ")");
  expect<ShapeError>(
      channels % sp.size() == 0, what, ": ", channels,
      " channels per piece are not divisible by the sequence-parallel size sp = ", sp.size());
  return channels / sp.size();
}

// One all-to-all of n elements per rank through the arena's scratch: pack(send) fills the send
// buffer (chunk s for rank s), unpack(recv) reads the received one (chunk s from rank s).
template <class T, class Pack, class Unpack>
void all_to_all_through(const SequenceParallel& sp, BumpArena& arena, std::int64_t n, Pack pack,
                        Unpack unpack) {
  const BumpArena::Mark mark = arena.mark();
  Tensor<T> send = arena.allocate<T>({n});
  Tensor<T> recv = arena.allocate<T>({n});
  pack(send.data());
  if (sp.active()) {
    sp.comm().all_to_all(std::span<const T>(send.data(), static_cast<std::size_t>(n)),
                         std::span<T>(recv.data(), static_cast<std::size_t>(n)));
  } else {
    std::memcpy(static_cast<void*>(recv.data()), static_cast<const void*>(send.data()),
                send.bytes());
  }
  unpack(static_cast<const T*>(recv.data()));
  arena.release(mark);
}

}  // namespace detail

/// Sequence split to head split: in [batch*local_len, pieces*channels] holds this rank's
/// local_len = T/sp positions of each sequence; out [batch*T, pieces*channels/sp] receives every
/// position's share of this rank's channels of each piece (see the file comment). Collective
/// over sp.
template <class T>
void sequence_to_heads(const SequenceParallel& sp, BumpArena& arena, const T* in, T* out,
                       std::int64_t batch, std::int64_t local_len, std::int64_t pieces,
                       std::int64_t channels) {
  const std::int64_t S = sp.size(), B = batch, Tl = local_len, C = channels;
  const std::int64_t Cs = detail::channels_per_rank(sp, B, Tl, pieces, C, "sequence_to_heads");
  const std::int64_t W = pieces * Cs, rows = B * Tl;  // a head-split row; rows per chunk
  detail::all_to_all_through<T>(
      sp, arena, rows * pieces * C,
      [&](T* send) {  // chunk s, row (b, tl): rank s's channels of each piece of this row
        ops::cpu::parallel_for(S * rows, [&](std::int64_t i) {
          const std::int64_t s = i / rows, row = i % rows;
          for (std::int64_t j = 0; j < pieces; ++j) {
            std::memcpy(static_cast<void*>(send + i * W + j * Cs),
                        static_cast<const void*>(in + row * pieces * C + j * C + s * Cs),
                        static_cast<std::size_t>(Cs) * sizeof(T));
          }
        });
      },
      [&](const T* recv) {  // chunk s holds rank s's positions [s*Tl, (s+1)*Tl) of every row
        ops::cpu::parallel_for(S * rows, [&](std::int64_t i) {
          const std::int64_t s = i / rows, b = (i % rows) / Tl, tl = i % Tl;
          std::memcpy(static_cast<void*>(out + (b * S * Tl + s * Tl + tl) * W),
                      static_cast<const void*>(recv + i * W),
                      static_cast<std::size_t>(W) * sizeof(T));
        });
      });
}

/// Head split to sequence split, the inverse of sequence_to_heads: in [batch*T,
/// pieces*channels/sp] (T = sp*local_len), out [batch*local_len, pieces*channels]. With
/// accumulate the result is added into out (a backward's input gradient), else written.
/// Collective over sp.
template <class T>
void heads_to_sequence(const SequenceParallel& sp, BumpArena& arena, const T* in, T* out,
                       std::int64_t batch, std::int64_t local_len, std::int64_t pieces,
                       std::int64_t channels, bool accumulate = false) {
  const std::int64_t S = sp.size(), B = batch, Tl = local_len, C = channels;
  const std::int64_t Cs = detail::channels_per_rank(sp, B, Tl, pieces, C, "heads_to_sequence");
  const std::int64_t W = pieces * Cs, rows = B * Tl;
  detail::all_to_all_through<T>(
      sp, arena, rows * pieces * C,
      [&](T* send) {  // chunk s: rank s's positions of every row, this rank's channels
        ops::cpu::parallel_for(S * rows, [&](std::int64_t i) {
          const std::int64_t s = i / rows, b = (i % rows) / Tl, tl = i % Tl;
          std::memcpy(static_cast<void*>(send + i * W),
                      static_cast<const void*>(in + (b * S * Tl + s * Tl + tl) * W),
                      static_cast<std::size_t>(W) * sizeof(T));
        });
      },
      [&](const T* recv) {  // chunk s holds rank s's channels of this rank's positions
        ops::cpu::parallel_for(rows, [&](std::int64_t row) {
          for (std::int64_t s = 0; s < S; ++s) {
            const T* src = recv + (s * rows + row) * W;
            for (std::int64_t j = 0; j < pieces; ++j) {
              T* dst = out + row * pieces * C + j * C + s * Cs;
              for (std::int64_t c = 0; c < Cs; ++c) {
                dst[c] = accumulate ? ops::cpu::store<T>(ops::cpu::load(dst[c]) +
                                                         ops::cpu::load(src[j * Cs + c]))
                                    : src[j * Cs + c];
              }
            }
          }
        });
      });
}

}  // namespace zero::parallel
