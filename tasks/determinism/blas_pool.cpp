// The portable kernels' C++ ops: matrix products whose every element is one chain of fused
// multiply-adds (below), run on torch's own thread pool; a convolution's im2col and col2im; depthwise
// convolutions. tasks/determinism/blas.py says why, builds this, and computes the same bytes in Python
// where it cannot be built (products: float32 only; col2im and depthwise: kernels.py's and depthwise.py's
// torch loops).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using Index = int64_t;

// The micro-kernel for each vector width (fma_chain.h): Lanes<T> names the intrinsics of one width.
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
  };

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
template <typename T>
struct Lanes;
LANES(float, __m256, _mm256, ps, 6)  // 6 x 2 accumulators of the 16 registers
LANES(double, __m256d, _mm256, pd, 6)
#include "fma_chain.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
template <typename T>
struct Lanes;
LANES(float, __m512, _mm512, ps, 12)  // 12 x 2 accumulators of the 32 registers
LANES(double, __m512d, _mm512, pd, 12)
#include "fma_chain.h"
}  // namespace avx512
#pragma GCC pop_options

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
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

template <typename T>
using Kernel = void (*)(Index, const T*, Index, const T*, T*, Index, bool);

// A panel: to[q * P + i] = from[i * across + q * along] for the `count` <= P lines i and kc steps q,
// zeros for lines past `count` (an edge tile's). Read in whichever order is contiguous in `from`.
template <typename T, int P>
void pack(T* to, const T* from, Index across, Index along, Index count, Index kc) {
  if (count < P) std::fill(to, to + kc * P, T(0));
  if (along == 1) {
    for (Index i = 0; i < count; ++i)
      for (Index q = 0; q < kc; ++q) to[q * P + i] = from[i * across + q];
  } else {
    for (Index q = 0; q < kc; ++q)
      for (Index i = 0; i < count; ++i) to[q * P + i] = from[i * across + q * along];
  }
}

// c (m x n, row stride ldc) = a (m x k) @ b (k x n), each element the micro-kernel's chain over all of k.
// The usual blocking (BLIS's): b in blocks of KC x NC packed into panels NR wide, so that the kernel
// reads them in order from cache; a read in place, by the kernel that suits its layout (`rows` for a
// row-major a, `panel` for a transposed one: a is read once per NR columns of the result, and packing
// it cost more than it saved), or packed where a tile has fewer than MR rows. Blocks and edges decide
// only where the chain is computed, never its order: a block of k carries each element's chain on from
// the value stored in c (exact, in T), and edge tiles run the same kernel on zero-padded panels and a
// copy of c's corner. Why a kernel of our own and not a BLAS: no BLAS promises an order, and OpenBLAS's
// own kernels do not keep one from one instruction set to the next, so the bytes followed its kernel
// choice and held only while every CPU ran its AVX2 kernels, also where AVX-512 ones are faster.
template <typename T, int MR, int NR>
void chain_product(Kernel<T> rows, Kernel<T> panel, Index m, Index n, Index k, const T* a, Operand sa, const T* b,
                   Operand sb, T* c, Index ldc) {
  constexpr Index KC = 256, NC = 256;  // b's block: 256 KiB in float32, within a 512 KiB L2
  static_assert(NC % NR == 0);
  thread_local std::vector<T> pa, pb;
  pa.resize(MR * KC), pb.resize(KC * NC);
  T edge[MR * NR];
  if (k == 0) {  // no terms: every chain is its starting zero
    for (Index i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, T(0));
    return;
  }
  const bool row_major = sa.cols == 1;
  for (Index jc = 0; jc < n; jc += NC) {
    const Index nc = std::min(NC, n - jc);
    for (Index pc = 0; pc < k; pc += KC) {
      const Index kc = std::min(KC, k - pc);
      for (Index jr = 0; jr < nc; jr += NR)  // b's panels: NR values per k
        pack<T, NR>(pb.data() + jr * kc, b + pc * sb.rows + (jc + jr) * sb.cols, sb.cols, sb.rows,
                    std::min<Index>(NR, nc - jr), kc);
      for (Index ir = 0; ir < m; ir += MR) {
        const Index h = std::min<Index>(MR, m - ir);
        const T* from = a + ir * sa.rows + pc * sa.cols;
        Kernel<T> kernel = row_major ? rows : panel;
        Index step = row_major ? sa.rows : sa.cols;
        if (h < MR) {
          pack<T, MR>(pa.data(), from, sa.rows, sa.cols, h, kc);
          from = pa.data(), kernel = panel, step = MR;
        }
        for (Index jr = 0; jr < nc; jr += NR) {
          const Index w = std::min<Index>(NR, nc - jr);
          T* tile = c + ir * ldc + jc + jr;
          if (h == MR && w == NR) {
            kernel(kc, from, step, pb.data() + jr * kc, tile, ldc, pc == 0);
            continue;
          }
          for (Index i = 0; i < h && pc > 0; ++i) std::memcpy(edge + i * NR, tile + i * ldc, w * sizeof(T));
          kernel(kc, from, step, pb.data() + jr * kc, edge, NR, pc == 0);
          for (Index i = 0; i < h; ++i) std::memcpy(tile + i * ldc, edge + i * NR, w * sizeof(T));
        }
      }
    }
  }
}

// One product (or a chunk of one) on the calling thread, with the widest kernel `width` allows.
template <typename T>
void product(int64_t width, Index m, Index n, Index k, const T* a, Operand sa, const T* b, Operand sb, T* c,
             Index ldc) {
  if (width == 512) {
    using L = avx512::Lanes<T>;
    chain_product<T, L::MR, 2 * L::W>(avx512::micro_kernel<T, true>, avx512::micro_kernel<T, false>, m, n, k, a, sa,
                                      b, sb, c, ldc);
  } else {
    using L = avx2::Lanes<T>;
    chain_product<T, L::MR, 2 * L::W>(avx2::micro_kernel<T, true>, avx2::micro_kernel<T, false>, m, n, k, a, sa, b,
                                      sb, c, ldc);
  }
}

// Every group's product cut into chunks (by shape: blas.py's plan), and the (group, chunk) pairs shared
// out on torch's pool, each computed on one thread.
template <typename T>
void run(int64_t width, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t dim, int64_t chunk) {
  const Index groups = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const Operand sa = operand(a, "a"), sb = operand(b, "b");
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* pc = out.data_ptr<T>();
  const Index ga = a.stride(0), gb = b.stride(0), gc = out.stride(0), ldc = out.stride(1);
  const Index extent = dim == 0 ? m : n;
  const Index chunks = (extent + chunk - 1) / chunk;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const Index g = task / chunks, start = (task % chunks) * chunk, size = std::min<Index>(chunk, extent - start);
      const T *ag = pa + g * ga, *bg = pb + g * gb;
      T* cg = pc + g * gc;
      if (dim == 0) {  // rows of out: rows of a
        product<T>(width, size, n, k, ag + start * sa.rows, sa, bg, sb, cg + start * ldc, ldc);
      } else {  // columns of out: columns of b
        product<T>(width, m, size, k, ag, sa, bg + start * sb.cols, sb, cg + start, ldc);
      }
    }
  });
}

// out[g] = a[g] @ b[g] for 2-D operands (one product) or 3-D (one per group: a grouped convolution's), with
// vectors `width` bits wide (256, 512, or 0: the widest this CPU has). The bytes do not depend on it.
void gemm_chunks(const at::Tensor& a2, const at::Tensor& b2, const at::Tensor& out2, int64_t dim, int64_t chunk,
                 int64_t width) {
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
  TORCH_CHECK(width == 0 || width == 256 || width == 512, "lockstep_blas: width 0, 256 or 512, not ", width);
  TORCH_CHECK(width != 512 || has_avx512(), "lockstep_blas: width 512 needs AVX-512, which this CPU lacks");
  const int64_t use = width == 0 ? (has_avx512() ? 512 : 256) : width;
  if (a.scalar_type() == at::kFloat) {
    run<float>(use, a, b, out, dim, chunk);
  } else {
    TORCH_CHECK(a.scalar_type() == at::kDouble, "lockstep_blas: float32 or float64");
    run<double>(use, a, b, out, dim, chunk);
  }
}

// The widest vectors gemm_chunks uses on this CPU (for the fingerprint).
int64_t widest() { return has_avx512() ? 512 : 256; }

// The positions o in [0, extent) of an output row (or column) whose input position o * stride + offset
// lies in [0, size): [first, last), empty when first >= last.
struct Span {
  Index first, last;
};

Span span(Index size, Index extent, Index stride, Index offset) {
  const Index first = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  const Index last = size - 1 - offset < 0 ? 0 : std::min<Index>(extent, (size - 1 - offset) / stride + 1);
  return {first, last};
}

struct Geometry {
  Index sh, sw, ph, pw, dh, dw;
};

// A convolution's output size along one side (depthwise.out_size's formula).
Index out_size(Index size, Index kernel, Index stride, Index pad, Index dilation) {
  return (size + 2 * pad - dilation * (kernel - 1) - 1) / stride + 1;
}

// im2col without groups: out (N, oh, ow, kh, kw, C), contiguous, every receptive field of x (N, C, H, W,
// any strides) as a row, channels fastest, zeros where it reaches the padding. An image at a time (images
// in parallel): first transposed into a zero-bordered channels-last buffer, then its rows copied out in
// runs of kw * C values. Only copies: the values are x's.
template <typename T>
void image_fields(const at::Tensor& x, const at::Tensor& out, Geometry k) {
  const Index c = x.size(1), h = x.size(2), wd = x.size(3);
  const Index oh = out.size(1), ow = out.size(2), kh = out.size(3), kw = out.size(4);
  const Index x0 = x.stride(0), x1 = x.stride(1), x2 = x.stride(2), x3 = x.stride(3);
  const Index hp = h + 2 * k.ph, wp = wd + 2 * k.pw, run = k.dw == 1 ? kw * c : c;
  const T* px = x.data_ptr<T>();
  T* po = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t first, int64_t last) {
    std::vector<T> image(std::max<Index>(1, hp * wp * c));
    for (int64_t b = first; b < last; ++b) {
      std::fill(image.begin(), image.end(), T(0));
      for (Index y = 0; y < h; ++y) {
        T* to = image.data() + ((y + k.ph) * wp + k.pw) * c;
        for (Index ch = 0; ch < c; ++ch) {
          const T* from = px + b * x0 + ch * x1 + y * x2;
          for (Index q = 0; q < wd; ++q) to[q * c + ch] = from[q * x3];
        }
      }
      T* dst = po + b * oh * ow * kh * kw * c;
      for (Index y = 0; y < oh; ++y) {
        for (Index q = 0; q < ow; ++q) {
          for (Index i = 0; i < kh; ++i) {
            const T* src = image.data() + ((y * k.sh + i * k.dh) * wp + q * k.sw) * c;
            for (Index j = 0; j < kw; j += run / c) {
              std::copy(src + j * k.dw * c, src + j * k.dw * c + run, dst);
              dst += run;
            }
          }
        }
      }
    }
  });
}

// col2im, gathered: out (N, C, H, W), any strides, the input gradient of the fields (N, oh, ow, kh, kw, C),
// any strides: each of its elements is the sum, from zero, of the fields' values read from its position,
// in the order of the kernel offsets (i, then j). That is the order in which kernels.py's loop of strided
// adds into a zeroed, padded image adds them, so the bytes are the same; terms that fall on the padding
// are not computed at all. One row of an image (every channel) at a time: summed channels innermost in a
// buffer, then written out once, transposed. Rows run in parallel; no two threads write one element.
template <typename T>
void gather_fields(const at::Tensor& fields, const at::Tensor& out, Geometry k) {
  const Index oh = fields.size(1), ow = fields.size(2), kh = fields.size(3), kw = fields.size(4), c = fields.size(5);
  const Index h = out.size(2), wd = out.size(3);
  const Index f0 = fields.stride(0), f1 = fields.stride(1), f2 = fields.stride(2), f3 = fields.stride(3),
              f4 = fields.stride(4), f5 = fields.stride(5);
  const Index o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2), o3 = out.stride(3);
  const T* pf = fields.data_ptr<T>();
  T* po = out.data_ptr<T>();
  // A field row read in one sequential pass: the offsets of one row of the input are a third (or so) of
  // each field row's values, strided; read that way from memory, the rows cost several times a whole pass.
  // So the field rows in use (a window of them) are copied whole into a buffer when first needed.
  const bool whole_rows = f5 == 1 && f4 == c && f3 == kw * c && f2 == kh * kw * c;
  const Index window = (kh - 1) * k.dh / k.sh + 1, row_size = ow * kh * kw * c;
  at::parallel_for(0, out.size(0) * h, 1, [&](int64_t first, int64_t last) {
    std::vector<T> row(std::max<Index>(1, wd * c));
    std::vector<T> rows(whole_rows ? window * row_size : 1);
    std::vector<Index> held(window, -1);  // which (image, field row) each slot of `rows` holds
    for (int64_t r = first; r < last; ++r) {
      const Index b = r / h, p = r % h;
      std::fill(row.begin(), row.end(), T(0));
      for (Index i = 0; i < kh; ++i) {
        const Index ys = p + k.ph - i * k.dh;  // y * sh, for the field row y that read this row
        if (ys < 0 || ys % k.sh != 0 || ys / k.sh >= oh) continue;
        const Index y = ys / k.sh;
        const T* field_row = pf + b * f0 + y * f1;
        if (whole_rows) {
          T* slot = rows.data() + (y % window) * row_size;
          if (held[y % window] != b * oh + y) {
            std::copy(field_row, field_row + row_size, slot);
            held[y % window] = b * oh + y;
          }
          field_row = slot;
        }
        for (Index j = 0; j < kw; ++j) {
          const T* src = field_row + i * f3 + j * f4;
          const Span xs = span(wd, ow, k.sw, j * k.dw - k.pw);
          for (Index x = xs.first; x < xs.last; ++x) {
            const T* s = src + x * f2;
            T* d = row.data() + (x * k.sw + j * k.dw - k.pw) * c;
            if (f5 == 1) {
              for (Index ch = 0; ch < c; ++ch) d[ch] += s[ch];
            } else {
              for (Index ch = 0; ch < c; ++ch) d[ch] += s[ch * f5];
            }
          }
        }
      }
      T* o = po + b * o0 + p * o2;
      for (Index ch = 0; ch < c; ++ch) {
        for (Index q = 0; q < wd; ++q) o[ch * o1 + q * o3] = row[q * c + ch];
      }
    }
  });
}

// What both column ops check: an image (N, C, H, W) and its fields (N, oh, ow, kh, kw, C) of one geometry
// and one dtype, float32 or float64.
Geometry fields_of(const at::Tensor& image, const at::Tensor& fields, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                   int64_t dh, int64_t dw) {
  TORCH_CHECK(image.dim() == 4 && fields.dim() == 6, "lockstep_blas: image (N, C, H, W), fields (N, oh, ow, kh, kw, C)");
  TORCH_CHECK(image.size(0) == fields.size(0) && image.size(1) == fields.size(5),
              "lockstep_blas: image and fields do not match");
  TORCH_CHECK(sh > 0 && sw > 0 && ph >= 0 && pw >= 0 && dh > 0 && dw > 0, "lockstep_blas: columns arguments");
  TORCH_CHECK(fields.size(1) == out_size(image.size(2), fields.size(3), sh, ph, dh) &&
                  fields.size(2) == out_size(image.size(3), fields.size(4), sw, pw, dw),
              "lockstep_blas: the fields' size does not follow from the geometry");
  TORCH_CHECK(image.scalar_type() == fields.scalar_type() &&
                  (image.scalar_type() == at::kFloat || image.scalar_type() == at::kDouble),
              "lockstep_blas: float32 or float64, both the same");
  return {sh, sw, ph, pw, dh, dw};
}

void image_columns(const at::Tensor& x, const at::Tensor& out, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                   int64_t dh, int64_t dw) {
  const Geometry k = fields_of(x, out, sh, sw, ph, pw, dh, dw);
  TORCH_CHECK(out.is_contiguous(), "lockstep_blas: image_columns writes contiguous fields");
  x.scalar_type() == at::kFloat ? image_fields<float>(x, out, k) : image_fields<double>(x, out, k);
}

void gather_columns(const at::Tensor& fields, const at::Tensor& out, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                    int64_t dh, int64_t dw) {
  const Geometry k = fields_of(out, fields, sh, sw, ph, pw, dh, dw);
  out.scalar_type() == at::kFloat ? gather_fields<float>(fields, out, k) : gather_fields<double>(fields, out, k);
}

// Depthwise convolution (one channel per group), computed directly: an im2col of kh * kw columns per
// channel and a product whose inner dimension is kh * kw cost several times the arithmetic. Every
// element's sum has one fixed order, written out below and in tasks/determinism/depthwise.py's torch
// loops (the same bytes; tested): each term a rounded product, then a rounded sum (built with
// -ffp-contract=off: no fused multiply-add), so no byte depends on the CPU, the vector width or the
// threads. Terms that fall on the padding are left out (they add zeros). All tensors contiguous.

// Offset (i, then j) after offset, for each position (y, x) of `small` whose input position
// (y*sh + i*dh - ph, x*sw + j*dw - pw) is inside `image`: `kToImage` false, the output,
//   small[n, c, y, x] += w[c, i, j] * image[n, c, input position]   (small = out, image = x);
// `kToImage` true, the input gradient (as col2im adds),
//   image[n, c, input position] += w[c, i, j] * small[n, c, y, x]   (small = g, image = gx).
// The side added to starts at zeros; each of its elements takes its terms in the order of the offsets.
template <typename T, bool kToImage>
void depthwise_offsets(const at::Tensor& small, const at::Tensor& w, const at::Tensor& image, Geometry k) {
  const Index planes = small.size(0) * small.size(1), c = small.size(1), oh = small.size(2), ow = small.size(3);
  const Index h = image.size(2), wd = image.size(3), kh = w.size(2), kw = w.size(3);
  T* ps = small.data_ptr<T>();
  T* pi = image.data_ptr<T>();
  const T* pw = w.data_ptr<T>();
  at::parallel_for(0, planes, 1, [&](int64_t first, int64_t last) {
    for (int64_t plane = first; plane < last; ++plane) {
      T* small_plane = ps + plane * oh * ow;
      T* image_plane = pi + plane * h * wd;
      if constexpr (kToImage) {
        std::fill(image_plane, image_plane + h * wd, T(0));
      } else {
        std::fill(small_plane, small_plane + oh * ow, T(0));
      }
      const T* weights = pw + (plane % c) * kh * kw;
      for (Index i = 0; i < kh; ++i) {
        const Span ys = span(h, oh, k.sh, i * k.dh - k.ph);
        for (Index j = 0; j < kw; ++j) {
          const Span xs = span(wd, ow, k.sw, j * k.dw - k.pw);
          const T weight = weights[i * kw + j];
          for (Index y = ys.first; y < ys.last; ++y) {
            T* row = small_plane + y * ow;
            T* in = image_plane + (y * k.sh + i * k.dh - k.ph) * wd + j * k.dw - k.pw;
            if constexpr (kToImage) {
              for (Index o = xs.first; o < xs.last; ++o) in[o * k.sw] += weight * row[o];
            } else {
              for (Index o = xs.first; o < xs.last; ++o) row[o] += weight * in[o * k.sw];
            }
          }
        }
      }
    }
  });
}

// gw[c, i, j] = the sum over (n, y, x) of g[n, c, y, x] * x[n, c, y*sh + i*dh - ph, x*sw + j*dw - pw]: the
// products in that order, then added in halves (element k plus element k + ceil(L/2), until one is left),
// which torch's elementwise adds repeat exactly, and which loses less to rounding than a running sum.
template <typename T>
void depthwise_weight_gradient(const at::Tensor& g, const at::Tensor& x, const at::Tensor& gw, Geometry k) {
  const Index n = g.size(0), c = g.size(1), oh = g.size(2), ow = g.size(3);
  const Index h = x.size(2), wd = x.size(3), kh = gw.size(2), kw = gw.size(3);
  const T* pg = g.data_ptr<T>();
  const T* px = x.data_ptr<T>();
  T* pw = gw.data_ptr<T>();
  at::parallel_for(0, c, 1, [&](int64_t first, int64_t last) {
    std::vector<T> terms(std::max<Index>(1, n * oh * ow));
    for (int64_t channel = first; channel < last; ++channel) {
      for (Index i = 0; i < kh; ++i) {
        const Span ys = span(h, oh, k.sh, i * k.dh - k.ph);
        for (Index j = 0; j < kw; ++j) {
          const Span xs = span(wd, ow, k.sw, j * k.dw - k.pw);
          Index length = 0;
          for (Index b = 0; b < n; ++b) {
            for (Index y = ys.first; y < ys.last; ++y) {
              const T* grad = pg + ((b * c + channel) * oh + y) * ow;
              const T* in = px + ((b * c + channel) * h + y * k.sh + i * k.dh - k.ph) * wd + j * k.dw - k.pw;
              for (Index o = xs.first; o < xs.last; ++o) terms[length++] = grad[o] * in[o * k.sw];
            }
          }
          if (length == 0) terms[0] = T(0);
          while (length > 1) {
            const Index half = (length + 1) / 2;
            for (Index t = 0; t < length - half; ++t) terms[t] += terms[t + half];
            length = half;
          }
          pw[(channel * kh + i) * kw + j] = terms[0];
        }
      }
    }
  });
}

// Which of the three a call computes (`part`): 0 the output (a = x, b = w), 1 the input gradient (a = g,
// b = w), 2 the weight gradient (a = g, b = x); written into `out`.
void depthwise(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t part, int64_t sh, int64_t sw,
               int64_t ph, int64_t pw, int64_t dh, int64_t dw) {
  TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && out.dim() == 4, "lockstep_blas: depthwise: 4-D tensors");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && out.is_contiguous(), "lockstep_blas: depthwise: contiguous");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == out.scalar_type(), "lockstep_blas: dtypes");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble, "lockstep_blas: float32 or float64");
  TORCH_CHECK(part >= 0 && part <= 2 && sh > 0 && sw > 0 && ph >= 0 && pw >= 0 && dh > 0 && dw > 0,
              "lockstep_blas: depthwise arguments");
  const at::Tensor& image = part == 0 ? a : (part == 1 ? out : b);  // x, or the input gradient
  const at::Tensor& small = part == 0 ? out : a;                    // the output, or its gradient
  const at::Tensor& kernel = part == 2 ? out : b;                   // w, or the weight gradient
  TORCH_CHECK(image.size(0) == small.size(0) && image.size(1) == small.size(1) && kernel.size(0) == small.size(1) &&
                  kernel.size(1) == 1,
              "lockstep_blas: depthwise: shapes do not match");
  TORCH_CHECK(small.size(2) == out_size(image.size(2), kernel.size(2), sh, ph, dh) &&
                  small.size(3) == out_size(image.size(3), kernel.size(3), sw, pw, dw),
              "lockstep_blas: depthwise: the output's size does not follow from the geometry");
  const Geometry k{sh, sw, ph, pw, dh, dw};
  const bool single = a.scalar_type() == at::kFloat;
  if (part == 0) {
    single ? depthwise_offsets<float, false>(out, b, a, k) : depthwise_offsets<double, false>(out, b, a, k);
  } else if (part == 1) {
    single ? depthwise_offsets<float, true>(a, b, out, k) : depthwise_offsets<double, true>(a, b, out, k);
  } else {
    single ? depthwise_weight_gradient<float>(a, b, out, k) : depthwise_weight_gradient<double>(a, b, out, k);
  }
}

}  // namespace

TORCH_LIBRARY(lockstep_blas, m) {
  m.def("gemm_chunks(Tensor a, Tensor b, Tensor(a!) out, int dim, int chunk, int width=0) -> ()", gemm_chunks);
  m.def("widest() -> int", widest);
  m.def("image_columns(Tensor x, Tensor(a!) out, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
        image_columns);
  m.def("gather_columns(Tensor fields, Tensor(a!) out, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
        gather_columns);
  m.def(
      "depthwise(Tensor a, Tensor b, Tensor(a!) out, int part, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
      depthwise);
}
