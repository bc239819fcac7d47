// Matrix products on torch's own thread pool: the chunks of one product, each a call into numpy's
// OpenBLAS (which runs on one thread). tasks/blas.py says why, builds this, and makes the same
// calls from Python where it cannot be built.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <string>

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

// col2im: grad (N, Hp, Wp, C), zeroed, += fields (N, oh, ow, kh, kw, C) at the positions each field
// was read from; both may have any strides. Every element takes its additions in the order of the
// kernel offsets (i, then j), as kernels.py's loop of strided adds does, so the bytes are the same
// whatever the loops around them. Images run in parallel, and no two threads add to one element.
// Channels innermost when grad is channels-last; else (a channel-first grad: a grouped convolution's)
// a channel's plane at a time, so that neither side is read across channels.
template <typename T>
void add_fields(const at::Tensor& fields, const at::Tensor& grad, int64_t sh, int64_t sw, int64_t dh, int64_t dw) {
  const Index n = fields.size(0), oh = fields.size(1), ow = fields.size(2), kh = fields.size(3), kw = fields.size(4),
              c = fields.size(5);
  const Index f0 = fields.stride(0), f1 = fields.stride(1), f2 = fields.stride(2), f3 = fields.stride(3),
              f4 = fields.stride(4), f5 = fields.stride(5);
  const Index g0 = grad.stride(0), g1 = grad.stride(1), g2 = grad.stride(2), g3 = grad.stride(3);
  const T* pf = fields.data_ptr<T>();
  T* pg = grad.data_ptr<T>();
  const bool channels_last = g3 == 1;
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const T* fb = pf + b * f0;
      T* gb = pg + b * g0;
      for (Index k = 0; k < (channels_last ? 1 : c); ++k) {  // channel-first: one plane after another
        for (Index i = 0; i < kh; ++i) {
          for (Index j = 0; j < kw; ++j) {
            for (Index y = 0; y < oh; ++y) {
              const T* src = fb + k * f5 + y * f1 + i * f3 + j * f4;
              T* dst = gb + k * g3 + (y * sh + i * dh) * g1 + j * dw * g2;
              if (channels_last) {
                for (Index x = 0; x < ow; ++x) {
                  for (Index ch = 0; ch < c; ++ch) dst[x * sw * g2 + ch] += src[x * f2 + ch * f5];
                }
              } else {
                for (Index x = 0; x < ow; ++x) dst[x * sw * g2] += src[x * f2];
              }
            }
          }
        }
      }
    }
  });
}

void add_columns(const at::Tensor& fields, const at::Tensor& grad, int64_t sh, int64_t sw, int64_t dh, int64_t dw) {
  TORCH_CHECK(fields.dim() == 6 && grad.dim() == 4, "lockstep_blas: fields (N, oh, ow, kh, kw, C), grad (N, H, W, C)");
  TORCH_CHECK(fields.size(0) == grad.size(0) && fields.size(5) == grad.size(3), "lockstep_blas: fields and grad do not match");
  TORCH_CHECK((fields.size(1) - 1) * sh + (fields.size(3) - 1) * dh < grad.size(1) &&
                  (fields.size(2) - 1) * sw + (fields.size(4) - 1) * dw < grad.size(2),
              "lockstep_blas: fields reach outside grad");
  TORCH_CHECK(fields.scalar_type() == grad.scalar_type(), "lockstep_blas: dtypes");
  if (grad.scalar_type() == at::kFloat) {
    add_fields<float>(fields, grad, sh, sw, dh, dw);
  } else {
    TORCH_CHECK(grad.scalar_type() == at::kDouble, "lockstep_blas: float32 or float64");
    add_fields<double>(fields, grad, sh, sw, dh, dw);
  }
}

}  // namespace

TORCH_LIBRARY(lockstep_blas, m) {
  m.def("bind(str path) -> ()", [](const std::string& path) { bind(path); });
  m.def("gemm_chunks(Tensor a, Tensor b, Tensor(a!) out, int dim, int chunk) -> ()", gemm_chunks);
  m.def("add_columns(Tensor fields, Tensor(a!) grad, int sh, int sw, int dh, int dw) -> ()", add_columns);
}
