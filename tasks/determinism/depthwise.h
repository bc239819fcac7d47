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

template <typename T>
using SumTaps = void (*)(T*, const T* const*, const T* const*, Index, Index);

// Where position p of the side a sum writes reads the other side, along one dimension, for the kernel's
// offset i; -1 where it reads nothing (padding, or no output position). The output at p reads the input at
// p * s + i * d - pad; the input gradient at p, the output position that reads p.
template <bool kToImage>
Index source(Index p, Index i, Index s, Index pad, Index d, Index size) {
  Index at = kToImage ? p + pad - i * d : p * s + i * d - pad;
  if (kToImage) {
    if (at < 0 || at % s != 0) return -1;
    at /= s;
  }
  return at >= 0 && at < size ? at : -1;
}

// The output (`kToImage` false) or the input gradient of a depthwise convolution with channels-last
// activations: `small` (the output or its gradient) and `image` (the input or its gradient) (N, C, H, W),
// channels-last and contiguous; `w` (C, 1, kh, kw) contiguous. Each element is the sum depthwise_offsets
// makes, gathered where it lands rather than added there term by term: its terms in the order of the
// offsets (i, then j), from zero, a position's channels at once (depthwise_taps.h; the wide build's vectors if `use_wide`).
template <typename T, bool kToImage>
void depthwise_last(const at::Tensor& small, const at::Tensor& w, const at::Tensor& image, Geometry k, bool use_wide) {
  const Index n = small.size(0), c = small.size(1), kh = w.size(2), kw = w.size(3);
  const at::Tensor& read = kToImage ? small : image;
  const at::Tensor& written = kToImage ? image : small;
  const Index rh = read.size(2), rw = read.size(3), wh = written.size(2), ww = written.size(3);
  const at::Tensor by_offset = w.reshape({c, kh * kw}).t().contiguous();  // (kh * kw, C): an offset's channels
  const T* weights = by_offset.data_ptr<T>();
  const T* from = read.data_ptr<T>();
  T* to = written.data_ptr<T>();
  const SumTaps<T> sum = use_wide ? wide::sum_taps<T> : narrow::sum_taps<T>;
  at::parallel_for(0, n * wh, 1, [&](int64_t first, int64_t last) {
    std::vector<const T*> xs(kh * kw), ws(kh * kw);
    for (int64_t row = first; row < last; ++row) {
      const Index b = row / wh, r = row % wh;
      for (Index col = 0; col < ww; ++col) {
        Index taps = 0;
        for (Index i = 0; i < kh; ++i) {
          const Index y = source<kToImage>(r, i, k.sh, k.ph, k.dh, rh);
          for (Index j = 0; j < kw && y >= 0; ++j) {
            const Index x = source<kToImage>(col, j, k.sw, k.pw, k.dw, rw);
            if (x < 0) continue;
            xs[taps] = from + ((b * rh + y) * rw + x) * c;
            ws[taps++] = weights + (i * kw + j) * c;
          }
        }
        sum(to + (row * ww + col) * c, xs.data(), ws.data(), taps, c);
      }
    }
  });
}

template <typename T>
using HalvedTerms = void (*)(T*, const T*, const T*, const Walk&, T*);

// depthwise_weight_gradient's sums for channels-last g and x (N, C, H, W) (gw (C, 1, kh, kw) contiguous),
// CHANNELS of them at once (one at a time for those left over): the same terms in the same order, each
// channel block's values read once per offset. Where a channel's positions outgrow the cache, the planes'
// loops read them better (depthwise.py decides).
template <typename T>
void depthwise_weight_gradient_last(const at::Tensor& g, const at::Tensor& x, const at::Tensor& gw, Geometry k,
                                    bool use_wide) {
  constexpr Index CHANNELS = 16;
  const Index n = g.size(0), c = g.size(1), oh = g.size(2), ow = g.size(3);
  const Index h = x.size(2), wd = x.size(3), kh = gw.size(2), kw = gw.size(3);
  const T* pg = g.data_ptr<T>();
  const T* px = x.data_ptr<T>();
  T* pw = gw.data_ptr<T>();
  const HalvedTerms<T> block = use_wide ? wide::halved_terms<T, CHANNELS> : narrow::halved_terms<T, CHANNELS>;
  const HalvedTerms<T> single = use_wide ? wide::halved_terms<T, 1> : narrow::halved_terms<T, 1>;
  const Index blocks = c / CHANNELS, tasks = blocks + c % CHANNELS;  // a task: a block, or a channel left over
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<T> terms(CHANNELS * std::max<Index>(1, (n * oh * ow + 1) / 2));
    T sums[CHANNELS];
    for (int64_t task = first; task < last; ++task) {
      const Index q0 = task < blocks ? task * CHANNELS : blocks * CHANNELS + (task - blocks);
      const Index width = task < blocks ? CHANNELS : 1;
      for (Index i = 0; i < kh; ++i) {
        const Span ys = span(h, oh, k.sh, i * k.dh - k.ph);
        for (Index j = 0; j < kw; ++j) {
          const Span xs = span(wd, ow, k.sw, j * k.dw - k.pw);
          const Index rows = std::max<Index>(0, ys.last - ys.first), cols = std::max<Index>(0, xs.last - xs.first);
          const Walk walk{n, rows, cols, oh * ow * c, ow * c, c, h * wd * c, k.sh * wd * c, k.sw * c};
          const bool some = rows > 0 && cols > 0;  // (else no term: nothing is read)
          const T* g0 = some ? pg + (ys.first * ow + xs.first) * c + q0 : pg;
          const T* x0 =
              some ? px + ((ys.first * k.sh + i * k.dh - k.ph) * wd + xs.first * k.sw + j * k.dw - k.pw) * c + q0 : px;
          (width == CHANNELS ? block : single)(sums, g0, x0, walk, terms.data());
          for (Index q = 0; q < width; ++q) pw[((q0 + q) * kh + i) * kw + j] = sums[q];
        }
      }
    }
  });
}
