// The portable kernels' C++ ops, on torch's own thread pool: matrix products whose every element is one
// chain of fused multiply-adds (fma_chain.h, products.h), also of a convolution's columns read from its
// padded image without writing them out; a convolution's input gradient, its columns' product and col2im
// at once, and col2im alone (convolution.h); depthwise convolutions (depthwise.h); activations
// (activations.h); layer norm's and softmax's backward (normalization.h). This file holds the
// ops' entry points: their checks, and the choice of vector width and type. tasks/determinism/blas.py
// says why, builds this, and computes the same bytes in Python where it cannot be built (products:
// float32 only; convolutions: kernels.py's and depthwise.py's torch code).
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

namespace {

using Index = int64_t;

// Positions (image b, row r, column o), in that order, n x rows x cols of them, and where each lies in two
// channels-last tensors g and x, in elements from the first: a depthwise weight gradient's terms
// (depthwise_taps.h).
struct Walk {
  Index n, rows, cols, g_image, g_row, g_col, x_image, x_row, x_col;
};

// The activations of activations.h (tasks/determinism/activations.py numbers them alike).
enum Activation : int64_t { kSigmoid, kSilu, kSiluBackward, kGelu, kGeluBackward, kGeluTanh, kGeluTanhBackward };

// The code compiled for each vector width, in two namespaces, `narrow` and `wide`: the products'
// micro-kernel (fma_chain.h; Lanes<T> names the intrinsics of one width), channels-last depthwise loops
// (depthwise_taps.h), activations (activations.h) and normalizations (normalization.h). On x86-64 they are
// AVX2's 256 bits and AVX-512's 512; on arm64 both are NEON's 128 (SVE's lengths vary by chip: unused).
// The width changes no byte: each element is one lane of one chain, and every sum has one order.
#if defined(__x86_64__)
#include <immintrin.h>

#define LANES(T, VEC, P, S, ROWS)                                            \
  template <>                                                                \
  struct Lanes<T> {                                                          \
    using V = VEC;                                                           \
    static constexpr int W = sizeof(VEC) / sizeof(T), MR = ROWS;             \
    static V zero() { return P##_setzero_##S(); }                            \
    static V load(const T* p) { return P##_loadu_##S(p); }                   \
    static void store(T* p, V v) { P##_storeu_##S(p, v); }                   \
    static V set1(T x) { return P##_set1_##S(x); }                           \
    static V fma(V a, V b, V c) { return P##_fmadd_##S(a, b, c); }           \
    static V add(V a, V b) { return P##_add_##S(a, b); }                     \
  };

constexpr int64_t kNarrowBits = 256, kWideBits = 512;

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace narrow {
template <typename T>
struct Lanes;
LANES(float, __m256, _mm256, ps, 6)  // 6 x 2 accumulators of the 16 registers
LANES(double, __m256d, _mm256, pd, 6)
#include "fma_chain.h"
#include "depthwise_taps.h"
#include "activations.h"
#include "normalization.h"
#include "sampling.h"
}  // namespace narrow
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace wide {
template <typename T>
struct Lanes;
LANES(float, __m512, _mm512, ps, 12)  // 12 x 2 accumulators of the 32 registers
LANES(double, __m512d, _mm512, pd, 12)
#include "fma_chain.h"
#include "depthwise_taps.h"
#include "activations.h"
#include "normalization.h"
#include "sampling.h"
}  // namespace wide
#pragma GCC pop_options

bool has_wide() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

#elif defined(__aarch64__)
#include <arm_neon.h>

// NEON (every arm64 CPU has it, fused multiply-add included): vfmaq is the one rounding of AVX2's fmadd.
#define LANES(T, VEC, S, ROWS)                                               \
  template <>                                                                \
  struct Lanes<T> {                                                          \
    using V = VEC;                                                           \
    static constexpr int W = sizeof(VEC) / sizeof(T), MR = ROWS;             \
    static V zero() { return vdupq_n_##S(0); }                               \
    static V load(const T* p) { return vld1q_##S(p); }                       \
    static void store(T* p, V v) { vst1q_##S(p, v); }                        \
    static V set1(T x) { return vdupq_n_##S(x); }                            \
    static V fma(V a, V b, V c) { return vfmaq_##S(c, a, b); }               \
    static V add(V a, V b) { return vaddq_##S(a, b); }                       \
  };

constexpr int64_t kNarrowBits = 128, kWideBits = 128;

namespace narrow {
template <typename T>
struct Lanes;
LANES(float, float32x4_t, f32, 12)  // 12 x 2 accumulators of the 32 registers
LANES(double, float64x2_t, f64, 12)
#include "fma_chain.h"
#include "depthwise_taps.h"
#include "activations.h"
#include "normalization.h"
#include "sampling.h"
}  // namespace narrow
namespace wide = narrow;

bool has_wide() { return false; }

#else
#error "blas_pool.cpp: x86-64 (AVX2) or arm64 (NEON) only"
#endif

// The products' vector width for a call's `width` (kNarrowBits, kWideBits, or 0: the widest this CPU has).
int64_t vector_width(int64_t width) {
  TORCH_CHECK(width == 0 || width == kNarrowBits || width == kWideBits, "lockstep_blas: width 0, ", kNarrowBits,
              " or ", kWideBits, ", not ", width);
  TORCH_CHECK(width != kWideBits || width == kNarrowBits || has_wide(), "lockstep_blas: width ", kWideBits,
              " needs AVX-512, which this CPU lacks");
  return width == 0 ? (has_wide() ? kWideBits : kNarrowBits) : width;
}

// One operand's strides in its last two dimensions (rows, columns).
struct Operand {
  Index rows, cols;
};

Operand operand(const at::Tensor& t, const char* name) {
  const Index rows = t.size(1), cols = t.size(2), s0 = t.stride(1), s1 = t.stride(2);
  TORCH_CHECK((s1 == 1 && s0 >= std::max<Index>(1, cols)) || (s0 == 1 && s1 >= std::max<Index>(1, rows)),
              "lockstep_blas: ", name, " is neither row-major nor transposed");
  return {s0, s1};
}

#include "products.h"
#include "convolution.h"
#include "depthwise.h"

// f(T()) with T the C++ type of t's dtype: float32 or float64, refused otherwise.
template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) return f(float());
  TORCH_CHECK(t.scalar_type() == at::kDouble, "lockstep_blas: float32 or float64, not ", t.scalar_type());
  f(double());
}


// out[g] = a[g] @ b[g] for 2-D operands (one product) or 3-D (one per group: a grouped convolution's), with
// vectors `width` bits wide (vector_width's). The bytes do not depend on it.
// `bias`: a value per column of out, added to each of its elements after the product (addmm's bias).
void gemm_chunks(const at::Tensor& a2, const at::Tensor& b2, const at::Tensor& out2, int64_t dim, int64_t chunk,
                 int64_t width, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a2.dim() == b2.dim() && a2.dim() == out2.dim() && (a2.dim() == 2 || a2.dim() == 3),
              "lockstep_blas: 2-D or 3-D operands");
  const bool flat = a2.dim() == 2;
  const at::Tensor a = flat ? a2.unsqueeze(0) : a2, b = flat ? b2.unsqueeze(0) : b2;
  const at::Tensor out = flat ? out2.unsqueeze(0) : out2;
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(0) == out.size(0), "lockstep_blas: group counts do not match");
  TORCH_CHECK(a.size(2) == b.size(1) && out.size(1) == a.size(1) && out.size(2) == b.size(2),
              "lockstep_blas: shapes do not match");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == out.scalar_type(), "lockstep_blas: dtypes");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) >= std::max<Index>(1, out.size(2)), "lockstep_blas: out row-major");
  TORCH_CHECK((dim == 0 || dim == 1) && chunk > 0, "lockstep_blas: dim 0 or 1, chunk > 0");
  const int64_t use = vector_width(width);
  const Operand sa = operand(a, "a"), sb = operand(b, "b");
  const Index groups = a.size(0), m = a.size(1), k = a.size(2);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out.size(2) && bias->is_contiguous() &&
                        bias->scalar_type() == a.scalar_type()),
              "lockstep_blas: bias: one contiguous value per column of out, in its dtype");
  by_dtype(a, [&](auto zero) {
    using T = decltype(zero);
    const T* pa = a.data_ptr<T>();
    run<T>(use, groups, m, k, [&](Index g) { return Matrix<T>{pa + g * a.stride(0), sa}; }, b, sb, out, dim, chunk,
           bias ? bias->data_ptr<T>() : nullptr);
  });
}

// The widest vectors gemm_chunks uses on this CPU (for the fingerprint).
int64_t widest() { return has_wide() ? kWideBits : kNarrowBits; }

// out = columns @ b, or (transposed) columns^T @ b, for the columns of a convolution (without groups) over
// `image`, padded and channels-last: the products gemm_chunks makes of im2col's columns, the same bytes,
// without writing the columns out (each strip of them is gathered where the kernel reads it).
void field_chunks(const at::Tensor& image, const at::Tensor& b, const at::Tensor& out, int64_t kh, int64_t kw,
                  int64_t sh, int64_t sw, int64_t dh, int64_t dw, bool transposed, int64_t dim, int64_t chunk,
                  int64_t width) {
  TORCH_CHECK(image.dim() == 4 && image.is_contiguous(), "lockstep_blas: fields: a contiguous (N, H, W, C) image");
  TORCH_CHECK(b.dim() == 2 && out.dim() == 2, "lockstep_blas: fields: 2-D b and out");
  TORCH_CHECK(image.scalar_type() == b.scalar_type() && b.scalar_type() == out.scalar_type(), "lockstep_blas: dtypes");
  TORCH_CHECK(kh > 0 && kw > 0 && sh > 0 && sw > 0 && dh > 0 && dw > 0, "lockstep_blas: fields: geometry");
  TORCH_CHECK((dim == 0 || dim == 1) && chunk > 0, "lockstep_blas: dim 0 or 1, chunk > 0");
  const FieldTables t = field_tables(image, kh, kw, sh, sw, dh, dw);
  const Index positions = t.position.size(), offsets = t.offset.size();
  const Index m = transposed ? offsets : positions, k = transposed ? positions : offsets;
  TORCH_CHECK(b.size(0) == k && out.size(0) == m && out.size(1) == b.size(1), "lockstep_blas: fields: shapes");
  TORCH_CHECK(out.stride(1) == 1 && out.stride(0) >= std::max<Index>(1, out.size(1)), "lockstep_blas: out row-major");
  const at::Tensor b3 = b.unsqueeze(0), out3 = out.unsqueeze(0);
  const Operand sb = operand(b3, "b");
  const int64_t use = vector_width(width);
  by_dtype(image, [&](auto zero) {
    using T = decltype(zero);
    const Fields<T> fields{image.data_ptr<T>(), t.position.data(), t.offset.data(), t.run.data(), transposed};
    run<T>(use, 1, m, k, [&](Index) { return fields; }, b3, sb, out3, dim, chunk);
  });
}

void padded_image(const at::Tensor& x, const at::Tensor& out, int64_t ph, int64_t pw) {
  TORCH_CHECK(x.dim() == 4 && out.dim() == 4 && out.is_contiguous(), "lockstep_blas: padded_image: 4-D, out contiguous");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lockstep_blas: dtypes");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(3) == x.size(1) && out.size(1) == x.size(2) + 2 * ph &&
                  out.size(2) == x.size(3) + 2 * pw,
              "lockstep_blas: padded_image: out is not x's size with its padding, channels-last");
  by_dtype(x, [&](auto zero) { pad<decltype(zero)>(x, out, ph, pw); });
}

void input_gradient_op(const at::Tensor& grad, const at::Tensor& weight, const at::Tensor& out, int64_t kh, int64_t kw,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t width) {
  TORCH_CHECK(grad.dim() == 2 && weight.dim() == 2 && out.dim() == 4, "lockstep_blas: input_gradient: 2-D, 2-D, 4-D");
  TORCH_CHECK(grad.scalar_type() == weight.scalar_type() && grad.scalar_type() == out.scalar_type(),
              "lockstep_blas: dtypes");
  TORCH_CHECK(kh > 0 && kw > 0 && sh > 0 && sw > 0 && ph >= 0 && pw >= 0 && dh > 0 && dw > 0,
              "lockstep_blas: input_gradient: geometry");
  const Index oh = out_size(out.size(2), kh, sh, ph, dh), ow = out_size(out.size(3), kw, sw, pw, dw);
  TORCH_CHECK(oh > 0 && ow > 0 && grad.size(0) == out.size(0) * oh * ow && weight.size(0) == grad.size(1) &&
                  weight.size(1) == kh * kw * out.size(1),
              "lockstep_blas: input_gradient: shapes do not follow from the geometry");
  TORCH_CHECK(grad.stride(1) == 1 && weight.stride(1) == 1, "lockstep_blas: input_gradient: row-major grad and weight");
  const int64_t use = vector_width(width);
  const Geometry k{sh, sw, ph, pw, dh, dw};
  by_dtype(grad, [&](auto zero) { input_gradient<decltype(zero)>(use, grad, weight, out, oh, ow, kh, kw, k); });
}

void gather_columns(const at::Tensor& fields, const at::Tensor& out, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                    int64_t dh, int64_t dw) {
  const Geometry k = fields_of(out, fields, sh, sw, ph, pw, dh, dw);
  by_dtype(out, [&](auto zero) { gather_fields<decltype(zero)>(fields, out, k); });
}

// Which of the three a call computes (`part`): 0 the output (a = x, b = w), 1 the input gradient (a = g,
// b = w), 2 the weight gradient (a = g, b = x); written into `out`. `last`: the activations (all but w) are
// channels-last, else contiguous. `width`: as gemm_chunks' (the channels-last loops' vectors).
void depthwise(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t part, int64_t sh, int64_t sw,
               int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool last, int64_t width) {
  TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && out.dim() == 4, "lockstep_blas: depthwise: 4-D tensors");
  TORCH_CHECK(part >= 0 && part <= 2 && sh > 0 && sw > 0 && ph >= 0 && pw >= 0 && dh > 0 && dw > 0,
              "lockstep_blas: depthwise arguments");
  const at::Tensor& image = part == 0 ? a : (part == 1 ? out : b);  // x, or the input gradient
  const at::Tensor& small = part == 0 ? out : a;                    // the output, or its gradient
  const at::Tensor& kernel = part == 2 ? out : b;                   // w, or the weight gradient
  const auto layout = last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  TORCH_CHECK(image.is_contiguous(layout) && small.is_contiguous(layout) && kernel.is_contiguous(),
              "lockstep_blas: depthwise: contiguous", last ? " (activations channels-last)" : "");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == out.scalar_type(), "lockstep_blas: dtypes");
  TORCH_CHECK(image.size(0) == small.size(0) && image.size(1) == small.size(1) && kernel.size(0) == small.size(1) &&
                  kernel.size(1) == 1,
              "lockstep_blas: depthwise: shapes do not match");
  TORCH_CHECK(small.size(2) == out_size(image.size(2), kernel.size(2), sh, ph, dh) &&
                  small.size(3) == out_size(image.size(3), kernel.size(3), sw, pw, dw),
              "lockstep_blas: depthwise: the output's size does not follow from the geometry");
  const Geometry k{sh, sw, ph, pw, dh, dw};
  const bool use_wide = vector_width(width) == kWideBits;
  by_dtype(a, [&](auto zero) {
    using T = decltype(zero);
    if (part == 0) {
      last ? depthwise_last<T, false>(out, b, a, k, use_wide) : depthwise_offsets<T, false>(out, b, a, k);
    } else if (part == 1) {
      last ? depthwise_last<T, true>(a, b, out, k, use_wide) : depthwise_offsets<T, true>(a, b, out, k);
    } else {
      last ? depthwise_weight_gradient_last<T>(a, b, out, k, use_wide) : depthwise_weight_gradient<T>(a, b, out, k);
    }
  });
}

// out = activation `kind` (activations.h) of x, or of a backward one, its gradient given g (the gradient of
// its output); float32, contiguous, one shape. `width` as gemm_chunks' (the bytes do not depend on it, nor
// on how the elements are shared out).
void activation(const at::Tensor& x, const std::optional<at::Tensor>& g, const at::Tensor& out, int64_t kind,
                int64_t width) {
  TORCH_CHECK(kind >= kSigmoid && kind <= kGeluTanhBackward, "lockstep_blas: activation: no kind ", kind);
  const bool backward = kind == kSiluBackward || kind == kGeluBackward || kind == kGeluTanhBackward;
  TORCH_CHECK(backward == g.has_value(), "lockstep_blas: activation: a gradient for the backward kinds only");
  for (const at::Tensor* t : {&x, &out, g ? &*g : &x}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == x.sizes(),
                "lockstep_blas: activation: float32 tensors, contiguous, of one shape");
  }
  const float* px = x.data_ptr<float>();
  const float* pg = g ? g->data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const bool use_wide = vector_width(width) == kWideBits;
  at::parallel_for(0, x.numel(), 16384, [&](int64_t first, int64_t last) {
    const Index n = last - first;
    use_wide ? wide::activate(kind, px + first, pg ? pg + first : nullptr, po + first, n)
         : narrow::activate(kind, px + first, pg ? pg + first : nullptr, po + first, n);
  });
}

// Box-Muller (sampling.h) of float32 uniform draws in [0, 1), 16 per chunk, into `out`, on torch's threads; the
// vector width changes no byte.
void box_muller(const at::Tensor& u, const at::Tensor& out, int64_t width) {
  for (const at::Tensor* t : {&u, &out}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == u.sizes() && u.numel() % 16 == 0,
                "lockstep_blas: box_muller: float32 tensors, contiguous, of one shape, in chunks of 16 values");
  }
  const float* pu = u.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const bool use_wide = vector_width(width) == kWideBits;
  at::parallel_for(0, u.numel() / 16, 1024, [&](int64_t first, int64_t last) {
    use_wide ? wide::box_muller_chunks(pu + 16 * first, po + 16 * first, last - first)
             : narrow::box_muller_chunks(pu + 16 * first, po + 16 * first, last - first);
  });
}

// Rows per block of layer norm's column sums (normalization.h; normalization.py's BLOCK_ROWS): the blocks are
// shared among the threads, their sums added in order after.
constexpr Index kBlockRows = 64;

// t is float32, contiguous, with `count` elements: the checks of the ops below, whose shapes the caller made.
void check_floats(const at::Tensor& t, Index count, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == count, "lockstep_blas: ", what,
              ": float32 tensors, contiguous, of the sizes documented");
}

// Layer norm's backward (normalization.h) of (rows, n) float32 tensors dy and x, contiguous, given each row's
// mean and rstd (rows): its input gradient into dx, its weight's (the sum over the rows of dy x-hat) into dw
// and its bias's (of dy) into db, each only if given; w (n), the weight, or none. `width` as gemm_chunks'
// (the bytes depend on neither it nor the thread count).
void layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                         const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& dx,
                         const std::optional<at::Tensor>& dw, const std::optional<at::Tensor>& db, int64_t width) {
  TORCH_CHECK(x.dim() == 2, "lockstep_blas: layer_norm_backward: x is (rows, n)");
  const Index rows = x.size(0), n = x.size(1), blocks = (rows + kBlockRows - 1) / kBlockRows;
  for (const at::Tensor* t : {&x, &dy, dx ? &*dx : &x}) check_floats(*t, rows * n, "layer_norm_backward");
  for (const at::Tensor* t : {&mean, &rstd}) check_floats(*t, rows, "layer_norm_backward");
  for (const auto* t : {&w, &dw, &db}) {
    if (t->has_value()) check_floats(**t, n, "layer_norm_backward");
  }
  std::vector<float> sums_w(dw ? blocks * n : 0, 0.0f), sums_b(db ? blocks * n : 0, 0.0f);
  const bool use_wide = vector_width(width) == kWideBits;
  const float* pw = w ? w->data_ptr<float>() : nullptr;
  float* pdx = dx ? dx->data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (Index k = first; k < last; ++k) {
      const Index top = k * kBlockRows, end = std::min(rows, top + kBlockRows);
      float* bw = dw ? sums_w.data() + k * n : nullptr;
      float* bb = db ? sums_b.data() + k * n : nullptr;
      (use_wide ? wide::layer_norm_rows : narrow::layer_norm_rows)(dy.data_ptr<float>(), x.data_ptr<float>(),
                                                               mean.data_ptr<float>(), rstd.data_ptr<float>(), pw,
                                                               pdx, bw, bb, top, end, n);
      for (Index j = 0; end - top < kBlockRows && j < n; ++j) {  // a short block: as if padded with zero rows
        if (bw) bw[j] = bw[j] + 0.0f;
        if (bb) bb[j] = bb[j] + 0.0f;
      }
    }
  });
  for (auto [out, sums] : {std::pair{&dw, &sums_w}, std::pair{&db, &sums_b}}) {
    if (!out->has_value()) continue;
    float* o = (*out)->data_ptr<float>();
    std::fill(o, o + n, 0.0f);
    for (Index k = 0; k < blocks; ++k) {
      for (Index j = 0; j < n; ++j) o[j] = o[j] + (*sums)[k * n + j];
    }
  }
}

// Softmax's input gradient (normalization.h) along the last dimension of (rows, n) float32 tensors, contiguous:
// out = y (dy - the row's sum of dy y). `width` as gemm_chunks'.
void softmax_backward(const at::Tensor& dy, const at::Tensor& y, const at::Tensor& out, int64_t width) {
  TORCH_CHECK(y.dim() == 2, "lockstep_blas: softmax_backward: y is (rows, n)");
  for (const at::Tensor* t : {&y, &dy, &out}) check_floats(*t, y.numel(), "softmax_backward");
  const Index n = y.size(1);
  const bool use_wide = vector_width(width) == kWideBits;
  at::parallel_for(0, y.size(0), std::max<Index>(1, 16384 / std::max<Index>(1, n)), [&](int64_t first, int64_t last) {
    (use_wide ? wide::softmax_backward_rows : narrow::softmax_backward_rows)(
        dy.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), first, last, n);
  });
}

// Channels per block of halving_sums: a block's scratch is (A, B, kHalvingChannels) floats, its adds vectorised
// across the channels (each channel's own adds, in reductions.py's order, whatever the vectors).
constexpr Index kHalvingChannels = 8;
constexpr Index kHalvingColumns = 4096;  // b's per chunk of halving_sums' A tree

// Each channel's sum of a term of x (A, C, B), any strides, float32, none empty, over A and B: reductions.py's `halve`
// along A (element i and i + ceil(n/2) added, the middle of an odd n carried, until one is left), then
// along B, every add the one the torch code does, so that the two give the same bytes. The term: x (kind 0),
// (x - m[c])^2 (kind 1), or g (x - m[c]) s[c] (kind 2, g as x), each operation rounded once. Channels are
// shared among the threads in whole blocks (a channel's adds are its own: no thread count changes them).
void halving_sums(const at::Tensor& x, const std::optional<at::Tensor>& g, const std::optional<at::Tensor>& m,
                  const std::optional<at::Tensor>& s, const at::Tensor& out, int64_t kind) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "lockstep_blas: halving_sums: x is float32 (A, C, B)");
  TORCH_CHECK(0 <= kind && kind <= 2, "lockstep_blas: halving_sums: kind is 0, 1 or 2");
  TORCH_CHECK(x.numel() > 0, "lockstep_blas: halving_sums: x is empty (its sum is the caller's zeros)");
  const Index A = x.size(0), C = x.size(1), B = x.size(2);
  check_floats(out, C, "halving_sums");
  TORCH_CHECK(kind == 0 || (m && m->numel() == C && m->scalar_type() == at::kFloat && m->is_contiguous()),
              "lockstep_blas: halving_sums: m is float32 (C), contiguous");
  TORCH_CHECK(kind != 2 || (s && s->numel() == C && s->scalar_type() == at::kFloat && s->is_contiguous() && g &&
                            g->sizes() == x.sizes() && g->scalar_type() == at::kFloat),
              "lockstep_blas: halving_sums: s is float32 (C), contiguous, and g float32 shaped as x");
  const float* px = x.data_ptr<float>();
  const float* pg = kind == 2 ? g->data_ptr<float>() : nullptr;
  const float* pm = kind != 0 ? m->data_ptr<float>() : nullptr;
  const float* ps = kind == 2 ? s->data_ptr<float>() : nullptr;
  const Index xa = x.stride(0), xc = x.stride(1), xb = x.stride(2);
  const Index ga = pg ? g->stride(0) : 0, gc = pg ? g->stride(1) : 0, gb = pg ? g->stride(2) : 0;
  float* po = out.data_ptr<float>();
  const Index blocks = (C + kHalvingChannels - 1) / kHalvingChannels;
  constexpr Index K = kHalvingChannels;
  // A's tree is each (b, channel)'s own: it runs on chunks of kHalvingColumns b's at a time (scratch that
  // stays in the core's cache), each chunk's result a stretch of the row that B's tree then halves
  const Index chunk = std::max<Index>(1, std::min<Index>(B, kHalvingColumns));
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    std::unique_ptr<float[]> scratch(new float[A * chunk * K]), row(new float[B * K]);  // (unfilled)
    float* t = scratch.get();
    float* r = row.get();
    for (Index block = first; block < last; ++block) {
      const Index c0 = block * K, width = std::min(K, C - c0);
      for (Index b0 = 0; b0 < B; b0 += chunk) {
        const Index bn = std::min(chunk, B - b0), plane = bn * K;
        for (Index a = 0; a < A; ++a) {  // t[a][k][b - b0] = the term at (a, c0 + k, b)
          for (Index k = 0; k < K; ++k) {
            const Index c = c0 + k;
            float* into = t + a * plane + k * bn;
            if (k >= width) {  // (a short last block: lanes unused)
              std::fill(into, into + bn, 0.0f);
              continue;
            }
            const float* xs = px + a * xa + c * xc + b0 * xb;
            const float* gs = pg ? pg + a * ga + c * gc + b0 * gb : nullptr;
            if (kind == 0 && xb == 1) {  // (the contiguous case apart: vectorised)
              std::memcpy(into, xs, bn * sizeof(float));
            } else if (kind == 0) {
              for (Index b = 0; b < bn; ++b) into[b] = xs[b * xb];
            } else if (kind == 1 && xb == 1) {
              for (Index b = 0; b < bn; ++b) into[b] = (xs[b] - pm[c]) * (xs[b] - pm[c]);
            } else if (kind == 1) {
              for (Index b = 0; b < bn; ++b) into[b] = (xs[b * xb] - pm[c]) * (xs[b * xb] - pm[c]);
            } else if (xb == 1 && gb == 1) {
              for (Index b = 0; b < bn; ++b) into[b] = gs[b] * ((xs[b] - pm[c]) * ps[c]);
            } else {
              for (Index b = 0; b < bn; ++b) into[b] = gs[b * gb] * ((xs[b * xb] - pm[c]) * ps[c]);
            }
          }
        }
        for (Index n = A; n > 1;) {  // along A: planes of (channels, b)
          const Index pairs = n / 2, kept = n - pairs;
          for (Index i = 0; i < pairs; ++i) {
            float* to = t + i * plane;
            const float* from = t + (i + kept) * plane;
            for (Index j = 0; j < plane; ++j) to[j] = to[j] + from[j];
          }
          n = kept;
        }
        for (Index k = 0; k < K; ++k) std::memcpy(r + k * B + b0, t + k * bn, bn * sizeof(float));
      }
      for (Index k = 0; k < width; ++k) {  // then along B, each channel's row
        float* rk = r + k * B;
        for (Index n = B; n > 1;) {
          const Index pairs = n / 2, kept = n - pairs;
          for (Index i = 0; i < pairs; ++i) rk[i] = rk[i] + rk[i + kept];
          n = kept;
        }
      }
      for (Index k = 0; k < width; ++k) po[c0 + k] = r[k * B];
    }
  });
}

// out (B, C, R1, R2) = x (B, R1, R2, C) (rotate_last): any strides, any dtype, no overlap.
void rotated_copy(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 4 && out.dim() == 4 && x.scalar_type() == out.scalar_type(),
              "lockstep_blas: rotated_copy: 4-D tensors of one dtype");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == x.size(3) && out.size(2) == x.size(1) &&
                  out.size(3) == x.size(2),
              "lockstep_blas: rotated_copy: out is not (B, C, R1, R2) for x (B, R1, R2, C)");
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, x);
  switch (x.element_size()) {
    case 1: return rotate_last<uint8_t>(x, out);
    case 2: return rotate_last<uint16_t>(x, out);
    case 4: return rotate_last<uint32_t>(x, out);
    case 8: return rotate_last<uint64_t>(x, out);
    default: TORCH_CHECK(false, "lockstep_blas: rotated_copy: elements of 1, 2, 4 or 8 bytes");
  }
}

}  // namespace

TORCH_LIBRARY(lockstep_blas, m) {
  m.def("gemm_chunks(Tensor a, Tensor b, Tensor(a!) out, int dim, int chunk, int width=0, Tensor? bias=None) -> ()",
        gemm_chunks);
  m.def("widest() -> int", widest);
  m.def(
      "field_chunks(Tensor image, Tensor b, Tensor(a!) out, int kh, int kw, int sh, int sw, int dh, int dw, "
      "bool transposed, int dim, int chunk, int width=0) -> ()",
      field_chunks);
  m.def("padded_image(Tensor x, Tensor(a!) out, int ph, int pw) -> ()", padded_image);
  m.def(
      "input_gradient(Tensor grad, Tensor weight, Tensor(a!) out, int kh, int kw, int sh, int sw, int ph, int pw, "
      "int dh, int dw, int width=0) -> ()",
      input_gradient_op);
  m.def("gather_columns(Tensor fields, Tensor(a!) out, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
        gather_columns);
  m.def(
      "depthwise(Tensor a, Tensor b, Tensor(a!) out, int part, int sh, int sw, int ph, int pw, int dh, int dw, "
      "bool last=False, int width=0) -> ()",
      depthwise);
  m.def("activation(Tensor x, Tensor? g, Tensor(a!) out, int kind, int width=0) -> ()", activation);
  m.def("rotated_copy(Tensor x, Tensor(a!) out) -> ()", rotated_copy);
  m.def(
      "layer_norm_backward(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? w, Tensor(a!)? dx, Tensor(b!)? dw, "
      "Tensor(c!)? db, int width=0) -> ()",
      layer_norm_backward);
  m.def("halving_sums(Tensor x, Tensor? g, Tensor? m, Tensor? s, Tensor(a!) out, int kind) -> ()", halving_sums);
  m.def("softmax_backward(Tensor dy, Tensor y, Tensor(a!) out, int width=0) -> ()", softmax_backward);
  m.def("box_muller(Tensor u, Tensor(a!) out, int width=0) -> ()", box_muller);
}
