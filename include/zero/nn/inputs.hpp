#pragma once
// Inputs: the named host tensors of one micro-batch (features, labels, masks, images) beside the
// tokens a language model reads. Entries are non-owning views tagged with their element type at
// run time, so one micro-batch type carries any mix of dtypes through the engine, and a unit asks
// for a tensor by name and type: a wrong name or type is an InputError that says which tensor,
// what was asked for and what is there, instead of reinterpreting bytes.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>
#include <zero/core/shape.hpp>
#include <zero/core/tensor.hpp>

namespace zero::nn {

/// A micro-batch's input was missing, or had another element type or shape than a unit expects.
class InputError : public Error {
 public:
  using Error::Error;
};

/// One named input: a view, its element type and the device its memory is on.
struct InputTensor {
  std::string name;                      ///< the name units look it up by, e.g. "features"
  const void* data = nullptr;            ///< first element
  Shape shape;                           ///< row-major extents; dimension 0 is the row (sample)
  DType dtype = DType::f32;              ///< element type of data
  DeviceKind device = DeviceKind::host;  ///< where data lives (layers check it against the pass)
};

/// The named input tensors of one micro-batch (views; the owner keeps the memory alive for the
/// micro-step).
class Inputs {
 public:
  /// Adds (or replaces) the tensor name; returns *this so inputs chain.
  template <class U>
  Inputs& set(std::string name, Tensor<const U> tensor) {
    static_assert(!std::is_same_v<U, bool>, "Inputs: store masks as std::uint8_t, not bool");
    return set_raw(std::move(name), tensor.data(), tensor.shape(), dtype_of<std::remove_cv_t<U>>,
                   tensor.device());
  }
  /// Adds (or replaces) an entry typed at run time (loaders that hold arrays of any dtype).
  Inputs& set_raw(std::string name, const void* data, Shape shape, DType dtype,
                  DeviceKind device = DeviceKind::host) {
    InputTensor entry{std::move(name), data, shape, dtype, device};
    if (InputTensor* old = find_mutable(entry.name)) {
      *old = std::move(entry);
    } else {
      entries_.push_back(std::move(entry));
    }
    return *this;
  }
  /// Adds (or replaces) name as a view of a mutable tensor.
  template <class U>
  Inputs& set(std::string name, Tensor<U> tensor) {
    return set(std::move(name), Tensor<const U>(tensor));
  }

  /// True when name is present.
  bool contains(std::string_view name) const { return find(name) != nullptr; }
  /// The entry name, or null.
  const InputTensor* find(std::string_view name) const {
    const auto it = std::find_if(entries_.begin(), entries_.end(),
                                 [&](const InputTensor& e) { return e.name == name; });
    return it == entries_.end() ? nullptr : &*it;
  }
  /// The entry name; throws InputError listing the inputs there are when it is absent.
  const InputTensor& entry(std::string_view name) const {
    const InputTensor* e = find(name);
    if (e == nullptr) {
      raise<InputError>("micro-batch input '", name, "' is missing; the micro-batch has ",
                        names_text(), " (add it with Inputs::set or the loader's add)");
    }
    return *e;
  }
  /// The tensor name viewed as U; throws InputError when it is absent or holds another dtype.
  template <class U>
  Tensor<const U> get(std::string_view name) const {
    const InputTensor& e = entry(name);
    expect<InputError>(e.dtype == dtype_of<U>, "micro-batch input '", name, "' holds ",
                       name_of(e.dtype), " elements but ", name_of(dtype_of<U>),
                       " were asked for; convert it when building the batch, or read it with "
                       "Inputs::copy_as");
    return Tensor<const U>(static_cast<const U*>(e.data), e.shape, e.device);
  }
  /// Converts the floating or integer tensor name element by element into out (sized to it);
  /// the input must be host memory (InputError otherwise: the conversion reads it here).
  template <class U>
  void copy_as(std::string_view name, Tensor<U> out) const {
    const InputTensor& e = entry(name);
    expect<InputError>(e.device == DeviceKind::host, "micro-batch input '", name, "' is ",
                       name_of(e.device),
                       " memory; a layer that converts its input reads it on the host (give it "
                       "in host memory)");
    expect<InputError>(out.numel() == e.shape.numel(), "micro-batch input '", name, "' has ",
                       e.shape.numel(), " elements; the destination has ", out.numel());
    visit_dtype(e.dtype, [&](auto tag) {
      using S = decltype(tag);
      const S* src = static_cast<const S*>(e.data);
      for (std::int64_t i = 0; i < out.numel(); ++i) {
        if constexpr (is_half_type<S> || is_half_type<U>) {
          out.data()[i] = convert<U>(convert<float>(src[i]));
        } else {
          out.data()[i] = static_cast<U>(src[i]);
        }
      }
    });
  }

  /// Number of inputs.
  std::size_t size() const { return entries_.size(); }
  /// True with no inputs.
  bool empty() const { return entries_.empty(); }
  /// The entries in insertion order.
  const std::vector<InputTensor>& entries() const { return entries_; }

 private:
  InputTensor* find_mutable(std::string_view name) {
    for (InputTensor& e : entries_) {
      if (e.name == name) return &e;
    }
    return nullptr;
  }
  std::string names_text() const {
    if (entries_.empty()) return "no named inputs";
    std::string s = "inputs [";
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      s += (i ? ", '" : "'") + entries_[i].name + "' (" + std::string(name_of(entries_[i].dtype)) +
           ")";
    }
    return s + "]";
  }

  std::vector<InputTensor> entries_;
};

}  // namespace zero::nn
