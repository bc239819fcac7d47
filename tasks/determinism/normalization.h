// Layer norm's and softmax's backward, included by blas_pool.cpp once per vector width (as activations.h).
// ATen's kernels cut their sums where the thread count cut the rows; here every sum has one order, which
// neither the vector width nor the threads change:
// - a row's sum: 16 chains, element j into chain j % 16, in order from zero, the row padded with zeros to
//   whole sixteens; then the chains added in halves (chain l + chain l + 8, then + 4, + 2, + 1);
// - a column's sum (layer norm's weight and bias gradients): over blocks of kBlockRows rows, each block's
//   rows added in order from zero (a short last block as if padded with zero rows), then the blocks' sums
//   added in order from zero (blas_pool.cpp's layer_norm_backward, after the blocks).
// Built with -ffp-contract=off: each +, -, * rounded once, in a vector lane or alone.
// tasks/determinism/normalization.py repeats it with torch's elementwise ops (the same bytes; tested).

constexpr Index kChains = 16;

// The 16 chains of a row's sum, added in halves: the sum.
[[gnu::always_inline]] inline float folded(float* chain) {
  for (Index half = kChains / 2; half >= 1; half /= 2) {
    for (Index l = 0; l < half; ++l) chain[l] = chain[l] + chain[l + half];
  }
  return chain[0];
}

// The row sums of layer norm's input gradient: ds = sum of g x, db = sum of g, where g = dy w (dy without w).
inline void layer_norm_row_sums(const float* dy, const float* x, const float* w, Index n, float& ds, float& db) {
  float s[kChains] = {}, b[kChains] = {};
  Index j0 = 0;
  for (; j0 + kChains <= n; j0 += kChains) {
    for (Index l = 0; l < kChains; ++l) {
      const float g = w ? dy[j0 + l] * w[j0 + l] : dy[j0 + l];
      s[l] = s[l] + g * x[j0 + l];
      b[l] = b[l] + g;
    }
  }
  for (Index l = 0; j0 < n && l < kChains; ++l) {  // the tail, if any; past the row, zeros
    const Index j = j0 + l;
    const float g = j < n ? (w ? dy[j] * w[j] : dy[j]) : 0.0f;
    s[l] = s[l] + (j < n ? g * x[j] : 0.0f);
    b[l] = b[l] + g;
  }
  ds = folded(s);
  db = folded(b);
}

// Layer norm's backward for rows [first, last) of (rows, n) tensors: their input gradient into dx (if not
// null), and the sums over these rows, from zero, of dy x-hat into dw and of dy into db (if not null).
// ATen's formula (layer_norm_kernel.cpp): dx = a g + b x + c, a = rstd, b = (db mean - ds) a^3 / n,
// c = -b mean - db a / n; x-hat = a x - a mean.
inline void layer_norm_rows(const float* dy, const float* x, const float* mean, const float* rstd, const float* w,
                            float* dx, float* dw, float* db, Index first, Index last, Index n) {
  const float scale = static_cast<float>(1.0 / static_cast<double>(n));  // as torch's float32 * a Python float
  for (Index i = first; i < last; ++i) {
    const float* dyi = dy + i * n;
    const float* xi = x + i * n;
    const float a = rstd[i], mu = mean[i];
    if (dx) {
      float ds, sum_g;
      layer_norm_row_sums(dyi, xi, w, n, ds, sum_g);
      const float b = ((((sum_g * mu) - ds) * a) * a) * a * scale;
      const float c = (-b * mu) - (sum_g * a) * scale;
      float* dxi = dx + i * n;
      for (Index j = 0; j < n; ++j) {
        const float g = w ? dyi[j] * w[j] : dyi[j];
        dxi[j] = ((g * a) + (xi[j] * b)) + c;
      }
    }
    if (dw) {
      const float shift = -a * mu;
      for (Index j = 0; j < n; ++j) dw[j] = dw[j] + dyi[j] * ((xi[j] * a) + shift);
    }
    if (db) {
      for (Index j = 0; j < n; ++j) db[j] = db[j] + dyi[j];
    }
  }
}

// Softmax's input gradient for rows [first, last) of (rows, n) tensors: y (dy - the row's sum of dy y).
inline void softmax_backward_rows(const float* dy, const float* y, float* out, Index first, Index last, Index n) {
  for (Index i = first; i < last; ++i) {
    const float* dyi = dy + i * n;
    const float* yi = y + i * n;
    float chain[kChains] = {};
    Index j0 = 0;
    for (; j0 + kChains <= n; j0 += kChains) {
      for (Index l = 0; l < kChains; ++l) chain[l] = chain[l] + dyi[j0 + l] * yi[j0 + l];
    }
    for (Index l = 0; j0 < n && l < kChains; ++l) {  // the tail, if any; past the row, zeros
      chain[l] = chain[l] + (j0 + l < n ? dyi[j0 + l] * yi[j0 + l] : 0.0f);
    }
    const float sum = folded(chain);
    float* o = out + i * n;
    for (Index j = 0; j < n; ++j) o[j] = yi[j] * (dyi[j] - sum);
  }
}
