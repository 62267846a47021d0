// CUDA backend of the fused multi-tensor kernels (same functions as cpu.cpp; see ops.h).
//
// Each op groups its list positions by dtype (fp16/bf16/fp32 gradients may share a list), then
// runs one multi-tensor-apply pass per group. Flags stay on the device: the step kernels read
// found_inf themselves and return at once when it is set, so the host never waits for a verdict
// it does not need. The element math is step_math.h's, shared with the C++ backend.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <tuple>
#include <vector>

#include "multi_tensor_apply.cuh"
#include "ops.h"

namespace amp_runner {
namespace {

using mta::kILP;
using mta::TensorListMeta;

__device__ __forceinline__ bool nonfinite(float x) { return !isfinite(x); }

// The positions of some lists where those lists have one combination of dtypes. (A struct with
// named members, not a map's pairs: lambdas capture structured bindings only from C++20, and the
// torch builds of 2.11 and before compile C++17.)
struct DtypeGroup {
  std::vector<at::ScalarType> dtypes;  // one per list
  std::vector<int64_t> positions;
};

// Positions of `lists` grouped by the dtypes the lists have there (absent lists: kFloat).
std::vector<DtypeGroup> group_by_dtypes(const std::vector<const TensorList*>& lists) {
  std::map<std::vector<at::ScalarType>, std::vector<int64_t>> groups;
  const size_t n = lists[0]->size();
  for (size_t i = 0; i < n; ++i) {
    std::vector<at::ScalarType> key;
    for (const TensorList* l : lists) key.push_back(l->empty() ? at::kFloat : (*l)[i].scalar_type());
    groups[key].push_back(static_cast<int64_t>(i));
  }
  std::vector<DtypeGroup> out;
  for (auto& entry : groups) out.push_back({entry.first, std::move(entry.second)});
  return out;
}

template <typename F>
void dispatch(at::ScalarType dtype, const F& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    default: AMP_CHECK(false, "unsupported dtype ", dtype);
  }
}

void check_cuda(const TensorList& tensors, const char* op) {
  for (const auto& t : tensors) {
    AMP_CHECK(t.is_cuda(), op, ": the CUDA backend takes CUDA tensors, got ", t.device());
  }
}

// The device of a list's tensors; for an empty list, `scalar`'s (an empty list does nothing, so
// a scalar on any GPU goes with it: never the index-less Device(kCUDA), which equals no tensor's)
at::Device device_of(const TensorList& tensors, const at::Tensor& scalar) {
  return tensors.empty() ? scalar.device() : tensors[0].device();
}

const float* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

// ---- element ops ---------------------------------------------------------------------------
// out = in * (*scale); flags non-finite inputs when `found` is given.
template <typename In, typename Out>
struct ScaleOp {
  __device__ void operator()(TensorListMeta<2>& meta, const float* scale, float* found) const {
    const mta::ChunkRef c = mta::chunk_of(meta);
    const In* in = mta::list_ptr<In>(meta, 0, c);
    Out* out = mta::list_ptr<Out>(meta, 1, c);
    const float s = *scale;
    const bool vector = c.length % kILP == 0 && mta::aligned<In>(in) && mta::aligned<Out>(out);
    bool bad = false;
    mta::for_chunk(c.length, vector, [&](int64_t i0, bool vec) {
      float x[kILP];
      mta::load(x, in, i0, vec, c.length);
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        bad |= nonfinite(x[j]);
        x[j] *= s;
      }
      mta::store(out, i0, vec, c.length, x);
    });
    if (found != nullptr && bad) *found = 1.f;
  }
};

// Read-only non-finite check.
template <typename T>
struct CheckOp {
  __device__ void operator()(TensorListMeta<1>& meta, float* found) const {
    const mta::ChunkRef c = mta::chunk_of(meta);
    const T* in = mta::list_ptr<T>(meta, 0, c);
    const bool vector = c.length % kILP == 0 && mta::aligned<T>(in);
    bool bad = false;
    mta::for_chunk(c.length, vector, [&](int64_t i0, bool vec) {
      float x[kILP];
      mta::load(x, in, i0, vec, c.length);
#pragma unroll
      for (int j = 0; j < kILP; ++j) bad |= nonfinite(x[j]);
    });
    if (bad) *found = 1.f;
  }
};

// Sum of squares of scale * x per chunk into partials[tensor_index * max_chunks + chunk].
template <typename T>
struct SumSquaresOp {
  __device__ void operator()(TensorListMeta<1>& meta, const float* scale, float* partials,
                             int max_chunks, float* found) const {
    const mta::ChunkRef c = mta::chunk_of(meta);
    const T* in = mta::list_ptr<T>(meta, 0, c);
    const float s = *scale;
    const bool vector = c.length % kILP == 0 && mta::aligned<T>(in);
    float acc = 0.f;
    bool bad = false;
    mta::for_chunk(c.length, vector, [&](int64_t i0, bool vec) {
      float x[kILP];
      mta::load(x, in, i0, vec, c.length);
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        bad |= nonfinite(x[j]);
        const float v = x[j] * s;
        acc += v * v;
      }
    });
    // block reduction: warps, then the warp sums
    __shared__ float warp_sums[mta::kThreads / 32];
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      acc = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.f;
      for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
      if (lane == 0) {
        const int tensor = meta.tensor_index[c.local];
        partials[static_cast<int64_t>(tensor) * max_chunks + meta.block_chunk[blockIdx.x]] = acc;
      }
    }
    if (found != nullptr && bad) *found = 1.f;
  }
};

// One block per tensor: the sum of its chunk partials (fp64), its norm, its squared norm.
__global__ void l2norm_per_tensor(const float* partials, int max_chunks, float* norms,
                                  double* squares) {
  __shared__ double sums[256];
  double acc = 0.0;
  const float* row = partials + static_cast<int64_t>(blockIdx.x) * max_chunks;
  for (int i = threadIdx.x; i < max_chunks; i += blockDim.x) acc += row[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    squares[blockIdx.x] = sums[0];
    norms[blockIdx.x] = static_cast<float>(sqrt(sums[0]));
  }
}

__global__ void l2norm_total(const double* squares, int n, float* total) {
  __shared__ double sums[256];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += squares[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *total = static_cast<float>(sqrt(sums[0]));
}

// The shared middle of the fused steps (with fp32 masters and with stochastic rounding alike):
// kILP elements from i0 of the params (P), the gradients (G) and the state the optimizer keeps (A:
// momentum buffer or exp_avg, when `state1`; B: exp_avg_sq, for Adam) loaded into fp32 registers
// and updated there, the gradient times `gs`. Each step stores them back its own way.
template <bool kAdam, typename P, typename G, typename A, typename B>
__device__ __forceinline__ void load_and_update(float (&pv)[kILP], float (&av)[kILP],
                                                float (&bv)[kILP], const P* p, const G* g,
                                                const A* s1, const B* s2, int64_t i0, bool vec,
                                                int64_t length, float gs, bool state1,
                                                const AdamArgs& adam, const SgdArgs& sgd) {
  float gv[kILP];
  mta::load(pv, p, i0, vec, length);
  mta::load(gv, g, i0, vec, length);
  if (state1) mta::load(av, s1, i0, vec, length);
  if (kAdam) mta::load(bv, s2, i0, vec, length);
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    if (kAdam) {
      adam_update(pv[j], av[j], bv[j], gv[j] * gs, adam);
    } else {
      sgd_update(pv[j], av[j], gv[j] * gs, sgd);
    }
  }
}

// Fused optimizer steps. Lists: 0 params (fp32), 1 grads (G), 2 and 3 state (S: fp32, or bf16
// stored back rounded to nearest even; for SGD 2 = momentum buffer, 3 unused), 4 the 16-bit
// model copy (C; unused when C is float).
template <typename G, typename C, typename S, bool kAdam>
struct StepOp {
  __device__ void operator()(TensorListMeta<5>& meta, const float* grad_scale, const float* found,
                             float sign, AdamArgs base, AdamSteps steps, SgdArgs sgd,
                             bool with_momentum) const {
    if (found != nullptr && *found != 0.f) return;  // an overflow: the step does nothing at all
    constexpr bool kCopy = !std::is_same<C, float>::value;
    const mta::ChunkRef c = mta::chunk_of(meta);
    const AdamArgs adam = kAdam ? adam_at_step(base, steps, meta.tensor_index[c.local]) : base;
    const SgdArgs sgd_args = kAdam ? sgd : sgd_now(sgd);
    float* p = mta::list_ptr<float>(meta, 0, c);
    const G* g = mta::list_ptr<G>(meta, 1, c);
    S* s1 = mta::list_ptr<S>(meta, 2, c);
    S* s2 = mta::list_ptr<S>(meta, 3, c);
    C* copy = mta::list_ptr<C>(meta, 4, c);
    const float gs = *grad_scale * sign;
    const bool state1 = kAdam || with_momentum;
    const bool vector = c.length % kILP == 0 && mta::aligned<float>(p) && mta::aligned<G>(g) &&
                        (!state1 || mta::aligned<S>(s1)) &&
                        (!kAdam || mta::aligned<S>(s2)) && (!kCopy || mta::aligned<C>(copy));
    mta::for_chunk(c.length, vector, [&](int64_t i0, bool vec) {
      float pv[kILP], av[kILP] = {}, bv[kILP] = {};
      load_and_update<kAdam>(pv, av, bv, p, g, s1, s2, i0, vec, c.length, gs, state1, adam,
                             sgd_args);
      mta::store(p, i0, vec, c.length, pv);
      if (state1) mta::store(s1, i0, vec, c.length, av);
      if (kAdam) mta::store(s2, i0, vec, c.length, bv);
      if (kCopy) mta::store(copy, i0, vec, c.length, pv);
    });
  }
};

// ---- stochastic rounding -------------------------------------------------------------------
// The kILP values of the thread's slot i0 rounded stochastically into bf16 `dst` (the chunk's
// first element being element `offset` of its tensor, keyed by `key`).
__device__ __forceinline__ void store_sr(c10::BFloat16* dst, int64_t i0, bool vec, int64_t length,
                                         int64_t offset, const SrKey& key,
                                         const float (&in)[kILP]) {
  uint16_t bits[kILP];
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    const uint64_t index = static_cast<uint64_t>(offset + mta::element(i0, j, vec));
    bits[j] = sr_round_bf16(in[j], sr_bits(key, static_cast<uint32_t>(index),
                                           static_cast<uint32_t>(index >> 32)));
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  if (vec) {
    mta::Pack<uint16_t, kILP> pk;
#pragma unroll
    for (int j = 0; j < kILP; ++j) pk.v[j] = bits[j];
    reinterpret_cast<mta::Pack<uint16_t, kILP>*>(out)[i0] = pk;
    return;
  }
#pragma unroll
  for (int j = 0; j < kILP; ++j) {
    const int64_t i = mta::strided(i0, j);
    if (i < length) out[i] = bits[j];
  }
}

// The key of this block's tensor: the host puts k1 in the tag, k2 follows from it.
template <int Depth>
__device__ __forceinline__ SrKey block_key(const mta::TaggedListMeta<Depth>& meta,
                                           const mta::ChunkRef& c) {
  const uint32_t k1 = meta.tag[c.local];
  return SrKey{k1, sr_mix(k1 ^ 0x85EBCA6Bu)};
}

// dst (bf16) = src (fp32) rounded stochastically.
struct SrRoundOp {
  __device__ void operator()(mta::TaggedListMeta<2>& meta) const {
    const mta::ChunkRef c = mta::chunk_of(meta);
    const float* in = mta::list_ptr<float>(meta, 0, c);
    c10::BFloat16* out = mta::list_ptr<c10::BFloat16>(meta, 1, c);
    const SrKey key = block_key(meta, c);
    const bool vector = c.length % kILP == 0 && mta::aligned<float>(in) &&
                        mta::aligned<c10::BFloat16>(out);
    mta::for_chunk(c.length, vector, [&](int64_t i0, bool vec) {
      float x[kILP];
      mta::load(x, in, i0, vec, c.length);
      store_sr(out, i0, vec, c.length, c.offset, key, x);
    });
  }
};

// A rounded step's state back in its own dtype: fp32 as it is, bf16 rounded stochastically with
// its stream's key.
template <typename S>
__device__ __forceinline__ void store_state_sr(S* dst, int64_t i0, bool vec, int64_t length,
                                               int64_t offset, const SrKey& key,
                                               const float (&in)[kILP]) {
  if constexpr (std::is_same<S, c10::BFloat16>::value) {
    store_sr(dst, i0, vec, length, offset, key, in);
  } else {
    mta::store(dst, i0, vec, length, in);
  }
}

// Stochastic-rounding steps. Lists: 0 params (bf16, in place), 1 grads (G), 2 and 3 state (A, B:
// bf16 or fp32; for SGD 2 = momentum buffer, 3 unused). State is stored back in its own dtype
// (bf16 rounded stochastically, streams 1 and 2 of the tensor's key), the params stochastically.
template <typename G, typename A, typename B, bool kAdam>
struct SrStepOp {
  __device__ void operator()(mta::TaggedListMeta<4>& meta, const float* grad_scale,
                             const float* found, float sign, AdamArgs base, AdamSteps steps,
                             SgdArgs sgd, bool with_momentum) const {
    if (found != nullptr && *found != 0.f) return;  // an overflow: the step does nothing at all
    const mta::ChunkRef c = mta::chunk_of(meta);
    const AdamArgs adam = kAdam ? adam_at_step(base, steps, meta.tensor_index[c.local]) : base;
    c10::BFloat16* p = mta::list_ptr<c10::BFloat16>(meta, 0, c);
    const G* g = mta::list_ptr<G>(meta, 1, c);
    A* s1 = mta::list_ptr<A>(meta, 2, c);
    B* s2 = mta::list_ptr<B>(meta, 3, c);
    const SrKey key = block_key(meta, c);
    const float gs = *grad_scale * sign;
    const bool state1 = kAdam || with_momentum;
    const bool vector = c.length % kILP == 0 && mta::aligned<c10::BFloat16>(p) &&
                        mta::aligned<G>(g) && (!state1 || mta::aligned<A>(s1)) &&
                        (!kAdam || mta::aligned<B>(s2));
    mta::for_chunk(c.length, vector, [&](int64_t i0, bool vec) {
      float pv[kILP], av[kILP] = {}, bv[kILP] = {};
      load_and_update<kAdam>(pv, av, bv, p, g, s1, s2, i0, vec, c.length, gs, state1, adam, sgd);
      if (state1) store_state_sr(s1, i0, vec, c.length, c.offset, sr_stream(key, 1), av);
      if (kAdam) store_state_sr(s2, i0, vec, c.length, c.offset, sr_stream(key, 2), bv);
      store_sr(p, i0, vec, c.length, c.offset, key, pv);
    });
  }
};

// Calls fn(T{}) with T float or c10::BFloat16 (the optimizer-state dtypes of the SR steps).
template <typename F>
void dispatch_state(at::ScalarType dtype, const F& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    default: AMP_CHECK(false, "unsupported optimizer state dtype ", dtype);
  }
}

std::vector<uint32_t> key_tags(const std::vector<SrKey>& keys) {
  std::vector<uint32_t> tags;
  tags.reserve(keys.size());
  for (const SrKey& k : keys) tags.push_back(k.k1);
  return tags;
}

float* scalar_ptr(const at::Tensor& t) { return t.data_ptr<float>(); }

}  // namespace

namespace {

// dst = src * (*scale) per dtype group; `found` (may be null) flags non-finite source values.
void scale_lists(const TensorList& src, const TensorList& dst, const at::Tensor& scale,
                 float* found) {
  for (const DtypeGroup& group : group_by_dtypes({&src, &dst})) {
    const auto& dtypes = group.dtypes;
    const auto& positions = group.positions;
    dispatch(dtypes[0], [&](auto in_tag) {
      dispatch(dtypes[1], [&](auto out_tag) {
        using In = decltype(in_tag);
        using Out = decltype(out_tag);
        mta::multi_tensor_apply<2>({&src, &dst}, positions, ScaleOp<In, Out>{},
                                   static_cast<const float*>(scalar_ptr(scale)), found);
      });
    });
  }
}

}  // namespace

void unscale_check(const TensorList& grads, const TensorList& out, const at::Tensor& inv_scale,
                   const at::Tensor& found_inf) {
  check_lists("unscale_check", {&grads, &out}, {"grads", "out"}, {false, false}, {false, false});
  check_cuda(grads, "unscale_check");
  check_scalar(inv_scale, "inv_scale", device_of(grads, inv_scale));
  check_scalar(found_inf, "found_inf", device_of(grads, inv_scale));
  scale_lists(grads, out, inv_scale, scalar_ptr(found_inf));
}

void check_finite(const TensorList& tensors, const at::Tensor& found_inf) {
  check_lists("check_finite", {&tensors}, {"tensors"}, {false}, {false});
  check_cuda(tensors, "check_finite");
  check_scalar(found_inf, "found_inf", device_of(tensors, found_inf));
  for (const DtypeGroup& group : group_by_dtypes({&tensors})) {
    const auto& dtypes = group.dtypes;
    const auto& positions = group.positions;
    dispatch(dtypes[0], [&](auto tag) {
      using T = decltype(tag);
      mta::multi_tensor_apply<1>({&tensors}, positions, CheckOp<T>{}, scalar_ptr(found_inf));
    });
  }
}

std::tuple<at::Tensor, at::Tensor> l2norm(const TensorList& tensors, const at::Tensor& scale,
                                          const std::optional<at::Tensor>& found_inf) {
  check_lists("l2norm", {&tensors}, {"tensors"}, {false}, {false});
  check_cuda(tensors, "l2norm");
  const at::Device device = device_of(tensors, scale);
  check_scalar(scale, "scale", device);
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device);
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(tensors.size());
  auto per_tensor = at::empty({n}, scale.options());
  auto total = at::empty({}, scale.options());
  if (n == 0) {
    total.zero_();
    return {total, per_tensor};
  }
  int64_t max_chunks = 1;
  for (const auto& t : tensors) {
    max_chunks = std::max<int64_t>(max_chunks, (t.numel() + mta::kChunk - 1) / mta::kChunk);
  }
  auto partials = at::zeros({n * max_chunks}, scale.options());
  auto squares = at::empty({n}, scale.options().dtype(at::kDouble));
  for (const DtypeGroup& group : group_by_dtypes({&tensors})) {
    const auto& dtypes = group.dtypes;
    const auto& positions = group.positions;
    dispatch(dtypes[0], [&](auto tag) {
      using T = decltype(tag);
      mta::multi_tensor_apply<1>({&tensors}, positions, SumSquaresOp<T>{},
                                 static_cast<const float*>(scalar_ptr(scale)),
                                 scalar_ptr(partials), static_cast<int>(max_chunks),
                                 const_cast<float*>(ptr_or_null(found_inf)));
    });
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  l2norm_per_tensor<<<static_cast<unsigned>(n), 256, 0, stream>>>(
      partials.data_ptr<float>(), static_cast<int>(max_chunks), per_tensor.data_ptr<float>(),
      squares.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  l2norm_total<<<1, 256, 0, stream>>>(squares.data_ptr<double>(), static_cast<int>(n),
                                      total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {total, per_tensor};
}

void copy_scale(const TensorList& src, const TensorList& dst, const at::Tensor& scale) {
  check_lists("copy_scale", {&src, &dst}, {"src", "dst"}, {false, false}, {false, false});
  check_cuda(src, "copy_scale");
  check_scalar(scale, "scale", device_of(src, scale));
  scale_lists(src, dst, scale, nullptr);
}

namespace {

// Absent lists are stood in for by the params (never read or written: the op's flags say so).
template <bool kAdam>
void launch_step(const char* op, const TensorList& params, const TensorList& grads,
                 const TensorList& state1, const TensorList& state2,
                 const TensorList& model_copies, const at::Tensor& grad_scale,
                 const std::optional<at::Tensor>& found_inf, bool maximize, const AdamArgs& adam,
                 const AdamSteps& steps, const SgdArgs& sgd, bool with_momentum) {
  check_cuda(params, op);
  const at::Device device = device_of(params, grad_scale);
  check_scalar(grad_scale, "grad_scale", device);
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device);
  const TensorList& s1 = state1.empty() ? params : state1;
  const TensorList& s2 = state2.empty() ? params : state2;
  const TensorList& copies = model_copies.empty() ? params : model_copies;
  const float sign = maximize ? -1.f : 1.f;
  // (s2's type is s1's: check_step_lists; an absent s1 is the fp32 params')
  for (const DtypeGroup& group : group_by_dtypes({&grads, &model_copies, &s1})) {
    const auto& dtypes = group.dtypes;
    const auto& positions = group.positions;
    dispatch(dtypes[0], [&](auto g_tag) {
      dispatch(dtypes[1], [&](auto c_tag) {
        dispatch_state(dtypes[2], [&](auto s_tag) {
          using G = decltype(g_tag);
          using C = decltype(c_tag);  // float: no copy (the param is its own)
          using S = decltype(s_tag);
          mta::multi_tensor_apply<5>({&params, &grads, &s1, &s2, &copies}, positions,
                                     StepOp<G, C, S, kAdam>{},
                                     static_cast<const float*>(scalar_ptr(grad_scale)),
                                     ptr_or_null(found_inf), sign, adam, steps, sgd,
                                     with_momentum);
        });
      });
    });
  }
}

}  // namespace

void sgd_step(const TensorList& params, const TensorList& grads, const TensorList& momentum_bufs,
              const TensorList& model_copies, const at::Tensor& grad_scale,
              const std::optional<at::Tensor>& found_inf, double lr, double weight_decay,
              double momentum, double dampening, bool nesterov, bool maximize, bool first_run,
              const std::optional<at::Tensor>& lr_tensor) {
  const bool with_momentum = momentum != 0.0;
  check_step_lists("sgd_step", params, grads, momentum_bufs, momentum_bufs, with_momentum,
                   model_copies);
  SgdArgs sgd = make_sgd_args(lr, weight_decay, momentum, dampening, nesterov, first_run);
  sgd.lr_device = lr_pointer("sgd_step", lr_tensor, device_of(params, grad_scale));
  launch_step<false>("sgd_step", params, grads, with_momentum ? momentum_bufs : TensorList{},
                     TensorList{}, model_copies, grad_scale, found_inf, maximize, AdamArgs{},
                     AdamSteps{}, sgd, with_momentum);
}

void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& model_copies,
               const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               double bias_correction1, double bias_correction2, bool decoupled, bool maximize,
               const std::optional<at::Tensor>& steps, const std::optional<at::Tensor>& lr_tensor) {
  check_step_lists("adam_step", params, grads, exp_avgs, exp_avg_sqs, true, model_copies);
  const at::Device device = device_of(params, grad_scale);
  AdamSteps at_step = adam_steps("adam_step", steps, params.size(), device, lr, beta1, beta2);
  at_step.lr_device = lr_pointer("adam_step", lr_tensor, device);
  AMP_CHECK(at_step.lr_device == nullptr || at_step.steps != nullptr,
            "adam_step: lr_tensor is read with the step counters (steps) only");
  at_step.weight_decay = weight_decay;
  at_step.decoupled = decoupled;
  launch_step<true>("adam_step", params, grads, exp_avgs, exp_avg_sqs, model_copies, grad_scale,
                    found_inf, maximize,
                    make_adam_args(lr, beta1, beta2, eps, weight_decay, bias_correction1,
                                   bias_correction2, decoupled),
                    at_step, SgdArgs{}, true);
}

void stochastic_round(const TensorList& src, const TensorList& dst, uint64_t seed, uint64_t step,
                      const std::vector<int64_t>& tensor_ids) {
  check_sr_round_lists(src, dst);
  check_cuda(src, "stochastic_round");
  const auto tags = key_tags(sr_keys("stochastic_round", seed, step, tensor_ids, src.size()));
  std::vector<int64_t> positions(src.size());
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>(i);
  mta::multi_tensor_apply_tagged<2>({&src, &dst}, positions, tags, SrRoundOp{});
}

namespace {

// Absent state lists are stood in for by the params (never read or written: the op's flags say
// so; their dtype group is then bf16's).
template <bool kAdam>
void launch_step_sr(const char* op, const TensorList& params, const TensorList& grads,
                    const TensorList& state1, const TensorList& state2,
                    const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
                    bool maximize, const AdamArgs& adam, const AdamSteps& steps,
                    const SgdArgs& sgd, bool with_momentum, const std::vector<SrKey>& keys) {
  check_cuda(params, op);
  const at::Device device = device_of(params, grad_scale);
  check_scalar(grad_scale, "grad_scale", device);
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device);
  const TensorList& s1 = state1.empty() ? params : state1;
  const TensorList& s2 = state2.empty() ? params : state2;
  const auto tags = key_tags(keys);
  const float sign = maximize ? -1.f : 1.f;
  for (const DtypeGroup& group : group_by_dtypes({&grads, &s1, &s2})) {
    const auto& dtypes = group.dtypes;
    const auto& positions = group.positions;
    dispatch(dtypes[0], [&](auto g_tag) {
      dispatch_state(dtypes[1], [&](auto a_tag) {
        dispatch_state(dtypes[2], [&](auto b_tag) {
          using G = decltype(g_tag);
          using A = decltype(a_tag);
          using B = decltype(b_tag);
          mta::multi_tensor_apply_tagged<4>({&params, &grads, &s1, &s2}, positions, tags,
                                            SrStepOp<G, A, B, kAdam>{},
                                            static_cast<const float*>(scalar_ptr(grad_scale)),
                                            ptr_or_null(found_inf), sign, adam, steps, sgd,
                                            with_momentum);
        });
      });
    });
  }
}

}  // namespace

void sgd_step_sr(const TensorList& params, const TensorList& grads,
                 const TensorList& momentum_bufs, const at::Tensor& grad_scale,
                 const std::optional<at::Tensor>& found_inf, double lr, double weight_decay,
                 double momentum, double dampening, bool nesterov, bool maximize, bool first_run,
                 uint64_t seed, uint64_t step, const std::vector<int64_t>& tensor_ids) {
  const bool with_momentum = momentum != 0.0;
  check_sr_step_lists("sgd_step_sr", params, grads, momentum_bufs, TensorList{}, with_momentum,
                      false);
  launch_step_sr<false>("sgd_step_sr", params, grads,
                        with_momentum ? momentum_bufs : TensorList{}, TensorList{}, grad_scale,
                        found_inf, maximize, AdamArgs{}, AdamSteps{},
                        make_sgd_args(lr, weight_decay, momentum, dampening, nesterov, first_run),
                        with_momentum,
                        sr_keys("sgd_step_sr", seed, step, tensor_ids, params.size()));
}

void adam_step_sr(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                  const TensorList& exp_avg_sqs, const at::Tensor& grad_scale,
                  const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double bias_correction1,
                  double bias_correction2, bool decoupled, bool maximize, uint64_t seed,
                  uint64_t step, const std::vector<int64_t>& tensor_ids,
                  const std::optional<at::Tensor>& steps) {
  check_sr_step_lists("adam_step_sr", params, grads, exp_avgs, exp_avg_sqs, true, true);
  launch_step_sr<true>("adam_step_sr", params, grads, exp_avgs, exp_avg_sqs, grad_scale,
                       found_inf, maximize,
                       make_adam_args(lr, beta1, beta2, eps, weight_decay, bias_correction1,
                                      bias_correction2, decoupled),
                       adam_steps("adam_step_sr", steps, params.size(),
                                  device_of(params, grad_scale), lr, beta1, beta2),
                       SgdArgs{}, true,
                       sr_keys("adam_step_sr", seed, step, tensor_ids, params.size()));
}

namespace {

// One thread: the verdict and `when` are read on the device (see update_scale_state).
__global__ void update_scale_kernel(double* state, float* scale32, float* inv32,
                                    const float* found_inf, bool found, const bool* when,
                                    ScaleUpdate u) {
  const bool verdict = found_inf != nullptr ? *found_inf != 0.f : found;
  const bool apply = when == nullptr || *when;
  update_scale_state(state, scale32, inv32, verdict, apply, u);
}

}  // namespace

void update_scale(const at::Tensor& state, const at::Tensor& scale32, const at::Tensor& inv32,
                  const std::optional<at::Tensor>& found_inf, bool found,
                  const std::optional<at::Tensor>& when, double growth_factor,
                  double backoff_factor, int64_t growth_interval, bool has_min, double min_scale,
                  double max_scale, int64_t hysteresis) {
  const ScaleUpdate u =
      check_scale_update(state, scale32, inv32, found_inf, when, growth_factor, backoff_factor,
                         growth_interval, has_min, min_scale, max_scale, hysteresis);
  AMP_CHECK(state.is_cuda(), "update_scale: the CUDA backend takes CUDA tensors, got ",
            state.device());
  const c10::cuda::CUDAGuard guard(state.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool* when_ptr =
      when.has_value() && when->defined() ? when->data_ptr<bool>() : nullptr;
  update_scale_kernel<<<1, 1, 0, stream>>>(state.data_ptr<double>(), scale32.data_ptr<float>(),
                                           inv32.data_ptr<float>(), ptr_or_null(found_inf), found,
                                           when_ptr, u);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace amp_runner
