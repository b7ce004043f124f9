#pragma once
// Grouped-query attention's key and value heads shared by groups of query heads (Ainslie et al.,
// "GQA", 2023; Llama 2 70B and Llama 3): rows of grouped qkv (Megatron's layout: kv_heads groups,
// each `group` query heads, one key head, one value head, of head_size channels) become the packed
// [q | k | v] rows that CausalSelfAttention reads, every key and value head repeated for each
// query head of its group (Hugging Face's repeat_kv): query head j*group + i is group j's query i,
// and key and value heads j*group + i are group j's key and value. With group 1 this is only a
// reordering of the heads (multi-head attention). The backward copies the queries' gradient and
// sums each key's and value's over the group's heads in head order, so it repeats bit for bit.

#include <algorithm>
#include <cstdint>

#include <zero/ops/cpu/element_access.hpp>
#include <zero/ops/cpu/isa_dispatch.hpp>
#include <zero/ops/cpu/parallel_for.hpp>

namespace zero::ops::cpu {

/// The channels of one grouped-qkv row: kv_heads groups of (group + 2) heads of head_size.
inline std::int64_t grouped_qkv_width(std::int64_t kv_heads, std::int64_t group,
                                      std::int64_t head_size) {
  return kv_heads * (group + 2) * head_size;
}

namespace grouped_qkv_detail {

// g's channels [c, c + lanes) of group j's heads (+)= their gradients in dy (a packed qkv row):
// each query's copied, the key's and the value's summed over the group's heads in head order.
template <class O, class T>
inline void repeat_kv_backward_at(T* g, const T* dy, std::int64_t j, std::int64_t group,
                                  std::int64_t heads, std::int64_t hs, bool overwrite,
                                  std::int64_t c) {
  const auto zero = O::set1(0.0f);
  for (std::int64_t i = 0; i < group; ++i) {
    T* q = g + i * hs + c;
    store_lanes<O>(q, O::add(overwrite ? zero : load_lanes<O>(q),
                             load_lanes<O>(dy + (j * group + i) * hs + c)));
  }
  T* k = g + group * hs + c;
  T* v = k + hs;
  auto dk = overwrite ? zero : load_lanes<O>(k);
  auto dv = overwrite ? zero : load_lanes<O>(v);
  for (std::int64_t i = 0; i < group; ++i) {
    dk = O::add(dk, load_lanes<O>(dy + (heads + j * group + i) * hs + c));
    dv = O::add(dv, load_lanes<O>(dy + (2 * heads + j * group + i) * hs + c));
  }
  store_lanes<O>(k, dk);
  store_lanes<O>(v, dv);
}

// The rows [r0, r1) of repeat_kv_backward, vectorised along each head's channels (the sums keep
// the scalar loop's order, so every path gives its bits).
struct RepeatKvBackward {
  template <class O, class T>
  static void run(T* dinp, const T* dout, std::int64_t kv_heads, std::int64_t group,
                  std::int64_t hs, bool overwrite, std::int64_t r0, std::int64_t r1) {
    const std::int64_t heads = kv_heads * group;
    const std::int64_t in_width = kv_heads * (group + 2) * hs, out_width = 3 * heads * hs;
    for (std::int64_t r = r0; r < r1; ++r) {
      T* dx = dinp + r * in_width;
      const T* dy = dout + r * out_width;
      for (std::int64_t j = 0; j < kv_heads; ++j) {
        T* g = dx + j * (group + 2) * hs;
        std::int64_t c = 0;
        for (; c + O::width <= hs; c += O::width) {
          repeat_kv_backward_at<O>(g, dy, j, group, heads, hs, overwrite, c);
        }
        for (; c < hs; ++c) {
          repeat_kv_backward_at<optim::ScalarHostOps>(g, dy, j, group, heads, hs, overwrite, c);
        }
      }
    }
  }
};

}  // namespace grouped_qkv_detail

/// out [n, 3 * kv_heads * group * head_size] = inp's n grouped rows as packed qkv, key and value
/// heads repeated over their groups (copies of whole heads, rows in parallel).
template <class T>
void repeat_kv_forward(T* out, const T* inp, std::int64_t n, std::int64_t kv_heads,
                       std::int64_t group, std::int64_t head_size) {
  const std::int64_t hs = head_size, heads = kv_heads * group;
  const std::int64_t in_width = kv_heads * (group + 2) * hs, out_width = 3 * heads * hs;
  parallel_chunks(n, rows_per_task(out_width), n * out_width,
                  [&](std::int64_t r0, std::int64_t r1) {
                    for (std::int64_t r = r0; r < r1; ++r) {
                      const T* x = inp + r * in_width;
                      T* y = out + r * out_width;
                      for (std::int64_t j = 0; j < kv_heads; ++j) {
                        const T* g = x + j * (group + 2) * hs;  // group j: queries, key, value
                        for (std::int64_t i = 0; i < group; ++i) {
                          const std::int64_t h = j * group + i;
                          std::copy_n(g + i * hs, hs, y + h * hs);
                          std::copy_n(g + group * hs, hs, y + (heads + h) * hs);
                          std::copy_n(g + (group + 1) * hs, hs, y + (2 * heads + h) * hs);
                        }
                      }
                    }
                  });
}

/// dinp (+=, or = when overwrite) the gradient of repeat_kv_forward given dout: the queries'
/// copied, each key's and value's summed over its group's heads in head order. float, bf16 and
/// f16 run the dispatched kernel (isa_dispatch.hpp), the same bits as the plain loop double
/// runs.
template <class T>
void repeat_kv_backward(T* dinp, const T* dout, std::int64_t n, std::int64_t kv_heads,
                        std::int64_t group, std::int64_t head_size, bool overwrite = false) {
  using A = compute_type_t<T>;
  const std::int64_t hs = head_size, heads = kv_heads * group;
  const std::int64_t in_width = kv_heads * (group + 2) * hs, out_width = 3 * heads * hs;
  if constexpr (dispatched_type<T>) {
    const auto kernel = kernel_for<grouped_qkv_detail::RepeatKvBackward, T*, const T*, std::int64_t,
                                   std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t>();
    parallel_chunks(n, rows_per_task(out_width), n * out_width,
                    [&](std::int64_t r0, std::int64_t r1) {
                      kernel(dinp, dout, kv_heads, group, hs, overwrite, r0, r1);
                    });
    return;
  }
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
