// The portable convolutions' work besides the products, included once by blas_pool.cpp (after
// products.h): geometry, the padded channels-last image the products read fields from, and col2im, as a
// gather of written-out columns (grouped convolutions) or fused with the input gradient's product.

// out (B, C, R1, R2) = x (B, R1, R2, C), any strides, each element's E bytes copied as they are: a weight
// gradient's product (kh*kw, C, O) laid out as the weight (O, C, kh, kw). torch copies such a view walking one
// side a row apart per element, which at power-of-two strides (a resnet's 512 x 512 channels: rows a
// megabyte apart) thrashes the cache and runs several times slower than memory. Here the rows (r1, r2), in
// out's order, are taken 16 at a time and every column of them copied: 16 rows read in sequence, and each
// write a whole run of 16 where out is contiguous in (r1, r2).
template <typename E>
void rotate_last(const at::Tensor& x, const at::Tensor& out) {
  constexpr Index S = 16;
  const Index batches = x.size(0), r2 = x.size(2), rows = x.size(1) * r2, cols = x.size(3);
  const E* px = static_cast<const E*>(x.const_data_ptr());
  E* po = static_cast<E*>(out.data_ptr());
  const Index strips = (rows + S - 1) / S;
  const int64_t grain = std::max<Index>(1, (Index(1) << 15) / std::max<Index>(1, S * cols));  // small: one thread
  at::parallel_for(0, batches * strips, grain, [&](int64_t first, int64_t last) {
    Index from[S], to[S];
    for (int64_t task = first; task < last; ++task) {
      const Index b = task / strips, r0 = task % strips * S, count = std::min(S, rows - r0);
      for (Index i = 0; i < count; ++i) {
        const Index a = (r0 + i) / r2, z = (r0 + i) % r2;
        from[i] = b * x.stride(0) + a * x.stride(1) + z * x.stride(2);
        to[i] = b * out.stride(0) + a * out.stride(2) + z * out.stride(3);
      }
      const Index xc = x.stride(3), oc = out.stride(1);
      for (Index c = 0; c < cols; ++c)
        for (Index i = 0; i < count; ++i) po[to[i] + c * oc] = px[from[i] + c * xc];
    }
  });
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

// out (N, H + 2 ph, W + 2 pw, C), contiguous: x (N, C, H, W, any strides) channels-last inside a zero border.
template <typename T>
void pad(const at::Tensor& x, const at::Tensor& out, Index ph, Index pw) {
  const Index c = x.size(1), h = x.size(2), wd = x.size(3), hp = out.size(1), wp = out.size(2);
  const Index x0 = x.stride(0), x1 = x.stride(1), x2 = x.stride(2), x3 = x.stride(3);
  const T* px = x.data_ptr<T>();
  T* po = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      T* image = po + b * hp * wp * c;
      std::fill(image, image + ph * wp * c, T(0));
      std::fill(image + (ph + h) * wp * c, image + hp * wp * c, T(0));
      for (Index y = 0; y < h; ++y) {
        T* row = image + (y + ph) * wp * c;
        std::fill(row, row + pw * c, T(0));
        std::fill(row + (pw + wd) * c, row + wp * c, T(0));
        for (Index ch = 0; ch < c; ++ch) {
          const T* from = px + b * x0 + ch * x1 + y * x2;
          for (Index q = 0; q < wd; ++q) row[(pw + q) * c + ch] = from[q * x3];
        }
      }
    }
  });
}

// out (n, oh, ow, kh, kw, C)'s worth of fields, read from a padded, channels-last image (N, Hp, Wp, C),
// contiguous, by the products below: where each output position's field starts, and where each of its
// kernel offsets and channels lies from there.
struct FieldTables {
  std::vector<Index> position, offset, run;
};

FieldTables field_tables(const at::Tensor& image, Index kh, Index kw, Index sh, Index sw, Index dh, Index dw) {
  const Index n = image.size(0), hp = image.size(1), wp = image.size(2), c = image.size(3);
  const Index oh = out_size(hp, kh, sh, 0, dh), ow = out_size(wp, kw, sw, 0, dw);
  TORCH_CHECK(oh > 0 && ow > 0, "lockstep_blas: the kernel does not fit the padded image");
  FieldTables t{std::vector<Index>(n * oh * ow), std::vector<Index>(kh * kw * c), std::vector<Index>(kh * kw * c)};
  for (Index b = 0, r = 0; b < n; ++b)
    for (Index y = 0; y < oh; ++y)
      for (Index x = 0; x < ow; ++x) t.position[r++] = ((b * hp + y * sh) * wp + x * sw) * c;
  for (Index i = 0, q = 0; i < kh; ++i)
    for (Index j = 0; j < kw; ++j)
      for (Index ch = 0; ch < c; ++ch) t.offset[q++] = (i * dh * wp + j * dw) * c + ch;
  for (Index q = kh * kw * c - 1; q >= 0; --q)  // how many offsets from q on are consecutive
    t.run[q] = q + 1 < kh * kw * c && t.offset[q + 1] == t.offset[q] + 1 ? t.run[q + 1] + 1 : 1;
  return t;
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

// The input gradient of a convolution without groups, computed where it is summed: for each output row,
// its columns (dY's positions times the weights, each element one chain over the output channels, as
// gemm_chunks computes them), added at once onto the input positions that row read. Every input position
// sums its terms from zero in the order of the kernel offsets (i, then j), as gather_fields does: the
// output rows are taken from the last to the first (an input row's kernel row i grows as the output row
// that read it falls), and within one output row the offsets j in order. So the bytes are those of the
// columns written out and gathered, without the columns (kh * kw times the input) ever leaving the cache.
// grad: (N * oh * ow, O), row-major; weight: (O, kh * kw * C), row-major; out: (N, C, H, W), any strides.
template <typename T>
void input_gradient(int64_t width, const at::Tensor& grad, const at::Tensor& weight, const at::Tensor& out, Index oh,
                    Index ow, Index kh, Index kw, Geometry k) {
  const Index n = out.size(0), c = out.size(1), h = out.size(2), wd = out.size(3);
  const Index o = grad.size(1), fields = kh * kw * c, ldg = grad.stride(0);
  const Operand sw{weight.stride(0), weight.stride(1)};
  const Index o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2), o3 = out.stride(3);
  const T* pg = grad.data_ptr<T>();
  const T* pw = weight.data_ptr<T>();
  T* po = out.data_ptr<T>();
  // Positions per product: enough that packing the weights (once per product) is small beside it, few
  // enough that the columns (positions x fields) stay in cache: at least 48 (whole strips of 12 or 6 rows)
  const Index positions = std::clamp<Index>((Index(1) << 17) / fields, 48, 512);
  const Index rows = std::min(oh, (positions + ow - 1) / ow);                       // output rows per product
  // small images: several per product, but no fewer units than two per thread (a batch of small images in one
  // unit would leave the other threads idle); how the images are grouped changes no sum's order
  const Index most = std::max<Index>(1, n / (2 * at::get_num_threads()));
  const Index images = rows < oh ? 1 : std::clamp<Index>(positions / (oh * ow), 1, most);
  const std::vector<T> packed = packed_for<T>(width, pw, sw, o, fields);  // once for every product below
  at::parallel_for(0, (n + images - 1) / images, 1, [&](int64_t first, int64_t last) {
    std::vector<T> columns(images * rows * ow * fields), sums(h * wd * c);
    for (int64_t unit = first; unit < last; ++unit) {
      const Index b0 = unit * images, nb = std::min(images, n - b0);
      if (rows == oh) {  // whole images: their columns in one product
        const Matrix<T> g{pg + b0 * oh * ow * ldg, {ldg, 1}};
        product<T>(width, nb * oh * ow, fields, o, g, pw, sw, columns.data(), fields, packed.data());
      }
      for (Index b = b0; b < b0 + nb; ++b) {
        std::fill(sums.begin(), sums.end(), T(0));
        for (Index y1 = oh; y1 > 0; y1 -= rows) {
          const Index y0 = std::max<Index>(0, y1 - rows);
          if (rows < oh) {  // a block of rows, from the last
            const Matrix<T> g{pg + (b * oh + y0) * ow * ldg, {ldg, 1}};
            product<T>(width, (y1 - y0) * ow, fields, o, g, pw, sw, columns.data(), fields, packed.data());
          }
          // the block's first row: this image's first (whole images) or row y0 (a block of rows)
          const T* block = columns.data() + (rows < oh ? 0 : (b - b0) * oh * ow * fields);
          for (Index y = y1 - 1; y >= y0; --y) {
            const T* row = block + (rows < oh ? y - y0 : y) * ow * fields;
            for (Index i = 0; i < kh; ++i) {
              const Index yin = y * k.sh + i * k.dh - k.ph;
              if (yin < 0 || yin >= h) continue;
              for (Index j = 0; j < kw; ++j) {
                const Span xs = span(wd, ow, k.sw, j * k.dw - k.pw);
                for (Index x = xs.first; x < xs.last; ++x) {
                  T* to = sums.data() + (yin * wd + x * k.sw + j * k.dw - k.pw) * c;
                  const T* from = row + x * fields + (i * kw + j) * c;
                  for (Index ch = 0; ch < c; ++ch) to[ch] += from[ch];
                }
              }
            }
          }
        }
        for (Index ch = 0; ch < c; ++ch)
          for (Index y = 0; y < h; ++y)
            for (Index x = 0; x < wd; ++x) po[b * o0 + ch * o1 + y * o2 + x * o3] = sums[(y * wd + x) * c + ch];
      }
    }
  });
}
