// Multi-tensor apply: one kernel launch processes chunks of many tensors (Apex's design).
//
// The addresses and sizes of up to MaxTensors<Depth> tensors (Depth partner lists) and a map
// from block to (tensor, chunk) travel in the kernel's parameter space (under 4 KiB), so a
// launch touches up to kMaxBlocks chunks of kChunk elements with no device-side metadata and no
// host synchronisation. Long lists take several launches; a tensor whose chunks straddle two
// launches is carried over. Each block handles one chunk with kThreads threads, kILP elements
// per thread per iteration, using vector loads and stores where every list's chunk is aligned.
// multi_tensor_apply_tagged also carries one 32-bit word per tensor (a stochastic-rounding key).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace amp_runner {
namespace mta {

constexpr int kChunk = 65536;  // elements per block
constexpr int kThreads = 512;
constexpr int kILP = 4;
constexpr int kMaxBlocks = 320;

template <int Depth> struct MaxTensors;
template <> struct MaxTensors<1> { static constexpr int value = 110; };
template <> struct MaxTensors<2> { static constexpr int value = 64; };
template <> struct MaxTensors<3> { static constexpr int value = 48; };
template <> struct MaxTensors<4> { static constexpr int value = 36; };
template <> struct MaxTensors<5> { static constexpr int value = 30; };

template <int Depth>
struct TensorListMeta {
  static constexpr int kMaxTensors = MaxTensors<Depth>::value;
  void* addresses[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int tensor_index[kMaxTensors];  // position in the caller's lists
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
// The same with one 32-bit word per tensor chosen by the caller (a stochastic-rounding key).
template <int Depth>
struct TaggedListMeta : TensorListMeta<Depth> {
  uint32_t tag[MaxTensors<Depth>::value];
};
static_assert(sizeof(TensorListMeta<1>) < 3900, "kernel parameters must stay under 4 KiB");
static_assert(sizeof(TensorListMeta<5>) < 3900, "kernel parameters must stay under 4 KiB");
static_assert(sizeof(TaggedListMeta<2>) < 3900, "kernel parameters must stay under 4 KiB");
static_assert(sizeof(TaggedListMeta<4>) < 3900, "kernel parameters must stay under 4 KiB");

template <typename Meta, typename Op, typename... Args>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(Meta meta, Op op, Args... args) {
  op(meta, args...);
}

namespace detail {

// multi_tensor_apply with the metadata type Meta; `tags` (TaggedListMeta only) per position.
template <int Depth, typename Meta, typename Op, typename... Args>
void apply(const std::vector<const std::vector<at::Tensor>*>& lists,
           const std::vector<int64_t>& positions, const std::vector<uint32_t>* tags, Op op,
           Args... args) {
  constexpr bool kTagged = !std::is_same<Meta, TensorListMeta<Depth>>::value;
  TORCH_CHECK(lists.size() == static_cast<size_t>(Depth), "multi_tensor_apply: depth mismatch");
  if (positions.empty()) return;
  const at::Tensor& first = (*lists[0])[positions[0]];
  const c10::cuda::CUDAGuard guard(first.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Meta meta;
  int tensors = 0;
  int blocks = 0;
  auto launch = [&]() {
    multi_tensor_kernel<Meta><<<blocks, kThreads, 0, stream>>>(meta, op, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    blocks = 0;
  };
  for (int64_t position : positions) {
    const int64_t n = (*lists[0])[position].numel();
    if (n == 0) continue;
    for (int d = 0; d < Depth; ++d) meta.addresses[d][tensors] = (*lists[d])[position].data_ptr();
    meta.numel[tensors] = n;
    meta.tensor_index[tensors] = static_cast<int>(position);
    if constexpr (kTagged) meta.tag[tensors] = (*tags)[position];
    ++tensors;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[blocks] = static_cast<unsigned char>(tensors - 1);
      meta.block_chunk[blocks] = static_cast<int>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocks || (tensors == meta.kMaxTensors && last_chunk)) {
        launch();
        if (last_chunk) {
          tensors = 0;
        } else {  // the rest of this tensor's chunks go into the next launch
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][tensors - 1];
          meta.numel[0] = meta.numel[tensors - 1];
          meta.tensor_index[0] = meta.tensor_index[tensors - 1];
          if constexpr (kTagged) meta.tag[0] = meta.tag[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) launch();
}

}  // namespace detail

// Runs `op` over the tensors at `positions` of the `Depth` lists (partners share numel).
template <int Depth, typename Op, typename... Args>
void multi_tensor_apply(const std::vector<const std::vector<at::Tensor>*>& lists,
                        const std::vector<int64_t>& positions, Op op, Args... args) {
  detail::apply<Depth, TensorListMeta<Depth>>(lists, positions, nullptr, op, args...);
}

// The same, `op` receiving a TaggedListMeta<Depth> whose tag[slot] is tags[position].
template <int Depth, typename Op, typename... Args>
void multi_tensor_apply_tagged(const std::vector<const std::vector<at::Tensor>*>& lists,
                               const std::vector<int64_t>& positions,
                               const std::vector<uint32_t>& tags, Op op, Args... args) {
  detail::apply<Depth, TaggedListMeta<Depth>>(lists, positions, &tags, op, args...);
}

// ---- per-chunk access helpers for ops ------------------------------------------------------
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
__device__ __forceinline__ bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kILP) == 0;
}

// Load kILP values starting at element `i * kILP` (vector path) into fp32.
template <typename T>
__device__ __forceinline__ void load_pack(float (&out)[kILP], const T* src, int64_t i) {
  const Pack<T, kILP> pk = reinterpret_cast<const Pack<T, kILP>*>(src)[i];
#pragma unroll
  for (int j = 0; j < kILP; ++j) out[j] = static_cast<float>(pk.v[j]);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* dst, int64_t i, const float (&in)[kILP]) {
  Pack<T, kILP> pk;
#pragma unroll
  for (int j = 0; j < kILP; ++j) pk.v[j] = static_cast<T>(in[j]);
  reinterpret_cast<Pack<T, kILP>*>(dst)[i] = pk;
}

// Where this block works: its tensor (local slot), the chunk's first element and its length.
struct ChunkRef {
  int local;
  int64_t offset;
  int64_t length;
};

template <int Depth>
__device__ __forceinline__ ChunkRef chunk_of(const TensorListMeta<Depth>& meta) {
  ChunkRef r;
  r.local = meta.block_tensor[blockIdx.x];
  r.offset = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t left = meta.numel[r.local] - r.offset;
  r.length = left < kChunk ? left : kChunk;
  return r;
}

template <typename T, int Depth>
__device__ __forceinline__ T* list_ptr(const TensorListMeta<Depth>& meta, int d,
                                       const ChunkRef& c) {
  return static_cast<T*>(meta.addresses[d][c.local]) + c.offset;
}

// Calls fn(i0, count, vector) over the chunk: with vector=true, elements
// [i0 * kILP, i0 * kILP + kILP) (all in range, aligned); else kILP strided elements
// i0 + j * kThreads for j < kILP, of which those below `count` exist.
template <typename F>
__device__ __forceinline__ void for_chunk(int64_t length, bool vector, const F& fn) {
  if (vector) {
    for (int64_t i = threadIdx.x; i * kILP < length; i += blockDim.x) fn(i, true);
  } else {
    for (int64_t base = 0; base < length; base += static_cast<int64_t>(blockDim.x) * kILP) {
      fn(base + threadIdx.x, false);
    }
  }
}

// Scalar path: element index of slot j for a thread whose first element is i0.
__device__ __forceinline__ int64_t strided(int64_t i0, int j) {
  return i0 + static_cast<int64_t>(j) * blockDim.x;
}

// The index in the chunk of slot j of the thread's slot i0 (see for_chunk).
__device__ __forceinline__ int64_t element(int64_t i0, int j, bool vec) {
  return vec ? i0 * kILP + j : strided(i0, j);
}

// The kILP values of the thread's slot i0 (see for_chunk) as fp32: one vector load on the vector
// path, else the strided elements below `length` (zero beyond it).
template <typename T>
__device__ __forceinline__ void load(float (&out)[kILP], const T* src, int64_t i0, bool vec,
                                     int64_t length) {
  if (vec) {
    load_pack(out, src, i0);
    return;
  }
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    const int64_t i = strided(i0, j);
    out[j] = i < length ? static_cast<float>(src[i]) : 0.f;
  }
}

// The counterpart of load: the values back to `dst`'s type, only the elements that exist.
template <typename T>
__device__ __forceinline__ void store(T* dst, int64_t i0, bool vec, int64_t length,
                                      const float (&in)[kILP]) {
  if (vec) {
    store_pack(dst, i0, in);
    return;
  }
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    const int64_t i = strided(i0, j);
    if (i < length) dst[i] = static_cast<T>(in[j]);
  }
}

}  // namespace mta
}  // namespace amp_runner
