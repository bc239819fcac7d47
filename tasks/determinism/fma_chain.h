// The portable product's micro-kernel, included by blas_pool.cpp once per vector width (inside a
// `#pragma GCC target` region and a namespace that defines `Lanes<T>`): it must be compiled for each
// instruction set, and a template defined outside those regions could not inline their intrinsics.
//
// c (MR x 2W of the result, row stride ldc) gets, for each of its elements, the chain
// c = fma(a_k, b_k, c) over the kc values of k in order, starting from zero (`first`) or from what c
// holds (a later block of k): one rounding per step, the same whatever the vector width, since each
// element is one lane of one accumulator. `b`: 2W values per k (packed). `a`: MR rows, read in place
// or packed: a[k * step + i] (a panel, or a transposed matrix) or, with ROWS, a[i * step + k] (a
// row-major matrix). `bias` (2W values, or null): added to each row's chains after their last term, one
// rounding, as torch's addmm adds it to the product (the last block of k only).
template <typename T, bool ROWS>
void micro_kernel(Index kc, const T* a, Index step, const T* b, T* c, Index ldc, bool first, const T* bias) {
  using L = Lanes<T>;
  constexpr int MR = L::MR, W = L::W;
  typename L::V acc[MR][2];  // separate loops for zeroing and loading: a ternary per element keeps GCC
#pragma GCC unroll 16      // from holding the accumulators in registers
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = L::zero();
  if (!first) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i][0] = L::load(c + i * ldc), acc[i][1] = L::load(c + i * ldc + W);
  }
  for (Index k = 0; k < kc; ++k) {
    // A transposed matrix read in place (a weight gradient's g^T): each k's MR values lie a row of g apart,
    // often each in a page of its own, where no hardware prefetcher follows. Asked for 24 k ahead (both
    // lines the values may span); a prefetch past the matrix's end faults nothing.
    if (!ROWS && step > 64) {
      __builtin_prefetch(a + (k + 24) * step, 0, 3);
      __builtin_prefetch(a + (k + 24) * step + MR - 1, 0, 3);
    }
    const typename L::V b0 = L::load(b + k * 2 * W), b1 = L::load(b + k * 2 * W + W);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const typename L::V ai = L::set1(ROWS ? a[i * step + k] : a[k * step + i]);
      acc[i][0] = L::fma(ai, b0, acc[i][0]);
      acc[i][1] = L::fma(ai, b1, acc[i][1]);
    }
  }
  if (bias) {
    const typename L::V bias0 = L::load(bias), bias1 = L::load(bias + W);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[i][0] = L::add(acc[i][0], bias0), acc[i][1] = L::add(acc[i][1], bias1);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) L::store(c + i * ldc, acc[i][0]), L::store(c + i * ldc + W, acc[i][1]);
}
