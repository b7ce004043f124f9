#pragma once
// Grouped-query attention's key and value heads shared by groups of query heads (Ainslie et al.,
// "GQA", 2023; Llama 2 70B and Llama 3): rows of grouped qkv (Megatron's layout: kv_heads groups,
// each `group` query heads, one key head, one value head, of head_size channels) become the packed
// [q | k | v] rows that CausalSelfAttention reads, every key and value head repeated for each
// query head of its group (Hugging Face's repeat_kv): query head j*group + i is group j's query i,
// and key and value heads j*group + i are group j's key and value. With group 1 this is only a
// reordering of the heads (multi-head attention). The backward copies the queries' gradient and
// sums each key's and value's over the group's heads in head order, so it repeats bit for bit.

#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// The channels of one grouped-qkv row: kv_heads groups of (group + 2) heads of head_size.
inline std::int64_t grouped_qkv_width(std::int64_t kv_heads, std::int64_t group,
                                      std::int64_t head_size) {
  return kv_heads * (group + 2) * head_size;
}

/// out [n, 3 * kv_heads * group * head_size] = inp's n grouped rows as packed qkv, key and value
/// heads repeated over their groups.
template <class T>
void repeat_kv_forward(T* out, const T* inp, std::int64_t n, std::int64_t kv_heads,
                       std::int64_t group, std::int64_t head_size) {
  const std::int64_t hs = head_size, heads = kv_heads * group;
  const std::int64_t in_width = kv_heads * (group + 2) * hs, out_width = 3 * heads * hs;
  parallel_for(n, [&](std::int64_t r) {
    const T* x = inp + r * in_width;
    T* y = out + r * out_width;
    for (std::int64_t j = 0; j < kv_heads; ++j) {
      const T* g = x + j * (group + 2) * hs;  // group j: queries, key, value
      for (std::int64_t i = 0; i < group; ++i) {
        const std::int64_t h = j * group + i;
        for (std::int64_t c = 0; c < hs; ++c) {
          y[h * hs + c] = g[i * hs + c];
          y[(heads + h) * hs + c] = g[group * hs + c];
          y[(2 * heads + h) * hs + c] = g[(group + 1) * hs + c];
        }
      }
    }
  });
}

/// dinp (+=, or = when overwrite) the gradient of repeat_kv_forward given dout: the queries'
/// copied, each key's and value's summed over its group's heads in head order.
template <class T>
void repeat_kv_backward(T* dinp, const T* dout, std::int64_t n, std::int64_t kv_heads,
                        std::int64_t group, std::int64_t head_size, bool overwrite = false) {
  using A = compute_type_t<T>;
  const std::int64_t hs = head_size, heads = kv_heads * group;
  const std::int64_t in_width = kv_heads * (group + 2) * hs, out_width = 3 * heads * hs;
  parallel_for(n, [&](std::int64_t r) {
    T* dx = dinp + r * in_width;
    const T* dy = dout + r * out_width;
    for (std::int64_t j = 0; j < kv_heads; ++j) {
      T* g = dx + j * (group + 2) * hs;
      for (std::int64_t c = 0; c < hs; ++c) {
        for (std::int64_t i = 0; i < group; ++i) {
          const std::int64_t k = i * hs + c;
          g[k] = store<T>((overwrite ? A(0) : load(g[k])) + load(dy[(j * group + i) * hs + c]));
        }
        A dk = overwrite ? A(0) : load(g[group * hs + c]);
        A dv = overwrite ? A(0) : load(g[(group + 1) * hs + c]);
        for (std::int64_t i = 0; i < group; ++i) {
          dk += load(dy[(heads + j * group + i) * hs + c]);
          dv += load(dy[(2 * heads + j * group + i) * hs + c]);
        }
        g[group * hs + c] = store<T>(dk);
        g[(group + 1) * hs + c] = store<T>(dv);
      }
    }
  });
}

}  // namespace zero::ops::cpu
