// Box-Muller's transform of uniform draws into normal ones, included by blas_pool.cpp once per vector width
// (as activations.h). tasks/determinism/sampling.py's `_box_muller` is the same sequence of float32
// operations in torch's elementwise ops (the same bytes; tested): each rounded once (no fused multiply-add:
// built with -ffp-contract=off), the log Cephes' logf (reductions.py's `log`), the root correctly rounded (as
// reductions.py's `sqrt`), the cosine and sine Cephes' cosf and sinf (sampling.py's `sincos`). The constants
// are the Python floats of those files, rounded to float32 as torch rounds a scalar meeting a float32 tensor.
// Here because ~60 passes of torch's ops over each block cost ~1.1 s for a 28M-weight model's draws.

// Cephes' logf of x in [2^-24, 1] (1 - u for a uniform draw u in [0, 1), exact in float32): a positive normal
// number, so frexp's mantissa and exponent are its bits'.
[[gnu::always_inline]] inline float log_of_draw(float x) {
  constexpr float sqrt_half = static_cast<float>(0.70710678118654752440);
  constexpr float ln2_high = static_cast<float>(0.693359375), ln2_low = static_cast<float>(-2.12194440e-4);
  constexpr float poly[] = {static_cast<float>(7.0376836292e-2),  static_cast<float>(-1.1514610310e-1),
                            static_cast<float>(1.1676998740e-1),  static_cast<float>(-1.2420140846e-1),
                            static_cast<float>(1.4249322787e-1),  static_cast<float>(-1.6668057665e-1),
                            static_cast<float>(2.0000714765e-1),  static_cast<float>(-2.4999993993e-1),
                            static_cast<float>(3.3333331174e-1)};
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const float mantissa = std::bit_cast<float>((bits & 0x007fffffu) | 0x3f000000u);  // in [0.5, 1)
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);
  const bool small = mantissa < sqrt_half;
  e = small ? e - 1.0f : e;
  const float m = small ? (mantissa + mantissa) - 1.0f : mantissa - 1.0f;
  const float z = m * m;
  float p = poly[0];
  for (int k = 1; k < 9; ++k) p = p * m + poly[k];
  const float y = ((m * z) * p + e * ln2_low) - z * 0.5f;
  return (m + y) + e * ln2_high;
}

// Chunks of 16 uniform draws in [0, 1) (torch's normal_fill_16 layout: the first 8 are u1, the last 8 u2) ->
// 16 normal ones: r cos(theta) in the first 8, r sin(theta) in the last, with r = sqrt(-2 log(1 - u1)) and
// theta = 2 pi u2 (in float64, then rounded).
inline void box_muller_chunks(const float* u, float* out, Index chunks) {
  constexpr double two_pi = 6.283185307179586;
  constexpr float four_over_pi = static_cast<float>(1.27323954473516);
  constexpr float dp1 = static_cast<float>(0.78515625), dp2 = static_cast<float>(2.4187564849853515625e-4);
  constexpr float dp3 = static_cast<float>(3.77489497744594108e-8);
  constexpr float sin0 = static_cast<float>(-1.9515295891e-4), sin1 = static_cast<float>(8.3321608736e-3);
  constexpr float sin2 = static_cast<float>(-1.6666654611e-1);
  constexpr float cos0 = static_cast<float>(2.443315711809948e-5), cos1 = static_cast<float>(-1.388731625493765e-3);
  constexpr float cos2 = static_cast<float>(4.166664568298827e-2);
  for (Index c = 0; c < chunks; ++c) {
    const float* first = u + 16 * c;
    float* to = out + 16 * c;
    for (int j = 0; j < 8; ++j) {
      const float radius = std::sqrt(log_of_draw(1.0f - first[j]) * -2.0f);
      const float theta = static_cast<float>(static_cast<double>(first[8 + j]) * two_pi);
      float octant = std::floor(theta * four_over_pi);
      octant = octant + (octant - 2.0f * std::floor(octant * 0.5f));  // to an even one (theta >= 0)
      const float r = ((theta - octant * dp1) - octant * dp2) - octant * dp3;
      const float z = r * r;
      float s = sin0;
      s = s * z + sin1;
      s = s * z + sin2;
      s = (s * z) * r + r;
      float k = cos0;
      k = k * z + cos1;
      k = k * z + cos2;
      k = (((k * z) * z) - z * 0.5f) + 1.0f;
      const int turn = static_cast<int>(octant) & 7;  // 0, 2, 4 or 6
      const bool swap = turn == 2 || turn == 6;
      float cosine = swap ? s : k, sine = swap ? k : s;
      cosine = (turn == 2 || turn == 4) ? -cosine : cosine;
      sine = turn >= 4 ? -sine : sine;
      to[j] = radius * cosine;
      to[8 + j] = radius * sine;
    }
  }
}
