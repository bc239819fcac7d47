// Activations whose every element is computed one way, included by blas_pool.cpp once per vector width (as
// fma_chain.h). ATen's CPU kernels compute a tensor's body with vectors and its tail, at the end of each
// thread's share, with scalar code of another formula (a faster exp in the vectors), so an element's value
// followed the thread count. Here each element is the same sequence of float32 operations, each rounded
// once (+, -, *, / and rounding to an integer; no fused multiply-add: built with -ffp-contract=off), in a
// vector lane or alone; tasks/determinism/activations.py repeats it with torch's elementwise ops (the
// same bytes; tested). Constants are written in hex: exactly the float32 values, parsed alike everywhere.

// e^x: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, so n ln2 is exact), e^r by Cephes' expf polynomial,
// then times 2^n in two exact halves (each a normal float), so that the result rounds once into the
// subnormals below e^-87 and overflows to infinity above e^88.7. x is held to [-104, 89], past which e^x
// is 0 and infinity anyway; NaN stays NaN.
[[gnu::always_inline]] inline float exp_of(float x) {
  x = x < -0x1.ap+6f ? -0x1.ap+6f : x;
  x = x > 0x1.64p+6f ? 0x1.64p+6f : x;
  const float n = std::rint(x * 0x1.715476p+0f);
  const float r = (x - n * 0x1.63p-1f) - n * -0x1.bd0106p-13f;
  float p = 0x1.a0d2cep-13f;
  p = p * r + 0x1.6e879cp-10f;
  p = p * r + 0x1.111210p-7f;
  p = p * r + 0x1.555382p-5f;
  p = p * r + 0x1.555554p-3f;
  p = p * r + 0x1p-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  const int32_t low = static_cast<int32_t>(n) >> 1, high = static_cast<int32_t>(n) - low;  // n in [-150, 128]
  return (y * std::bit_cast<float>((low + 127) << 23)) * std::bit_cast<float>((high + 127) << 23);
}

// erf(z), Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7), as ATen's vectorised erf, given
// e = e^-z^2 (as exp_of(-(|z| |z|)); the GELU's gradient needs it too).
[[gnu::always_inline]] inline float erf_given(float z, float e) {
  const float a = std::fabs(z);
  const float t = 1.0f / (0x1.4f740ap-2f * a + 1.0f);
  float p = 0x1.0fb844p+0f;
  p = p * t + -0x1.7401c6p+0f;
  p = p * t + 0x1.6be1c6p+0f;
  p = p * t + -0x1.23531cp-2f;
  p = p * t + 0x1.04f20cp-2f;
  return std::copysign(1.0f - (p * t) * e, z);
}

[[gnu::always_inline]] inline float gauss_of(float z) { return exp_of(-(std::fabs(z) * std::fabs(z))); }  // e^-z^2

// 1 + tanh(u) = 2 / (e^-2u + 1), without the cancelling of 1 + tanh(u) where tanh(u) is near -1.
[[gnu::always_inline]] inline float one_plus_tanh(float u) { return 2.0f / (exp_of(-(u + u)) + 1.0f); }

// out[i] = the activation (`kind`, blas_pool.cpp's Activation) of x[i]; a backward one's gradient, given the gradient g[i] of its output.
inline void activate(int64_t kind, const float* x, const float* g, float* out, Index n) {
  constexpr float half = 0.5f, sqrt_half = 0x1.6a09e6p-1f, beta = 0x1.988454p-2f;  // 1/sqrt(2), 1/sqrt(2 pi)
  constexpr float tanh_beta = 0x1.988454p-1f, kappa = 0x1.6e4e26p-5f;                 // sqrt(2/pi), 0.044715
  switch (kind) {
    case kSigmoid:
      for (Index i = 0; i < n; ++i) out[i] = 1.0f / (exp_of(-x[i]) + 1.0f);
      break;
    case kSilu:
      for (Index i = 0; i < n; ++i) out[i] = x[i] / (exp_of(-x[i]) + 1.0f);
      break;
    case kSiluBackward:
      for (Index i = 0; i < n; ++i) {
        const float s = 1.0f / (exp_of(-x[i]) + 1.0f);
        out[i] = g[i] * (s * (x[i] * (1.0f - s) + 1.0f));
      }
      break;
    case kGelu:
      for (Index i = 0; i < n; ++i) {
        const float z = x[i] * sqrt_half;
        out[i] = (x[i] * half) * (erf_given(z, gauss_of(z)) + 1.0f);
      }
      break;
    case kGeluBackward:
      for (Index i = 0; i < n; ++i) {
        const float z = x[i] * sqrt_half, e = gauss_of(z);  // e^-x^2/2: for erf, and the density's own
        const float cdf = half * (erf_given(z, e) + 1.0f);
        const float pdf = beta * e;
        out[i] = g[i] * (x[i] * pdf + cdf);
      }
      break;
    case kGeluTanh:
      for (Index i = 0; i < n; ++i) {
        const float inner = tanh_beta * (kappa * (x[i] * (x[i] * x[i])) + x[i]);
        out[i] = (x[i] * half) * one_plus_tanh(inner);
      }
      break;
    case kGeluTanhBackward:
      for (Index i = 0; i < n; ++i) {
        const float square = x[i] * x[i];
        const float u = tanh_beta * (kappa * (x[i] * square) + x[i]);
        const float plus = one_plus_tanh(u), sech2 = plus * one_plus_tanh(-u);  // 1 - tanh(u)^2
        const float left = half * plus;
        const float right = ((x[i] * half) * sech2) * (tanh_beta * ((3.0f * kappa) * square + 1.0f));
        out[i] = g[i] * (left + (sech2 == 0.0f ? 0.0f : right));  // (far out, x^2 overflows: 0 times infinity)
      }
      break;
  }
}
