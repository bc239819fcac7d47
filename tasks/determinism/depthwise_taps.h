// Channels-last depthwise convolutions' inner loops, included by blas_pool.cpp once per vector width (as
// fma_chain.h, so that each is compiled for that instruction set): a position's channels lie side by side,
// so each loop runs along them, a lane per channel. Built with -ffp-contract=off, every term is a rounded
// product and then a rounded sum, whatever the vector width: the bytes of depthwise.h's plane loops.

// out[q] = the sum of w[t][q] * x[t][q] over the taps t in order, from zero, for the channels q of [0, c):
// blocks of B channels summed in registers, taken from B = 64 down to 1 for the channels left over.
template <typename T, int B>
Index tap_block(T* out, const T* const* x, const T* const* w, Index taps, Index c, Index q0) {
  for (; q0 + B <= c; q0 += B) {
    T sum[B];
#pragma GCC unroll 64
    for (int q = 0; q < B; ++q) sum[q] = T(0);
    for (Index t = 0; t < taps; ++t) {
      const T* xt = x[t] + q0;
      const T* wt = w[t] + q0;
#pragma GCC unroll 64
      for (int q = 0; q < B; ++q) sum[q] = sum[q] + wt[q] * xt[q];
    }
#pragma GCC unroll 64
    for (int q = 0; q < B; ++q) out[q0 + q] = sum[q];
  }
  return q0;
}

template <typename T>
void sum_taps(T* out, const T* const* x, const T* const* w, Index taps, Index c) {
  Index q0 = tap_block<T, 64>(out, x, w, taps, c, 0);
  q0 = tap_block<T, 16>(out, x, w, taps, c, q0);
  tap_block<T, 1>(out, x, w, taps, c, q0);
}

// A weight gradient's sums for B channels and one kernel offset: out[q] = the terms g[t][q] * x[t][q] over the
// positions t of `walk` (g and x point at the first position's channel q = 0), added in halves (element k
// plus element k + ceil(L/2), until one is left), 0 for none. The first halving is made as the terms are (a
// term past the half goes onto its partner at once), so `terms` needs ceil(L/2) rows of B.
template <typename T, int B>
void halved_terms(T* out, const T* g, const T* x, const Walk& walk, T* terms) {
  const Index length = walk.n * walk.rows * walk.cols, half = (length + 1) / 2;
  Index t = 0;
  for (Index b = 0; b < walk.n; ++b) {
    for (Index r = 0; r < walk.rows; ++r) {
      const T* gr = g + b * walk.g_image + r * walk.g_row;
      const T* xr = x + b * walk.x_image + r * walk.x_row;
      for (Index o = 0; o < walk.cols; ++o, ++t) {
        const T* go = gr + o * walk.g_col;
        const T* xo = xr + o * walk.x_col;
        T* row = terms + (t < half ? t : t - half) * B;
        if (t < half) {
#pragma GCC unroll 16
          for (int q = 0; q < B; ++q) row[q] = go[q] * xo[q];
        } else {
#pragma GCC unroll 16
          for (int q = 0; q < B; ++q) row[q] = row[q] + go[q] * xo[q];
        }
      }
    }
  }
  for (Index left = half; left > 1;) {
    const Index next = (left + 1) / 2;
    for (Index u = 0; u < left - next; ++u) {
#pragma GCC unroll 16
      for (int q = 0; q < B; ++q) terms[u * B + q] = terms[u * B + q] + terms[(u + next) * B + q];
    }
    left = next;
  }
#pragma GCC unroll 16
  for (int q = 0; q < B; ++q) out[q] = length == 0 ? T(0) : terms[q];
}
