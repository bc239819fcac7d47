// The portable products' blocking and their operands, included once by blas_pool.cpp (after the
// micro-kernels, fma_chain.h, and the helpers it names: Index, Operand, narrow/wide).
//
// c (m x n, row stride ldc) = a (m x k) @ b (k x n), each element the micro-kernel's chain over all of k.
// The usual blocking (BLIS's): b in blocks of KC x NC packed into panels NR wide, so that the kernel
// reads them in order from cache; a strip of MR rows of a at a time, from its source (below): a matrix
// read in place, or rows gathered into a buffer. Blocks and edges decide only where the chain is
// computed, never its order: a block of k carries each element's chain on from the value stored in c
// (exact, in T), and edge tiles run the same kernel on zero-padded panels and a copy of c's corner. Why a
// kernel of our own and not a BLAS: no BLAS promises an order, and OpenBLAS's own kernels do not keep
// one from one instruction set to the next, so the bytes followed its kernel choice and held only while
// every CPU ran its AVX2 kernels, also where AVX-512 ones are faster.

template <typename T>
using Kernel = void (*)(Index, const T*, Index, const T*, T*, Index, bool, const T*);

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

// MR rows of a, k from pc to pc + kc, as the kernel reads them: a[i * step + q] (`rows`) or a[q * step + i].
template <typename T>
struct Strip {
  const T* a;
  Index step;
  bool rows;
};

// A matrix, read in place by the kernel that suits its layout (packing it cost more than it saved: a is
// read once per NR columns of the result), or packed where a strip has fewer than MR rows.
template <typename T>
struct Matrix {
  const T* a;
  Operand sa;
  Matrix from_row(Index start) const { return {a + start * sa.rows, sa}; }
  template <int MR>
  Strip<T> strip(Index ir, Index h, Index pc, Index kc, T* buffer) const {
    const T* from = a + ir * sa.rows + pc * sa.cols;
    if (h < MR) {
      pack<T, MR>(buffer, from, sa.rows, sa.cols, h, kc);
      return {buffer, MR, false};
    }
    return sa.cols == 1 ? Strip<T>{from, sa.rows, true} : Strip<T>{from, sa.cols, false};
  }
};

// A convolution's fields, im2col's columns never written out: element (r, q) of the columns (r an output
// position, q a kernel offset and channel, channels fastest) is image[position[r] + offset[q]], the image
// padded and channels-last; offset[q] to offset[q + run[q] - 1] are consecutive (a kernel row's channels,
// or all of its columns' when they touch). `transposed`: a is the columns' transpose (the weight
// gradient's). Each strip is copied into a buffer that stays in cache; the values, so the products, are the
// columns'.
template <typename T>
struct Fields {
  const T* image;
  const Index* position;
  const Index* offset;
  const Index* run;
  bool transposed;
  Fields from_row(Index start) const {
    return transposed ? Fields{image, position, offset + start, run + start, true}
                      : Fields{image, position + start, offset, run, false};
  }
  template <int MR>
  Strip<T> strip(Index ir, Index h, Index pc, Index kc, T* buffer) const {
    if (!transposed) {  // rows: output positions, k: offsets; each row kc values, copied run by run
      for (Index i = 0; i < MR; ++i) {
        T* to = buffer + i * kc;
        if (i >= h) {
          std::fill(to, to + kc, T(0));
          continue;
        }
        const T* from = image + position[ir + i];
        for (Index q = pc; q < pc + kc;) {
          const Index length = std::min(run[q], pc + kc - q);
          std::memcpy(to + (q - pc), from + offset[q], length * sizeof(T));
          q += length;
        }
      }
      return {buffer, kc, true};
    }
    const bool whole = h == MR && run[ir] >= MR;  // the strip's offsets consecutive: one copy per position
    for (Index q = 0; q < kc; ++q) {  // rows: offsets, k: output positions
      const T* from = image + position[pc + q];
      T* to = buffer + q * MR;
      if (whole) {
        std::memcpy(to, from + offset[ir], MR * sizeof(T));
        continue;
      }
      for (Index i = 0; i < MR; ++i) to[i] = i < h ? from[offset[ir + i]] : T(0);
    }
    return {buffer, MR, false};
  }
};

constexpr Index KC = 256, NC = 256;  // b's block: 256 KiB in float32, within a 512 KiB L2

// The length of k's blocks for a b of n columns (panels NR wide): KC, or longer where b is narrower than NC,
// up to the same block size. Each block after the first reads c back and stores it again, and a tall
// product's c (a convnext stage's 32768 x 96) is out of cache by then: a narrow b cut at KC would pass over
// it twice where once suffices. At most twice KC: a strip of a (MR x the length) must stay in L1.
template <int NR>
Index depth(Index n) {
  const Index width = (std::min(n, NC) + NR - 1) / NR * NR;
  return std::clamp<Index>(KC * NC / std::max<Index>(width, 1), KC, 2 * KC);
}

// b's block of rows pc to pc + kc and columns jc to jc + nc, as the kernel reads it: panels NR values wide.
template <typename T, int NR>
void pack_block(const T* b, Operand sb, Index pc, Index kc, Index jc, Index nc, T* to) {
  for (Index jr = 0; jr < nc; jr += NR)
    pack<T, NR>(to + jr * kc, b + pc * sb.rows + (jc + jr) * sb.cols, sb.cols, sb.rows, std::min<Index>(NR, nc - jr),
                kc);
}

// b (k x n) packed whole, block after block in the order chain_product reads them: the block of columns
// jc and rows pc starts at jc * k + pc * (its width rounded up to NR).
template <typename T, int NR>
void pack_blocks(const T* b, Operand sb, Index k, Index n, T* to) {
  const Index kb = depth<NR>(n);
  for (Index jc = 0; jc < n; jc += NC) {
    const Index nc = std::min(NC, n - jc), ncp = (nc + NR - 1) / NR * NR;
    for (Index pc = 0; pc < k; pc += kb) {
      const Index kc = std::min(kb, k - pc);
      pack_block<T, NR>(b, sb, pc, kc, jc, nc, to);
      to += ncp * kc;
    }
  }
}

// `packed`: b already packed by pack_blocks (shared by the products of one call that all multiply by it),
// or null: each block packed here as it is needed. `bias` (n values, or null): added to every row once its
// chains are complete (addmm's), in the pass that stores them rather than in another over c.
template <typename T, int MR, int NR, typename Source>
void chain_product(Kernel<T> rows, Kernel<T> panel, Index m, Index n, Index k, const Source& a, const T* b,
                   Operand sb, T* c, Index ldc, const T* packed, const T* bias) {
  static_assert(NC % NR == 0);
  thread_local std::vector<T> pa, pb;
  const Index kb = depth<NR>(n);  // (pack_blocks' too, for the same n)
  pa.resize(MR * 2 * KC);
  if (!packed) pb.resize(KC * NC);  // (never shrunk: growing it again would fill it with zeros)
  T edge[MR * NR];
  if (k == 0) {  // no terms: every chain is its starting zero
    for (Index i = 0; i < m; ++i) {
      if (bias) std::copy(bias, bias + n, c + i * ldc);  // (0 + bias: bias, also for -0)
      else std::fill(c + i * ldc, c + i * ldc + n, T(0));
    }
    return;
  }
  for (Index jc = 0; jc < n; jc += NC) {
    const Index nc = std::min(NC, n - jc);
    for (Index pc = 0; pc < k; pc += kb) {
      const Index kc = std::min(kb, k - pc);
      const T* panels = packed ? packed + jc * k + pc * ((nc + NR - 1) / NR * NR) : pb.data();
      if (!packed) pack_block<T, NR>(b, sb, pc, kc, jc, nc, pb.data());
      for (Index ir = 0; ir < m; ir += MR) {
        const Index h = std::min<Index>(MR, m - ir);
        const Strip<T> s = a.template strip<MR>(ir, h, pc, kc, pa.data());
        const Kernel<T> kernel = s.rows ? rows : panel;
        const bool last = pc + kc == k;
        for (Index jr = 0; jr < nc; jr += NR) {
          const Index w = std::min<Index>(NR, nc - jr);
          T* tile = c + ir * ldc + jc + jr;
          const T* add = bias && last ? bias + jc + jr : nullptr;
          if (h == MR && w == NR) {
            kernel(kc, s.a, s.step, panels + jr * kc, tile, ldc, pc == 0, add);
            continue;
          }
          for (Index i = 0; i < h && pc > 0; ++i) std::memcpy(edge + i * NR, tile + i * ldc, w * sizeof(T));
          kernel(kc, s.a, s.step, panels + jr * kc, edge, NR, pc == 0, nullptr);  // (bias: w values, not NR)
          for (Index i = 0; i < h; ++i) {
            if (!add) {
              std::memcpy(tile + i * ldc, edge + i * NR, w * sizeof(T));
              continue;
            }
            for (Index j = 0; j < w; ++j) tile[i * ldc + j] = edge[i * NR + j] + add[j];
          }
        }
      }
    }
  }
}

// One product (or a chunk of one) on the calling thread, with the widest kernel `width` allows.
template <typename T, typename Source>
void product(int64_t width, Index m, Index n, Index k, const Source& a, const T* b, Operand sb, T* c, Index ldc,
             const T* packed = nullptr, const T* bias = nullptr) {
  if (width == kWideBits) {
    using L = wide::Lanes<T>;
    chain_product<T, L::MR, 2 * L::W>(wide::micro_kernel<T, true>, wide::micro_kernel<T, false>, m, n, k, a, b,
                                      sb, c, ldc, packed, bias);
  } else {
    using L = narrow::Lanes<T>;
    chain_product<T, L::MR, 2 * L::W>(narrow::micro_kernel<T, true>, narrow::micro_kernel<T, false>, m, n, k, a, b, sb,
                                      c, ldc, packed, bias);
  }
}

// b (k x n) packed for `product` at `width` (pack_blocks' layout, for that width's panels).
template <typename T>
std::vector<T> packed_for(int64_t width, const T* b, Operand sb, Index k, Index n) {
  const Index nr = 2 * (width == kWideBits ? wide::Lanes<T>::W : narrow::Lanes<T>::W);
  std::vector<T> to(k * ((n + NC - 1) / NC * NC + nr));
  width == kWideBits ? pack_blocks<T, 2 * wide::Lanes<T>::W>(b, sb, k, n, to.data())
               : pack_blocks<T, 2 * narrow::Lanes<T>::W>(b, sb, k, n, to.data());
  return to;
}

// Every group's product cut into chunks (blas.py's plan), and the (group, chunk) pairs shared out on
// torch's pool, each computed on one thread. `source(g)`: group g's a. `bias`: n values added to each row
// of every group's product, or null.
template <typename T, typename Sources>
void run(int64_t width, Index groups, Index m, Index k, Sources source, const at::Tensor& b, Operand sb,
         const at::Tensor& out, int64_t dim, int64_t chunk, const T* bias = nullptr) {
  const Index n = b.size(2);
  const T* pb = b.data_ptr<T>();
  T* pc = out.data_ptr<T>();
  const Index gb = b.stride(0), gc = out.stride(0), ldc = out.stride(1);
  const Index extent = dim == 0 ? m : n;
  const Index chunks = (extent + chunk - 1) / chunk;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const Index g = task / chunks, start = (task % chunks) * chunk, size = std::min<Index>(chunk, extent - start);
      const T* bg = pb + g * gb;
      T* cg = pc + g * gc;
      if (dim == 0) {  // rows of out: rows of a
        product<T>(width, size, n, k, source(g).from_row(start), bg, sb, cg + start * ldc, ldc, nullptr, bias);
      } else {  // columns of out: columns of b
        product<T>(width, m, size, k, source(g), bg + start * sb.cols, sb, cg + start, ldc, nullptr,
                   bias ? bias + start : nullptr);
      }
    }
  });
}
