// The portable kernels' C++ ops: matrix products on torch's own thread pool (the chunks of one
// product, each a call into numpy's OpenBLAS, which runs on one thread), a convolution's col2im, and
// depthwise convolutions. tasks/determinism/blas.py says why, builds this, and makes the same calls from
// Python where it cannot be built (col2im and depthwise: kernels.py's and depthwise.py's torch loops).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enums
using Index = int64_t;  // numpy's OpenBLAS is ILP64
using Sgemm = void (*)(int, int, int, Index, Index, Index, float, const float*, Index, const float*, Index, float,
                       float*, Index);
using Dgemm = void (*)(int, int, int, Index, Index, Index, double, const double*, Index, const double*, Index,
                       double, double*, Index);
Sgemm sgemm = nullptr;
Dgemm dgemm = nullptr;

void bind(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  TORCH_CHECK(lib != nullptr, "lockstep_blas: ", path, " is not loaded in this process");
  sgemm = reinterpret_cast<Sgemm>(dlsym(lib, "scipy_cblas_sgemm64_"));
  dgemm = reinterpret_cast<Dgemm>(dlsym(lib, "scipy_cblas_dgemm64_"));
  TORCH_CHECK(sgemm && dgemm, "lockstep_blas: ", path, " lacks the expected symbols");
}

// One operand as BLAS sees it: row-major (stride (ld, 1)) or transposed (stride (1, ld)), in the last two
// dimensions; the first (the product's group) may have any stride.
struct Operand {
  int trans;
  Index ld;
};

Operand operand(const at::Tensor& t, const char* name) {
  const Index rows = t.size(1), cols = t.size(2), s0 = t.stride(1), s1 = t.stride(2);
  if (s1 == 1 && s0 >= std::max<Index>(1, cols)) return {kNoTrans, s0};
  if (s0 == 1 && s1 >= std::max<Index>(1, rows)) return {kTrans, s1};
  TORCH_CHECK(false, "lockstep_blas: ", name, " is neither row-major nor transposed");
}

// Every group's product cut the same way (by shape: blas.py's plan), and the (group, chunk) pairs shared
// out on torch's pool: each pair is one call into OpenBLAS on one thread, so no byte depends on which
// thread ran it or on how many there are.
template <typename T, typename Gemm>
void run(Gemm gemm, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t dim, int64_t chunk) {
  const Index groups = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const Operand oa = operand(a, "a"), ob = operand(b, "b");
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
        const T* sa = ag + start * (oa.trans == kNoTrans ? oa.ld : 1);
        gemm(kRowMajor, oa.trans, ob.trans, size, n, k, T(1), sa, oa.ld, bg, ob.ld, T(0), cg + start * ldc, ldc);
      } else {  // columns of out: columns of b
        const T* sb = bg + start * (ob.trans == kNoTrans ? 1 : ob.ld);
        gemm(kRowMajor, oa.trans, ob.trans, m, size, k, T(1), ag, oa.ld, sb, ob.ld, T(0), cg + start, ldc);
      }
    }
  });
}

// out[g] = a[g] @ b[g] for 2-D operands (one product) or 3-D (one per group: a grouped convolution's).
void gemm_chunks(const at::Tensor& a2, const at::Tensor& b2, const at::Tensor& out2, int64_t dim, int64_t chunk) {
  TORCH_CHECK(sgemm != nullptr, "lockstep_blas: bind() first");
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
  if (a.scalar_type() == at::kFloat) {
    run<float>(sgemm, a, b, out, dim, chunk);
  } else {
    TORCH_CHECK(a.scalar_type() == at::kDouble, "lockstep_blas: float32 or float64");
    run<double>(dgemm, a, b, out, dim, chunk);
  }
}

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
  m.def("bind(str path) -> ()", [](const std::string& path) { bind(path); });
  m.def("gemm_chunks(Tensor a, Tensor b, Tensor(a!) out, int dim, int chunk) -> ()", gemm_chunks);
  m.def("image_columns(Tensor x, Tensor(a!) out, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
        image_columns);
  m.def("gather_columns(Tensor fields, Tensor(a!) out, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
        gather_columns);
  m.def(
      "depthwise(Tensor a, Tensor b, Tensor(a!) out, int part, int sh, int sw, int ph, int pw, int dh, int dw) -> ()",
      depthwise);
}
