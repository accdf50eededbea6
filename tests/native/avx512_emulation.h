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
struct I16x32 {
  uint16_t h[32];
};
struct I32x16 {
  int32_t i[16];
};

inline F16 floats(simde__m512 v) {
  F16 out;
  std::memcpy(out.f, &v, sizeof(out.f));
  return out;
}
inline simde__m512 vec(const F16& a) {
  simde__m512 v;
  std::memcpy(&v, a.f, sizeof(a.f));
  return v;
}
inline I32x16 ints(simde__m512i v) {
  I32x16 out;
  std::memcpy(out.i, &v, sizeof(out.i));
  return out;
}
inline simde__m512i vec(const I32x16& a) {
  simde__m512i v;
  std::memcpy(&v, a.i, sizeof(a.i));
  return v;
}

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  F16 r{};
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(&r.f[i], static_cast<const char*>(p) + 4 * i, 4);
  return vec(r);
}

inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 v) {
  const F16 a = floats(v);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + 4 * i, &a.f[i], 4);
}

inline simde__m512i maskz_loadu_epi16(simde__mmask32 k, const void* p) {
  I16x32 r{};
  for (int i = 0; i < 32; ++i)
    if ((k >> i) & 1) std::memcpy(&r.h[i], static_cast<const char*>(p) + 2 * i, 2);
  simde__m512i v;
  std::memcpy(&v, r.h, sizeof(r.h));
  return v;
}

inline void mask_storeu_epi16(void* p, simde__mmask32 k, simde__m512i v) {
  I16x32 a;
  std::memcpy(a.h, &v, sizeof(a.h));
  for (int i = 0; i < 32; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + 2 * i, &a.h[i], 2);
}

inline simde__m512i cvtepu16_epi32(__m256i h) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
  simde__m512i v;
  std::memcpy(reinterpret_cast<char*>(&v), &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}

inline __m256i cvtepi32_epi16(simde__m512i v) {  // truncates each lane to its low 16 bits
  const I32x16 a = ints(v);
  alignas(32) uint16_t h[16];
  for (int i = 0; i < 16; ++i) h[i] = static_cast<uint16_t>(static_cast<uint32_t>(a.i[i]));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
}

inline simde__m512 cvtph_ps(__m256i h) {
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  simde__m512 v;
  std::memcpy(reinterpret_cast<char*>(&v), &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}

// The rounding argument must be a constant, as for the instruction.
#define HETERO_EMU_CVTPS_PH(v, rounding)                                                       \
  [&]() {                                                                                      \
    const hetero_emulation::F16 a_ = hetero_emulation::floats(v);                              \
    const __m128i lo_ = _mm256_cvtps_ph(_mm256_loadu_ps(a_.f), rounding);                      \
    const __m128i hi_ = _mm256_cvtps_ph(_mm256_loadu_ps(a_.f + 8), rounding);                  \
    return _mm256_set_m128i(hi_, lo_);                                                         \
  }()

}  // namespace hetero_emulation

#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) hetero_emulation::maskz_loadu_ps(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, v) hetero_emulation::mask_storeu_ps(p, k, v)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) hetero_emulation::maskz_loadu_epi16(k, p)
#undef _mm512_mask_storeu_epi16
#define _mm512_mask_storeu_epi16(p, k, v) hetero_emulation::mask_storeu_epi16(p, k, v)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(h) hetero_emulation::cvtepu16_epi32(h)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(v) hetero_emulation::cvtepi32_epi16(v)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(h) hetero_emulation::cvtph_ps(h)
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(v, rounding) HETERO_EMU_CVTPS_PH(v, rounding)
