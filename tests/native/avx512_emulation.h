// AVX-512 intrinsics on a CPU without AVX-512, for testing csrc/cpu_adam.cpp's AVX-512 path.
//
// Only tests/test_cpu_adam.py uses this: it builds the kernel a second time with
// -DHETERO_EMULATE_AVX512 -mavx2 -mfma -mf16c, and cpu_adam.cpp then includes this header instead
// of compiling its AVX-512 functions for the real instructions. The path's own logic (masked tails,
// conversions, the order of operations) is what runs; each 512-bit instruction is replaced by
// something with the same result:
//  - SIMDe (libsimde-dev; apt-get install libsimde-dev) provides most of them, built from the
//    AVX2 / FMA / F16C instruction on each 256-bit half, so a fused multiply-add stays fused and
//    rounding stays the hardware's;
//  - the eight that SIMDe 0.7.4 lacks are defined below, lane by lane from Intel's definitions
//    (masked loads and stores touch only the lanes of the mask), or on 256-bit halves with the
//    F16C / AVX2 instruction of the same name.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#if defined(SIMDE_X86_AVX512F_NATIVE) || !defined(SIMDE_X86_AVX2_NATIVE) || \
    !defined(SIMDE_X86_FMA_NATIVE) || !defined(SIMDE_X86_F16C_NATIVE)
#error "the AVX-512 emulation is built with -mavx2 -mfma -mf16c and without -mavx512f"
#endif

namespace hetero_emulation {

struct F16 {
  float f[16];
};
struct I32x16 {
  int32_t i[16];
};

// The same 64 (or 32) bytes seen as another type.
template <typename To, typename From>
inline To bits(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bits: the types differ in size");
  To out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

template <typename Wide, typename Half>
inline Wide join(const Half& lo, const Half& hi) {
  static_assert(sizeof(Wide) == 2 * sizeof(Half), "join: not two halves");
  Wide v;
  std::memcpy(reinterpret_cast<char*>(&v), &lo, sizeof(Half));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(Half), &hi, sizeof(Half));
  return v;
}

// Masked loads and stores of `Lanes` lanes: only the lanes set in `k` are read or written.
template <typename Vec, int Lanes>
inline Vec maskz_loadu(uint32_t k, const void* p) {
  constexpr int w = sizeof(Vec) / Lanes;
  unsigned char r[sizeof(Vec)] = {};
  for (int i = 0; i < Lanes; ++i)
    if ((k >> i) & 1) std::memcpy(r + w * i, static_cast<const char*>(p) + w * i, w);
  return bits<Vec>(r);
}

template <int Lanes, typename Vec>
inline void mask_storeu(void* p, uint32_t k, const Vec& v) {
  constexpr int w = sizeof(Vec) / Lanes;
  const auto* a = reinterpret_cast<const unsigned char*>(&v);
  for (int i = 0; i < Lanes; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + w * i, a + w * i, w);
}

inline simde__m512i cvtepu16_epi32(__m256i h) {
  return join<simde__m512i>(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                            _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}

inline __m256i cvtepi32_epi16(simde__m512i v) {  // truncates each lane to its low 16 bits
  const I32x16 a = bits<I32x16>(v);
  alignas(32) uint16_t h[16];
  for (int i = 0; i < 16; ++i) h[i] = static_cast<uint16_t>(static_cast<uint32_t>(a.i[i]));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
}

inline simde__m512 cvtph_ps(__m256i h) {
  return join<simde__m512>(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                           _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}

// The rounding argument must be a constant, as for the instruction.
#define HETERO_EMU_CVTPS_PH(v, rounding)                                                       \
  [&]() {                                                                                      \
    const auto a_ = hetero_emulation::bits<hetero_emulation::F16>(v);                          \
    const __m128i lo_ = _mm256_cvtps_ph(_mm256_loadu_ps(a_.f), rounding);                      \
    const __m128i hi_ = _mm256_cvtps_ph(_mm256_loadu_ps(a_.f + 8), rounding);                  \
    return hetero_emulation::join<__m256i>(lo_, hi_);                                          \
  }()

}  // namespace hetero_emulation

#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) hetero_emulation::maskz_loadu<simde__m512, 16>(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, v) hetero_emulation::mask_storeu<16>(p, k, v)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) hetero_emulation::maskz_loadu<simde__m512i, 32>(k, p)
#undef _mm512_mask_storeu_epi16
#define _mm512_mask_storeu_epi16(p, k, v) hetero_emulation::mask_storeu<32>(p, k, v)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(h) hetero_emulation::cvtepu16_epi32(h)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(v) hetero_emulation::cvtepi32_epi16(v)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(h) hetero_emulation::cvtph_ps(h)
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(v, rounding) HETERO_EMU_CVTPS_PH(v, rounding)
