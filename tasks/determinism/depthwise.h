// Depthwise convolutions' kernels, included once by blas_pool.cpp (after convolution.h: Geometry, Span).

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
