#pragma once
// AnyComm: a type-erased reference to any Communicator, for code that should be compiled once
// whatever backend it runs on (the Engine: one instantiation per policy set, not per policy set
// and backend). Collectives are called per unit or per bucket, so one virtual call each is free.
// The element type travels as a DType and is switched back to the typed call inside; the
// backend's own deadlines, errors and CommLogger apply unchanged.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

#include <parallel/comm/communicator.hpp>
#include <parallel/comm/reduce_op.hpp>
#include <parallel/comm/work.hpp>
#include <zero/core/dtype.hpp>
#include <zero/core/error.hpp>

namespace zero::parallel {

/// A type-erased handle to a Communicator: non-owning when made from one (the referenced one
/// must outlive it), owning when split() made it.
class AnyComm {
 public:
  /// Refers to comm.
  template <Communicator C>
  explicit AnyComm(C& comm) : impl_(std::make_unique<Model<C>>(comm)) {}

  /// Splits this group as C::split does (collective over it: ranks of one color form a group,
  /// ordered by key; name labels it in logs and errors where the backend takes a name) and owns
  /// the new communicator, which shares the backend's stream where it has one.
  AnyComm split(int color, int key, std::string_view name = {}) {
    return AnyComm(impl_->split(color, key, name));
  }

  /// This rank in the group.
  int rank() const { return impl_->rank(); }
  /// Ranks in the group.
  int size() const { return impl_->size(); }
  /// The CUDA stream the communicator runs its ops on (a cudaStream_t), or null for one that
  /// moves host memory. A device engine issues its collectives after its compute through it.
  void* device_stream() const { return impl_->device_stream(); }

  /// Async all-reduce of send into recv (the same span for in place).
  template <CommElement T>
  Work all_reduce_async(std::span<const T> send, std::span<T> recv, ReduceOp op) {
    return impl_->all_reduce(erase(send), erase(recv), op);
  }
  /// Async reduce-scatter: rank r receives the reduction of chunk r of send.
  template <CommElement T>
  Work reduce_scatter_async(std::span<const T> send, std::span<T> recv, ReduceOp op) {
    return impl_->reduce_scatter(erase(send), erase(recv), op);
  }
  /// Async all-gather: chunk q of recv is rank q's send.
  template <CommElement T>
  Work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return impl_->all_gather(erase(send), erase(recv));
  }
  /// Async all-to-all: chunk q of send goes to rank q, chunk q of recv comes from rank q.
  template <CommElement T>
  Work all_to_all_async(std::span<const T> send, std::span<T> recv) {
    return impl_->all_to_all(erase(send), erase(recv));
  }
  /// Async variable all-to-all: send packs send_counts[q] elements for each rank q in rank
  /// order, recv receives recv_counts[q] elements from each rank q in rank order.
  template <CommElement T>
  Work all_to_all_v_async(std::span<const T> send, std::span<const std::size_t> send_counts,
                          std::span<T> recv, std::span<const std::size_t> recv_counts) {
    return impl_->all_to_all_v(erase(send), send_counts, erase(recv), recv_counts);
  }
  /// Async broadcast of buf from root.
  template <CommElement T>
  Work broadcast_async(std::span<T> buf, int root) {
    return impl_->broadcast(erase(buf), root);
  }
  /// Async point-to-point send of buf to peer (tag: messages of one tag arrive in order).
  template <CommElement T>
  Work send_async(std::span<const T> buf, int peer, int tag = 0) {
    return impl_->send(erase(buf), peer, tag);
  }
  /// Async point-to-point receive of buf from peer.
  template <CommElement T>
  Work recv_async(std::span<T> buf, int peer, int tag = 0) {
    return impl_->recv(erase(buf), peer, tag);
  }
  /// Blocking all-reduce in place.
  template <CommElement T>
  void all_reduce(std::span<T> buf, ReduceOp op) {
    all_reduce_async(std::span<const T>(buf), buf, op).wait();
  }
  /// Blocking all-gather.
  template <CommElement T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    all_gather_async(send, recv).wait();
  }
  /// Blocking all-to-all.
  template <CommElement T>
  void all_to_all(std::span<const T> send, std::span<T> recv) {
    all_to_all_async(send, recv).wait();
  }
  /// Blocking variable all-to-all.
  template <CommElement T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts,
                    std::span<T> recv, std::span<const std::size_t> recv_counts) {
    all_to_all_v_async(send, send_counts, recv, recv_counts).wait();
  }
  /// Blocking broadcast of buf from root.
  template <CommElement T>
  void broadcast(std::span<T> buf, int root) {
    broadcast_async(buf, root).wait();
  }
  /// Blocking barrier.
  void barrier() { impl_->barrier(); }

 private:
  struct Erased {
    void* data;
    std::size_t count;
    DType dtype;
  };
  template <class T>
  static Erased erase(std::span<T> s) {
    return {const_cast<void*>(static_cast<const void*>(s.data())), s.size(),
            dtype_of<std::remove_const_t<T>>};
  }

  struct Concept {
    virtual ~Concept() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual void* device_stream() const = 0;
    virtual Work all_reduce(Erased send, Erased recv, ReduceOp op) = 0;
    virtual Work reduce_scatter(Erased send, Erased recv, ReduceOp op) = 0;
    virtual Work all_gather(Erased send, Erased recv) = 0;
    virtual Work all_to_all(Erased send, Erased recv) = 0;
    virtual Work all_to_all_v(Erased send, std::span<const std::size_t> send_counts, Erased recv,
                              std::span<const std::size_t> recv_counts) = 0;
    virtual Work broadcast(Erased buf, int root) = 0;
    virtual Work send(Erased buf, int peer, int tag) = 0;
    virtual Work recv(Erased buf, int peer, int tag) = 0;
    virtual void barrier() = 0;
    virtual std::unique_ptr<Concept> split(int color, int key, std::string_view name) = 0;
  };
  explicit AnyComm(std::unique_ptr<Concept> impl) : impl_(std::move(impl)) {}

  template <class C>
  struct Model final : Concept {
    explicit Model(C& c) : comm(c) {}
    explicit Model(C&& c) : owned(std::make_unique<C>(std::move(c))), comm(*owned) {}
    std::unique_ptr<C> owned;  // a split's communicator; null for a reference
    C& comm;

    // Calls fn with a typed null pointer of the element type dtype names.
    template <class Fn>
    static Work typed(DType dtype, Fn&& fn) {
      switch (dtype) {
        case DType::f64:
          return fn(static_cast<double*>(nullptr));
        case DType::f32:
          return fn(static_cast<float*>(nullptr));
        case DType::bf16:
          return fn(static_cast<bf16*>(nullptr));
        case DType::f16:
          return fn(static_cast<f16*>(nullptr));
        case DType::i64:
          return fn(static_cast<std::int64_t*>(nullptr));
        case DType::i32:
          return fn(static_cast<std::int32_t*>(nullptr));
        case DType::u8:
          return fn(static_cast<std::uint8_t*>(nullptr));
        default:
          raise<CommError>("AnyComm: element type ", name_of(dtype), " is not moved");
      }
    }
    template <class T>
    static std::span<T> as(Erased e) {
      return {static_cast<T*>(e.data), e.count};
    }

    int rank() const override { return comm.rank(); }
    int size() const override { return comm.size(); }
    void* device_stream() const override {
      if constexpr (requires { comm.device_stream(); }) {
        return static_cast<void*>(comm.device_stream());
      } else {
        return nullptr;
      }
    }
    Work all_reduce(Erased send, Erased recv, ReduceOp op) override {
      return typed(send.dtype, [&]<class T>(T*) {
        return comm.all_reduce_async(std::span<const T>(as<T>(send)), as<T>(recv), op);
      });
    }
    Work reduce_scatter(Erased send, Erased recv, ReduceOp op) override {
      return typed(send.dtype, [&]<class T>(T*) {
        return comm.reduce_scatter_async(std::span<const T>(as<T>(send)), as<T>(recv), op);
      });
    }
    Work all_gather(Erased send, Erased recv) override {
      return typed(send.dtype, [&]<class T>(T*) {
        return comm.all_gather_async(std::span<const T>(as<T>(send)), as<T>(recv));
      });
    }
    Work all_to_all(Erased send, Erased recv) override {
      return typed(send.dtype, [&]<class T>(T*) {
        return comm.all_to_all_async(std::span<const T>(as<T>(send)), as<T>(recv));
      });
    }
    Work all_to_all_v(Erased send, std::span<const std::size_t> send_counts, Erased recv,
                      std::span<const std::size_t> recv_counts) override {
      return typed(send.dtype, [&]<class T>(T*) {
        return comm.all_to_all_v_async(std::span<const T>(as<T>(send)), send_counts, as<T>(recv),
                                       recv_counts);
      });
    }
    Work broadcast(Erased buf, int root) override {
      return typed(buf.dtype, [&]<class T>(T*) { return comm.broadcast_async(as<T>(buf), root); });
    }
    Work send(Erased buf, int peer, int tag) override {
      return typed(buf.dtype, [&]<class T>(T*) {
        return comm.send_async(std::span<const T>(as<T>(buf)), peer, tag);
      });
    }
    Work recv(Erased buf, int peer, int tag) override {
      return typed(buf.dtype, [&]<class T>(T*) { return comm.recv_async(as<T>(buf), peer, tag); });
    }
    void barrier() override { comm.barrier(); }
    std::unique_ptr<Concept> split(int color, int key, std::string_view name) override {
      if constexpr (requires { comm.split(color, key, name); }) {
        return std::make_unique<Model<C>>(comm.split(color, key, name));
      } else {
        return std::make_unique<Model<C>>(comm.split(color, key));
      }
    }
  };

  std::unique_ptr<Concept> impl_;
};

}  // namespace zero::parallel
