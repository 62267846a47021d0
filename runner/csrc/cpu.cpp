// C++ (CPU) backend of the fused multi-tensor kernels.
//
// Every op splits its tensor lists into spans of at most kSpan elements (one tensor each) and runs
// the spans with PyTorch's own at::parallel_for (its OpenMP pool, its thread count) in one
// parallel region per call, the threads taking spans from a shared counter (few elements in all:
// no parallel region). The optimizer steps with fp32 masters run in ATen's Vectorized registers
// in one pass per element (16-bit gradients, state and model copies converted with at::vec's
// conversions, as torch's own fused Adam does), the arithmetic written term by term as
// step_math.h's. The other ops convert 16-bit inputs block by block into small fp32 buffers (F16C
// for fp16 where the build has it, bit shifts for bf16) and run step_math.h's arithmetic in plain
// loops the compiler vectorises. 16-bit outputs are rounded to nearest even, as torch does.
// The tensor, the one operator used (at::empty) and pybind11 with torch's type casters only:
// ATen/ATen.h (every operator) and torch/python.h (torch's C++ frontend) cost a build of this file
// 10 s of its 52 (g++ -O3, 2 cores), torch/extension.h more
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace amp_runner {
namespace {

constexpr int64_t kSpan = 1 << 16;  // elements per parallel work item
constexpr int64_t kBlock = 512;     // elements per conversion buffer (2 KiB of fp32, in L1)

struct Span {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

std::vector<Span> make_spans(const TensorList& tensors) {
  std::vector<Span> spans;
  for (int64_t t = 0; t < static_cast<int64_t>(tensors.size()); ++t) {
    const int64_t n = tensors[t].numel();
    for (int64_t b = 0; b < n; b += kSpan) spans.push_back({t, b, std::min(n, b + kSpan)});
  }
  return spans;
}

// The spans of a pass over gradients that a fused step reads next (the overflow check, the
// unscale): last to first, so the step, which starts with the first tensors, finds the
// gradients this pass read last still in the cache.
std::vector<Span> make_spans_backwards(const TensorList& tensors) {
  std::vector<Span> spans = make_spans(tensors);
  std::reverse(spans.begin(), spans.end());
  return spans;
}

// Runs fn(span, index) over every span: inline when the spans are few elements in all (a
// parallel region costs more than it saves, and a busy machine may keep a worker from starting
// for a whole time slice), else in at::parallel_for's threads, which take the spans one at a
// time from a shared counter: a thread that starts late (descheduled on a shared machine) finds
// the work done by the others instead of holding a fixed share of it.
template <typename F>
void for_each_span(const std::vector<Span>& spans, const F& fn) {
  const int64_t count = static_cast<int64_t>(spans.size());
  int64_t total = 0;
  for (const Span& s : spans) total += s.end - s.begin;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  if (workers <= 1 || total <= kSpan || at::in_parallel_region()) {
    for (int64_t i = 0; i < count; ++i) fn(spans[i], i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(spans[i], i);
    }
  });
}

// ---- 16-bit <-> fp32 conversion of a block -------------------------------------------------
inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

inline void from_float(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    // round to nearest even; NaN stays a (quiet) NaN, as c10::BFloat16 does
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    bits[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  }
}

inline void from_float(const float* src, float* dst, int64_t n) {
  if (src != dst) std::memcpy(dst, src, n * sizeof(float));
}

// A pointer to `n` fp32 values: `src` itself for fp32, else `buf` filled by conversion.
template <typename T>
inline const float* load_block(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_float(src, buf, n);
    return buf;
  }
}

// ---- non-finite test over raw bits (no conversion, integer ops that vectorise) -------------
// A value is inf/NaN when its exponent field is all ones (step_math.h's nonfinite_bits*): then
// (bits & exponent mask) + the exponent's lowest bit carries into the sign bit, and only then,
// so OR-ing that sum over a run and testing the sign bit at the end needs no widening or compare
// (16-bit lanes stay 16-bit).
template <typename U, U kExp>
inline U nonfinite_or(const U* __restrict__ b, int64_t n) {
  constexpr U kCarry = kExp & static_cast<U>(~kExp + 1);
  U acc = 0;
  for (int64_t i = 0; i < n; ++i) acc |= static_cast<U>((b[i] & kExp) + kCarry);
  return acc;
}

// A long run is read as four interleaved streams (its quarters): one stream from memory is
// latency-bound on one core; four keep more reads in flight (ResNet-50's fp16 gradients: 1.85
// ms against 2.5 ms on one thread here).
template <typename U, U kExp>
inline bool nonfinite_in(const U* b, int64_t n) {
  constexpr U kCarry = kExp & static_cast<U>(~kExp + 1);
  constexpr U kSign = static_cast<U>(U(1) << (sizeof(U) * 8 - 1));
  if (n < 4096) return (nonfinite_or<U, kExp>(b, n) & kSign) != 0;
  const int64_t q = n / 4;
  const U* __restrict__ b0 = b;
  const U* __restrict__ b1 = b + q;
  const U* __restrict__ b2 = b + 2 * q;
  const U* __restrict__ b3 = b + 3 * q;
  U acc = 0;
  for (int64_t i = 0; i < q; ++i) {
    acc |= static_cast<U>((b0[i] & kExp) + kCarry) | static_cast<U>((b1[i] & kExp) + kCarry) |
           static_cast<U>((b2[i] & kExp) + kCarry) | static_cast<U>((b3[i] & kExp) + kCarry);
  }
  acc |= nonfinite_or<U, kExp>(b + 4 * q, n - 4 * q);
  return (acc & kSign) != 0;
}

template <typename T>
inline bool any_nonfinite(const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return nonfinite_in<uint32_t, 0x7F800000u>(reinterpret_cast<const uint32_t*>(src), n);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return nonfinite_in<uint16_t, 0x7C00>(reinterpret_cast<const uint16_t*>(src), n);
  } else {
    return nonfinite_in<uint16_t, 0x7F80>(reinterpret_cast<const uint16_t*>(src), n);
  }
}

// Calls fn(T{}) with T the C++ type of `dtype` (float, c10::Half or c10::BFloat16).
template <typename F>
inline void dispatch(at::ScalarType dtype, const F& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    default: AMP_CHECK(false, "unsupported dtype ", dtype);
  }
}

// Like dispatch, with `void` for "no tensor" (an empty optional list).
template <typename F>
inline void dispatch_optional(bool present, at::ScalarType dtype, const F& fn) {
  if (!present) {
    fn(static_cast<void*>(nullptr));
    return;
  }
  dispatch(dtype, [&](auto tag) { fn(static_cast<decltype(tag)*>(nullptr)); });
}

inline float read_scalar(const at::Tensor& t) { return *t.data_ptr<float>(); }

inline bool flag_set(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->defined() && read_scalar(*found_inf) != 0.f;
}

inline void raise_flag(const at::Tensor& found_inf) { *found_inf.data_ptr<float>() = 1.f; }

at::Device device_of(const TensorList& tensors) {
  return tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
}

void check_cpu(const TensorList& tensors, const char* op) {
  for (const auto& t : tensors) {
    AMP_CHECK(t.device().is_cpu(), op, ": the C++ backend takes CPU tensors, got ", t.device());
  }
}

}  // namespace

// ---- ops -----------------------------------------------------------------------------------
namespace {

// dst = src * scale, converted to dst's dtype (dst may be src: in place). With `check`, returns
// whether any source value is inf/NaN (tested on the raw bits, before scaling).
bool scale_lists(const TensorList& src, const TensorList& dst, float scale, bool check) {
  std::atomic<bool> bad{false};
  for_each_span(make_spans_backwards(src), [&](const Span& s, int64_t) {
    const at::Tensor& a = src[s.tensor];
    const at::Tensor& d = dst[s.tensor];
    dispatch(a.scalar_type(), [&](auto st) {
      using S = decltype(st);
      dispatch(d.scalar_type(), [&](auto dt) {
        using D = decltype(dt);
        const S* sp = static_cast<const S*>(a.data_ptr()) + s.begin;
        D* dp = static_cast<D*>(d.data_ptr()) + s.begin;
        float buf[kBlock];
        float res[kBlock];
        bool local_bad = false;
        for (int64_t b = 0; b < s.end - s.begin; b += kBlock) {
          const int64_t n = std::min(kBlock, s.end - s.begin - b);
          if (check) local_bad |= any_nonfinite(sp + b, n);
          const float* x = load_block(sp + b, buf, n);
          float* y = std::is_same_v<D, float> ? reinterpret_cast<float*>(dp + b) : res;
          for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
          if constexpr (!std::is_same_v<D, float>) from_float(res, dp + b, n);
        }
        if (local_bad) bad.store(true, std::memory_order_relaxed);
      });
    });
  });
  return bad.load();
}

}  // namespace

void unscale_check(const TensorList& grads, const TensorList& out, const at::Tensor& inv_scale,
                   const at::Tensor& found_inf) {
  check_lists("unscale_check", {&grads, &out}, {"grads", "out"}, {false, false}, {false, false});
  check_cpu(grads, "unscale_check");
  check_scalar(inv_scale, "inv_scale", at::kCPU);
  check_scalar(found_inf, "found_inf", at::kCPU);
  if (scale_lists(grads, out, read_scalar(inv_scale), /*check=*/true)) raise_flag(found_inf);
}

void check_finite(const TensorList& tensors, const at::Tensor& found_inf) {
  check_lists("check_finite", {&tensors}, {"tensors"}, {false}, {false});
  check_cpu(tensors, "check_finite");
  check_scalar(found_inf, "found_inf", at::kCPU);
  std::atomic<bool> bad{false};
  for_each_span(make_spans_backwards(tensors), [&](const Span& s, int64_t) {
    if (bad.load(std::memory_order_relaxed)) return;  // the answer is known
    const at::Tensor& t = tensors[s.tensor];
    dispatch(t.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      if (any_nonfinite(static_cast<const T*>(t.data_ptr()) + s.begin, s.end - s.begin)) {
        bad.store(true, std::memory_order_relaxed);
      }
    });
  });
  if (bad.load()) raise_flag(found_inf);
}

std::tuple<at::Tensor, at::Tensor> l2norm(const TensorList& tensors, const at::Tensor& scale,
                                          const std::optional<at::Tensor>& found_inf) {
  check_lists("l2norm", {&tensors}, {"tensors"}, {false}, {false});
  check_cpu(tensors, "l2norm");
  check_scalar(scale, "scale", at::kCPU);
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", at::kCPU);
  const float sc = read_scalar(scale);
  const auto spans = make_spans(tensors);
  std::vector<double> partial(spans.size(), 0.0);
  std::atomic<bool> bad{false};
  for_each_span(spans, [&](const Span& s, int64_t index) {
    const at::Tensor& t = tensors[s.tensor];
    dispatch(t.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* p = static_cast<const T*>(t.data_ptr()) + s.begin;
      constexpr int kLanes = 16;  // independent fp32 accumulators: a vectorisable reduction
      float buf[kBlock];
      double sum = 0.0;
      bool local_bad = false;
      for (int64_t b = 0; b < s.end - s.begin; b += kBlock) {
        const int64_t n = std::min(kBlock, s.end - s.begin - b);
        local_bad |= any_nonfinite(p + b, n);
        const float* x = load_block(p + b, buf, n);
        float acc[kLanes] = {};
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) {
          for (int j = 0; j < kLanes; ++j) {
            const float v = x[i + j] * sc;
            acc[j] += v * v;
          }
        }
        for (; i < n; ++i) {
          const float v = x[i] * sc;
          acc[0] += v * v;
        }
        for (int j = 0; j < kLanes; ++j) sum += acc[j];
      }
      partial[index] = sum;
      if (local_bad) bad.store(true, std::memory_order_relaxed);
    });
  });
  // Per-tensor sums in span order: deterministic whatever the thread count.
  std::vector<double> per(tensors.size(), 0.0);
  for (size_t i = 0; i < spans.size(); ++i) per[spans[i].tensor] += partial[i];
  auto per_tensor = at::empty({static_cast<int64_t>(tensors.size())}, scale.options());
  float* out = per_tensor.data_ptr<float>();
  double total = 0.0;
  for (size_t t = 0; t < per.size(); ++t) {
    out[t] = static_cast<float>(std::sqrt(per[t]));
    total += per[t];
  }
  auto total_norm = at::empty({}, scale.options());
  *total_norm.data_ptr<float>() = static_cast<float>(std::sqrt(total));
  if (found_inf.has_value() && bad.load()) raise_flag(*found_inf);
  return {total_norm, per_tensor};
}

void copy_scale(const TensorList& src, const TensorList& dst, const at::Tensor& scale) {
  check_lists("copy_scale", {&src, &dst}, {"src", "dst"}, {false, false}, {false, false});
  check_cpu(src, "copy_scale");
  check_scalar(scale, "scale", at::kCPU);
  scale_lists(src, dst, read_scalar(scale), /*check=*/false);
}

namespace {

// Calls fn(static_cast<S*>(nullptr)) with S = void (no list), float or c10::BFloat16.
template <typename F>
inline void dispatch_state(bool present, at::ScalarType dtype, const F& fn) {
  if (!present) {
    fn(static_cast<void*>(nullptr));
  } else if (dtype == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else {
    AMP_CHECK(dtype == at::kBFloat16, "unsupported optimizer state dtype ", dtype);
    fn(static_cast<c10::BFloat16*>(nullptr));
  }
}

// A block of optimizer state as fp32: fp32 state in place, bf16 converted into `buf` (and
// rounded back to nearest by state_store), no state: `buf` (scratch, never read).
template <typename S>
inline float* state_load(const at::Tensor* t, int64_t offset, float* buf, int64_t n) {
  if constexpr (std::is_same_v<S, float>) {
    return t->data_ptr<float>() + offset;
  } else if constexpr (std::is_same_v<S, c10::BFloat16>) {
    to_float(static_cast<const c10::BFloat16*>(t->data_ptr()) + offset, buf, n);
    return buf;
  } else {
    return buf;
  }
}

template <typename S>
inline void state_store(const at::Tensor* t, int64_t offset, const float* buf, int64_t n) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    from_float(buf, static_cast<c10::BFloat16*>(t->data_ptr()) + offset, n);
  }
}

inline void store_sr(const float* __restrict__ src, c10::BFloat16* dst, int64_t n,
                     const SrKey& key, int64_t index);

// A rounded step's state back in its dtype: bf16 rounded stochastically with its stream's key
// (fp32 state was updated in place).
template <typename S>
inline void state_store_sr(const at::Tensor* t, int64_t offset, const float* buf, int64_t n,
                           const SrKey& key) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    store_sr(buf, static_cast<c10::BFloat16*>(t->data_ptr()) + offset, n, key, offset);
  }
}

// Calls fn(static_cast<S*>(nullptr)) with S = float or c10::BFloat16, the optimizer state's type.
template <typename F>
inline void dispatch_state_type(at::ScalarType dtype, const F& fn) {
  if (dtype == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else {
    AMP_CHECK(dtype == at::kBFloat16, "unsupported optimizer state dtype ", dtype);
    fn(static_cast<c10::BFloat16*>(nullptr));
  }
}

// ---- the fused steps with fp32 masters: one pass in ATen's vector registers -----------------
// Per iteration, kStep elements (one 16-bit vector, two fp32 vectors): the gradient converted
// to fp32 in registers (at::vec's conversions, the ones torch's fused Adam uses), the masters and
// the state loaded (bf16 state converted), the update, everything stored back and the 16-bit
// model copy rounded to nearest even and written, without fp32 buffers in between. The vector
// width is the build's (ATen's AVX-512 or AVX2 Vectorized where the loader picked those flags,
// else its portable form).
using FVec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * FVec::size();

// Software prefetch of every stream a step reads, this many elements ahead (2 KiB of fp32): the
// hardware prefetchers stop at each 4 KiB page and restart on the next, and a core has few misses
// in flight, so with seven streams a pass waits on memory at every page; prefetching across the
// boundary keeps the reads going (the O2 Adam kernel over VGG-16's parameters here: 3% faster,
// over ResNet-50's 1-3%). Prefetches past the end of a tensor are hints and never fault.
constexpr int64_t kPrefetch = 512;

template <typename T>
C10_ALWAYS_INLINE void prefetch_step(const T* src) {
  __builtin_prefetch(src + kPrefetch);
  if constexpr (sizeof(T) * kStep > 64) __builtin_prefetch(src + kPrefetch + 64 / sizeof(T));
}

template <typename T>
C10_ALWAYS_INLINE void vload(const T* src, FVec& lo, FVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = FVec::loadu(src);
    hi = FVec::loadu(src + FVec::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

template <typename T>
C10_ALWAYS_INLINE void vstore(T* dst, const FVec& lo, const FVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + FVec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(dst);
  }
}

// The 16-bit model copy: not read again in the step, so written with non-temporal stores where
// the vector is aligned (a normal store first reads every line it writes: 2 more bytes of
// traffic per parameter). The caller fences once after the parallel loop.
template <typename C>
C10_ALWAYS_INLINE void vstore_copy(C* dst, const FVec& lo, const FVec& hi, bool stream) {
  const auto packed = at::vec::convert_from_float<C>(lo, hi);
#if defined(CPU_CAPABILITY_AVX512)
  if (stream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), __m512i(packed));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), __m256i(packed));
    return;
  }
#endif
  (void)stream;
  packed.store(dst);
}

inline bool stream_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (kStep * 2) == 0;
}

// The vector form of step_math.h's adam_update, term by term in the same order.
struct AdamVec {
  FVec beta1, beta2, one_minus_beta1, one_minus_beta2, eps, neg_step_size, bc2_sqrt, l2, decay;
  bool lerp_from_m;  // one_minus_beta1 < 0.5: m + w * (g - m), else g - (g - m) * beta1
  explicit AdamVec(const AdamArgs& a)
      : beta1(a.beta1), beta2(a.beta2), one_minus_beta1(a.one_minus_beta1),
        one_minus_beta2(a.one_minus_beta2), eps(a.eps), neg_step_size(-a.step_size),
        bc2_sqrt(a.bias_correction2_sqrt), l2(a.l2_weight_decay), decay(a.decay),
        lerp_from_m(a.one_minus_beta1 < 0.5f) {}

  C10_ALWAYS_INLINE void update(FVec& p, FVec& m, FVec& v, FVec g) const {
    p = p * decay;
    g = g + l2 * p;
    m = lerp_from_m ? m + one_minus_beta1 * (g - m) : g - (g - m) * beta1;
    v = v * beta2 + one_minus_beta2 * g * g;
    const FVec denom = v.sqrt() / bc2_sqrt + eps;
    p = p + neg_step_size * m / denom;
  }
};

// The vector form of step_math.h's sgd_update.
struct SgdVec {
  FVec lr_neg, weight_decay, momentum, one_minus_dampening;
  bool with_momentum, nesterov, first_run;
  explicit SgdVec(const SgdArgs& s)
      : lr_neg(-s.lr), weight_decay(s.weight_decay), momentum(s.momentum),
        one_minus_dampening(s.one_minus_dampening), with_momentum(s.momentum != 0.f),
        nesterov(s.nesterov), first_run(s.first_run) {}

  C10_ALWAYS_INLINE void update(FVec& p, FVec& buf, FVec g) const {
    g = g + weight_decay * p;
    if (with_momentum) {
      buf = first_run ? g : buf * momentum + one_minus_dampening * g;
      g = nesterov ? g + momentum * buf : buf;
    }
    p = p + lr_neg * g;
  }
};

// One span of a fused step: `body(offset, g_lo, g_hi, p_lo, p_hi)` updates kStep elements whose
// gradient (times gs) and masters it is given and stores its state itself; this loads the
// gradient, loads and stores the masters and writes the 16-bit copy (C = float: no copy). A
// tail of fewer than kStep elements runs through zero-padded copies of every list (`Tail`),
// with the same vector code, so every element sees the same arithmetic.
template <typename G, typename C, typename Body>
inline void vector_span(const G* g, float* p, C* copy, int64_t n, const FVec& gs,
                        const Body& body) {
  constexpr bool kCopy = !std::is_same_v<C, float>;
  const bool stream = kCopy && stream_aligned(copy);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec g0, g1, p0, p1;
    prefetch_step(g + i);
    prefetch_step(p + i);
    vload(g + i, g0, g1);
    vload(p + i, p0, p1);
    body(i, g0 * gs, g1 * gs, p0, p1);
    vstore(p + i, p0, p1);
    if constexpr (kCopy) vstore_copy(copy + i, p0, p1, stream);
  }
  if (i < n) {
    const int64_t r = n - i;
    G gt[kStep] = {};
    float pt[kStep] = {};
    std::memcpy(gt, g + i, r * sizeof(G));
    std::memcpy(pt, p + i, r * sizeof(float));
    FVec g0, g1, p0, p1;
    vload(gt, g0, g1);
    vload(pt, p0, p1);
    body(i, g0 * gs, g1 * gs, p0, p1);
    vstore(pt, p0, p1);
    std::memcpy(p + i, pt, r * sizeof(float));
    if constexpr (kCopy) {
      C ct[kStep];
      vstore(ct, p0, p1);
      std::memcpy(copy + i, ct, r * sizeof(C));
    }
  }
}

// Loads kStep elements of state at `offset` (all of them, or the `r` < kStep of a tail,
// zero-padded) and stores them back after `fn` changed them.
template <typename S>
struct StateVec {
  S* base;
  int64_t n;  // elements in the span
  template <typename F>
  C10_ALWAYS_INLINE void with(int64_t offset, FVec& lo, FVec& hi, const F& fn) const {
    if (offset + kStep <= n) {
      prefetch_step(base + offset);
      vload(base + offset, lo, hi);
      fn();
      vstore(base + offset, lo, hi);
    } else {
      const int64_t r = n - offset;
      S t[kStep] = {};
      std::memcpy(t, base + offset, r * sizeof(S));
      vload(t, lo, hi);
      fn();
      vstore(t, lo, hi);
      std::memcpy(base + offset, t, r * sizeof(S));
    }
  }
};

// Adam's arguments per tensor position: `base` everywhere, or with `steps` (the optimizer's
// step counters, read here from CPU memory) each tensor's own bias corrections.
std::vector<AdamArgs> adam_args_per_tensor(const char* op, const TensorList& params,
                                           const std::optional<at::Tensor>& steps, double lr,
                                           double beta1, double beta2, const AdamArgs& base) {
  const AdamSteps s = adam_steps(op, steps, params.size(),
                                 params.empty() ? at::Device(at::kCPU) : params[0].device(), lr,
                                 beta1, beta2);
  std::vector<AdamArgs> out(params.size(), base);
  for (size_t i = 0; i < out.size(); ++i) out[i] = adam_at_step(base, s, static_cast<int64_t>(i));
  return out;
}

// The shared skeleton of the fused steps with fp32 masters: the overflow flag, the gradient
// multiplier, then per span (in parallel) the types of its gradient and 16-bit copy dispatched
// once and `span_fn(span, g, p, copy, gs)` run over it.
template <typename SpanFn>
void fused_step(const char* op, const TensorList& params, const TensorList& grads,
                const TensorList& model_copies, const at::Tensor& grad_scale,
                const std::optional<at::Tensor>& found_inf, bool maximize,
                const SpanFn& span_fn) {
  check_cpu(params, op);
  check_scalar(grad_scale, "grad_scale", device_of(params));
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device_of(params));
  if (flag_set(found_inf)) return;  // an overflow: the step does nothing at all
  const FVec gs(read_scalar(grad_scale) * (maximize ? -1.f : 1.f));
  const bool with_copies = !model_copies.empty();
  for_each_span(make_spans(params), [&](const Span& s, int64_t) {
    const at::Tensor& g = grads[s.tensor];
    const at::ScalarType copy_type =
        with_copies ? model_copies[s.tensor].scalar_type() : at::kFloat;
    dispatch(g.scalar_type(), [&](auto gt) {
      dispatch(copy_type, [&](auto ct) {
        using G = decltype(gt);
        using C = decltype(ct);  // float: no copy (none given, or the param itself)
        C* cp = std::is_same_v<C, float>
                    ? nullptr
                    : static_cast<C*>(model_copies[s.tensor].data_ptr()) + s.begin;
        span_fn(s, static_cast<const G*>(g.data_ptr()) + s.begin,
                params[s.tensor].data_ptr<float>() + s.begin, cp, gs);
      });
    });
  });
#if defined(__SSE2__)
  _mm_sfence();  // the streamed copies are visible before the step returns
#endif
}

// The update loops of the fused steps (with fp32 masters and with stochastic rounding alike),
// over n elements of one block: local copies of the arguments and restrict pointers, so nothing
// the loop stores can alias them and the loop vectorises. Without momentum `buf` is not read.
inline void sgd_block(int64_t n, float* __restrict__ p, float* __restrict__ buf,
                      const float* __restrict__ g, float gs, const SgdArgs& args,
                      bool with_momentum) {
  const SgdArgs a = args;
  if (with_momentum) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sgd_update(p[i], buf[i], g[i] * gs, a);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      float unused = 0.f;
      sgd_update(p[i], unused, g[i] * gs, a);
    }
  }
}

inline void adam_block(int64_t n, float* __restrict__ p, float* __restrict__ m,
                       float* __restrict__ v, const float* __restrict__ g, float gs,
                       const AdamArgs& args) {
  const AdamArgs a = args;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) adam_update(p[i], m[i], v[i], g[i] * gs, a);
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
  if (const double* rate = lr_pointer("sgd_step", lr_tensor, device_of(params))) lr = *rate;
  const SgdArgs args = make_sgd_args(lr, weight_decay, momentum, dampening, nesterov, first_run);
  const SgdVec vec(args);
  fused_step("sgd_step", params, grads, model_copies, grad_scale, found_inf, maximize,
             [&](const Span& s, const auto* g, float* p, auto* copy, const FVec& gs) {
               const int64_t n = s.end - s.begin;
               const SgdVec a = vec;  // a local copy: no store of the loop can alias it
               if (!with_momentum) {
                 FVec unused;
                 vector_span(g, p, copy, n, gs,
                             [&](int64_t, FVec g0, FVec g1, FVec& p0, FVec& p1) C10_ALWAYS_INLINE_ATTRIBUTE {
                               a.update(p0, unused, g0);
                               a.update(p1, unused, g1);
                             });
                 return;
               }
               const at::Tensor& buf_t = momentum_bufs[s.tensor];
               dispatch_state_type(buf_t.scalar_type(), [&](auto* st) {
                 using S = std::remove_pointer_t<decltype(st)>;
                 const StateVec<S> buf{static_cast<S*>(buf_t.data_ptr()) + s.begin, n};
                 vector_span(g, p, copy, n, gs,
                             [&](int64_t i, FVec g0, FVec g1, FVec& p0, FVec& p1) C10_ALWAYS_INLINE_ATTRIBUTE {
                               FVec b0, b1;
                               buf.with(i, b0, b1, [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
                                 a.update(p0, b0, g0);
                                 a.update(p1, b1, g1);
                               });
                             });
               });
             });
}

void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& model_copies,
               const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               double bias_correction1, double bias_correction2, bool decoupled, bool maximize,
               const std::optional<at::Tensor>& steps, const std::optional<at::Tensor>& lr_tensor) {
  check_step_lists("adam_step", params, grads, exp_avgs, exp_avg_sqs, true, model_copies);
  if (const double* rate = lr_pointer("adam_step", lr_tensor, device_of(params))) {
    AMP_CHECK(steps.has_value() && steps->defined(),
              "adam_step: lr_tensor is read with the step counters (steps) only");
    lr = *rate;
  }
  const auto per_tensor = adam_args_per_tensor(
      "adam_step", params, steps, lr, beta1, beta2,
      make_adam_args(lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
                     decoupled));
  fused_step("adam_step", params, grads, model_copies, grad_scale, found_inf, maximize,
             [&](const Span& s, const auto* g, float* p, auto* copy, const FVec& gs) {
               const int64_t n = s.end - s.begin;
               const AdamVec a(per_tensor[s.tensor]);  // (local: no store of the loop aliases it)
               dispatch_state_type(exp_avgs[s.tensor].scalar_type(), [&](auto* st) {
                 using S = std::remove_pointer_t<decltype(st)>;
                 const StateVec<S> m{static_cast<S*>(exp_avgs[s.tensor].data_ptr()) + s.begin, n};
                 const StateVec<S> v{
                     static_cast<S*>(exp_avg_sqs[s.tensor].data_ptr()) + s.begin, n};
                 vector_span(g, p, copy, n, gs,
                             [&](int64_t i, FVec g0, FVec g1, FVec& p0, FVec& p1) C10_ALWAYS_INLINE_ATTRIBUTE {
                               FVec m0, m1, v0, v1;
                               m.with(i, m0, m1, [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
                                 v.with(i, v0, v1, [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
                                   a.update(p0, m0, v0, g0);
                                   a.update(p1, m1, v1, g1);
                                 });
                               });
                             });
               });
             });
}

// ---- stochastic rounding -------------------------------------------------------------------
namespace {

// dst[0..n) = src[0..n) rounded stochastically, the values being elements index.. of a tensor
// under `key`. The block must not straddle a multiple of 2^32 elements (spans and blocks start
// at multiples of their sizes, which divide 2^32), so the high index word is one for the block
// and the loop runs on 32-bit integers (it vectorises).
inline void store_sr(const float* __restrict__ src, c10::BFloat16* dst, int64_t n,
                     const SrKey& key, int64_t index) {
  const uint32_t lo = static_cast<uint32_t>(index);
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(lo) + static_cast<uint64_t>(n) <= (1ull << 32));
  const SrKey k = key;
  uint16_t* __restrict__ out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = sr_round_bf16(src[i], sr_bits(k, lo + static_cast<uint32_t>(i), hi));
  }
}

// The skeleton of the stochastic-rounding steps: per block, the bf16 params, the gradients and
// the state in fp32, `update(t, n, p, g, gs, a, b)` over them (t: the tensor's position), the
// state back in its dtype (bf16 rounded stochastically too, streams 1 and 2 of the tensor's key)
// and the params rounded stochastically.
template <typename Update>
void sr_fused_step(const char* op, const TensorList& params, const TensorList& grads,
                   const TensorList& state_a, const TensorList& state_b,
                   const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
                   bool maximize, const std::vector<SrKey>& keys, const Update& update) {
  check_cpu(params, op);
  check_scalar(grad_scale, "grad_scale", device_of(params));
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device_of(params));
  if (flag_set(found_inf)) return;  // an overflow: the step does nothing at all
  const float gs = read_scalar(grad_scale) * (maximize ? -1.f : 1.f);
  const bool with_a = !state_a.empty();
  const bool with_b = !state_b.empty();
  for_each_span(make_spans(params), [&](const Span& s, int64_t) {
    const int64_t t = s.tensor;
    const at::Tensor* a_t = with_a ? &state_a[t] : nullptr;
    const at::Tensor* b_t = with_b ? &state_b[t] : nullptr;
    dispatch(grads[t].scalar_type(), [&](auto gt) {
      dispatch_state(with_a, with_a ? a_t->scalar_type() : at::kFloat, [&](auto* at_) {
        dispatch_state(with_b, with_b ? b_t->scalar_type() : at::kFloat, [&](auto* bt_) {
          using G = decltype(gt);
          using A = std::remove_pointer_t<decltype(at_)>;
          using B = std::remove_pointer_t<decltype(bt_)>;
          const G* gp = static_cast<const G*>(grads[t].data_ptr()) + s.begin;
          c10::BFloat16* pp = static_cast<c10::BFloat16*>(params[t].data_ptr()) + s.begin;
          float pbuf[kBlock], gbuf[kBlock], abuf[kBlock], bbuf[kBlock];
          for (int64_t b = 0; b < s.end - s.begin; b += kBlock) {
            const int64_t n = std::min(kBlock, s.end - s.begin - b);
            to_float(pp + b, pbuf, n);
            const float* g = load_block(gp + b, gbuf, n);
            float* a = state_load<A>(a_t, s.begin + b, abuf, n);
            float* bv = state_load<B>(b_t, s.begin + b, bbuf, n);
            update(t, n, pbuf, g, gs, a, bv);
            state_store_sr<A>(a_t, s.begin + b, a, n, sr_stream(keys[t], 1));
            state_store_sr<B>(b_t, s.begin + b, bv, n, sr_stream(keys[t], 2));
            store_sr(pbuf, pp + b, n, keys[t], s.begin + b);
          }
        });
      });
    });
  });
}

}  // namespace

void stochastic_round(const TensorList& src, const TensorList& dst, uint64_t seed, uint64_t step,
                      const std::vector<int64_t>& tensor_ids) {
  check_sr_round_lists(src, dst);
  check_cpu(src, "stochastic_round");
  const std::vector<SrKey> keys = sr_keys("stochastic_round", seed, step, tensor_ids, src.size());
  for_each_span(make_spans(src), [&](const Span& s, int64_t) {
    const float* sp = src[s.tensor].data_ptr<float>() + s.begin;
    c10::BFloat16* dp = static_cast<c10::BFloat16*>(dst[s.tensor].data_ptr()) + s.begin;
    for (int64_t b = 0; b < s.end - s.begin; b += kBlock) {
      store_sr(sp + b, dp + b, std::min(kBlock, s.end - s.begin - b), keys[s.tensor],
               s.begin + b);
    }
  });
}

void sgd_step_sr(const TensorList& params, const TensorList& grads,
                 const TensorList& momentum_bufs, const at::Tensor& grad_scale,
                 const std::optional<at::Tensor>& found_inf, double lr, double weight_decay,
                 double momentum, double dampening, bool nesterov, bool maximize, bool first_run,
                 uint64_t seed, uint64_t step, const std::vector<int64_t>& tensor_ids) {
  const bool with_momentum = momentum != 0.0;
  check_sr_step_lists("sgd_step_sr", params, grads, momentum_bufs, TensorList{}, with_momentum,
                      false);
  const auto keys = sr_keys("sgd_step_sr", seed, step, tensor_ids, params.size());
  const SgdArgs args = make_sgd_args(lr, weight_decay, momentum, dampening, nesterov, first_run);
  sr_fused_step("sgd_step_sr", params, grads, with_momentum ? momentum_bufs : TensorList{},
                TensorList{}, grad_scale, found_inf, maximize, keys,
                [&](int64_t, int64_t n, float* __restrict__ p, const float* __restrict__ g,
                    float gs, float* __restrict__ buf, float*) {
                  sgd_block(n, p, buf, g, gs, args, with_momentum);
                });
}

void adam_step_sr(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                  const TensorList& exp_avg_sqs, const at::Tensor& grad_scale,
                  const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double bias_correction1,
                  double bias_correction2, bool decoupled, bool maximize, uint64_t seed,
                  uint64_t step, const std::vector<int64_t>& tensor_ids,
                  const std::optional<at::Tensor>& steps) {
  check_sr_step_lists("adam_step_sr", params, grads, exp_avgs, exp_avg_sqs, true, true);
  const auto keys = sr_keys("adam_step_sr", seed, step, tensor_ids, params.size());
  const auto per_tensor = adam_args_per_tensor(
      "adam_step_sr", params, steps, lr, beta1, beta2,
      make_adam_args(lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
                     decoupled));
  sr_fused_step("adam_step_sr", params, grads, exp_avgs, exp_avg_sqs, grad_scale, found_inf,
                maximize, keys,
                [&](int64_t t, int64_t n, float* __restrict__ p, const float* __restrict__ g,
                    float gs, float* __restrict__ m, float* __restrict__ v) {
                  adam_block(n, p, m, v, g, gs, per_tensor[t]);
                });
}

void update_scale(const at::Tensor& state, const at::Tensor& scale32, const at::Tensor& inv32,
                  const std::optional<at::Tensor>& found_inf, bool found,
                  const std::optional<at::Tensor>& when, double growth_factor,
                  double backoff_factor, int64_t growth_interval, bool has_min, double min_scale,
                  double max_scale, int64_t hysteresis) {
  const ScaleUpdate u =
      check_scale_update(state, scale32, inv32, found_inf, when, growth_factor, backoff_factor,
                         growth_interval, has_min, min_scale, max_scale, hysteresis);
  AMP_CHECK(state.device().is_cpu(), "update_scale: the C++ backend takes CPU tensors, got ",
            state.device());
  const bool verdict = found_inf.has_value() && found_inf->defined() ? read_scalar(*found_inf) != 0.f
                                                                     : found;
  const bool apply = !(when.has_value() && when->defined()) || *when->data_ptr<bool>();
  update_scale_state(state.data_ptr<double>(), scale32.data_ptr<float>(), inv32.data_ptr<float>(),
                     verdict, apply, u);
}

}  // namespace amp_runner

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  AMP_RUNNER_BIND_OPS(m, amp_runner, "cpp");
}
