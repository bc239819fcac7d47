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

// One operand as BLAS sees it: row-major (stride (ld, 1)) or transposed (stride (1, ld)).
struct Operand {
  int trans;
  Index ld;
};

Operand operand(const at::Tensor& t, const char* name) {
  if (t.stride(1) == 1 && t.stride(0) >= std::max<Index>(1, t.size(1))) return {kNoTrans, t.stride(0)};
  if (t.stride(0) == 1 && t.stride(1) >= std::max<Index>(1, t.size(0))) return {kTrans, t.stride(1)};
  TORCH_CHECK(false, "lockstep_blas: ", name, " is neither row-major nor transposed");
}

template <typename T, typename Gemm>
void run(Gemm gemm, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t dim, int64_t chunk) {
  const Index m = a.size(0), k = a.size(1), n = b.size(1);
  const Operand oa = operand(a, "a"), ob = operand(b, "b");
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* pc = out.data_ptr<T>();
  const Index ldc = out.stride(0);
  const Index extent = dim == 0 ? m : n;
  const Index chunks = (extent + chunk - 1) / chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Index start = c * chunk, size = std::min<Index>(chunk, extent - start);
      if (dim == 0) {  // rows of out: rows of a
        const T* sa = pa + start * (oa.trans == kNoTrans ? oa.ld : 1);
        gemm(kRowMajor, oa.trans, ob.trans, size, n, k, T(1), sa, oa.ld, pb, ob.ld, T(0), pc + start * ldc, ldc);
      } else {  // columns of out: columns of b
        const T* sb = pb + start * (ob.trans == kNoTrans ? 1 : ob.ld);
        gemm(kRowMajor, oa.trans, ob.trans, m, size, k, T(1), pa, oa.ld, sb, ob.ld, T(0), pc + start, ldc);
      }
    }
  });
}

void gemm_chunks(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t dim, int64_t chunk) {
  TORCH_CHECK(sgemm != nullptr, "lockstep_blas: bind() first");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2, "lockstep_blas: 2-D operands");
  TORCH_CHECK(a.size(1) == b.size(0) && out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "lockstep_blas: shapes do not match");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == out.scalar_type(), "lockstep_blas: dtypes");
  TORCH_CHECK(out.stride(1) == 1 && out.stride(0) >= std::max<Index>(1, out.size(1)), "lockstep_blas: out row-major");
  TORCH_CHECK((dim == 0 || dim == 1) && chunk > 0, "lockstep_blas: dim 0 or 1, chunk > 0");
  if (a.scalar_type() == at::kFloat) {
    run<float>(sgemm, a, b, out, dim, chunk);
  } else {
    TORCH_CHECK(a.scalar_type() == at::kDouble, "lockstep_blas: float32 or float64");
    run<double>(dgemm, a, b, out, dim, chunk);
  }
}

}  // namespace

TORCH_LIBRARY(lockstep_blas, m) {
  m.def("bind(str path) -> ()", [](const std::string& path) { bind(path); });
  m.def("gemm_chunks(Tensor a, Tensor b, Tensor(a!) out, int dim, int chunk) -> ()", gemm_chunks);
}
