// Fused Adam / AdamW over flat CPU chunks (see cpu_adam.h for the contract).
//
// Three code paths compute the same thing bit for bit: AVX-512 (F+BW, 16 lanes, masked tails),
// AVX2 (+FMA, F16C; 8 lanes, scalar tail) and portable scalar. The SIMD paths are compiled with
// __attribute__((target(...))) so the extension needs no special flags and still builds and runs
// where a path is absent; the path is picked per call from what the CPU reports
// (__builtin_cpu_supports, which also checks that the OS saves the wide registers).
//
// Bit-exactness with torch rests on four rules: every operation is a single IEEE operation on
// float32 (mul, add, sub, div, or a fused multiply-add exactly where torch's kernels fuse one); the
// build uses -ffp-contract=off so the compiler fuses nothing else (GCC would otherwise contract
// intrinsics such as p * decay + x into an fma); the square root is the one torch's Tensor.sqrt
// uses; hyper-parameters are rounded from double to float exactly where torch rounds them. Where
// torch fuses and which sqrt it uses depend on how torch was built and the CPU capability it runs
// at, so both are measured once against torch itself (torch_numerics). Elementwise exactness makes
// the result independent of the thread split, and the three paths interchangeable.
#include "cpu_adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>

#include <ATen/Parallel.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HETERO_X86 1
#include <immintrin.h>
#define HETERO_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#if defined(HETERO_EMULATE_AVX512)
// Test builds only (tests/test_cpu_adam.py, with -mavx2 -mfma -mf16c): the AVX-512 path below is
// compiled against an emulation of its intrinsics on AVX2, so that it runs, and is tested, on CPUs
// without AVX-512. Never defined by setup.py.
#include "avx512_emulation.h"
#define HETERO_TARGET_AVX512 HETERO_TARGET_AVX2
#else
#define HETERO_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#endif
// Helpers of the loops are forced inline: GCC otherwise keeps some out of line (a call per vector
// with the vectors passed through the stack cost ~20% of single-thread throughput).
#define HETERO_INLINE inline __attribute__((always_inline))
#else
#define HETERO_X86 0  // only the portable path; isa_supported() reports it alone
#define HETERO_INLINE inline
#endif

// MKL's single-precision vector sqrt (MKL_INT n, MKL_INT64 mode), as exported by the MKL inside
// libtorch_cpu. Weak: null where torch has no MKL (then torch's sqrt is the IEEE instruction).
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
// Thread-local MKL thread count (returns the previous one; 0 = the global setting), also weak.
extern "C" int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));

namespace hetero {
namespace {

// ------------------------------------------------------------------------------------ ISA choice

CpuIsa parse_isa(const std::string& name, const char* source) {
  if (name == "avx512") return CpuIsa::kAvx512;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "scalar") return CpuIsa::kScalar;
  throw std::invalid_argument(std::string(source) + "='" + name +
                              "' is not a code path; expected avx512, avx2 or scalar");
}

CpuIsa best_isa() {
  if (isa_supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (isa_supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

int64_t resolve_threads(int64_t threads) {
  return threads > 0 ? threads : std::max<int64_t>(1, at::get_num_threads());
}

// Runs fn(begin, end) over [0, n) on up to `threads` threads (the calling thread is one of them).
// The range is cut into about 8 pieces per thread (at least 64K elements; a multiple of 64: whole
// cache lines of fp32 and bf16, so threads never share a line they write) that threads take in
// order from an atomic counter: a thread the OS preempts (the machine is shared) delays only its
// current piece, where a static split would make every call wait for the slowest thread; pieces
// stay large so each thread streams long runs (prefetchers re-train at every jump). Results do not
// depend on the split (the kernels are elementwise).
//
// The threads: torch's own pool (at::parallel_for) when `threads` is torch's thread count, the
// default. Its workers are alive and, right after any torch op, still spinning on the cores;
// starting threads of our own then would oversubscribe the cores for the first milliseconds of
// every step. For another count, threads are started per call: a call updates a chunk (~64 MiB),
// next to which the ~20 us of thread start-up is noise. No thread is used for under two pieces.
template <typename Fn>
void parallel_ranges(int64_t n, int64_t threads, const Fn& fn) {
  constexpr int64_t kMinPiece = int64_t{1} << 16;  // 256 KiB per fp32 stream
  const int64_t piece =
      std::max(kMinPiece, (n / (8 * std::max<int64_t>(threads, 1)) + 63) / 64 * 64);
  const int64_t pieces = (n + piece - 1) / piece;
  const int64_t workers_wanted = std::min<int64_t>(threads, pieces);
  if (workers_wanted <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < pieces;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(k * piece, std::min(n, (k + 1) * piece));
    }
  };
  if (threads == at::get_num_threads() && !at::in_parallel_region()) {
    at::parallel_for(0, workers_wanted, 1, [&](int64_t b, int64_t e) {
      for (int64_t w = b; w < e; ++w) work();
    });
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(workers_wanted - 1);
  try {
    for (int64_t t = 1; t < workers_wanted; ++t) workers.emplace_back(work);
  } catch (...) {  // could not start a thread: the ones running (and this one) finish the work
    work();
    for (auto& w : workers) w.join();
    throw;
  }
  work();
  for (auto& w : workers) w.join();
}

// ------------------------------------------------------------------------ scalar building blocks

enum class Grad { kF32, kBF16, kF16 };
enum class Out { kNone, kBF16, kF16 };

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

HETERO_INLINE float bf16_to_f32(uint16_t h) { return float_of(uint32_t{h} << 16); }

// Round to nearest even; a NaN keeps its sign and top payload bits and is made quiet.
HETERO_INLINE uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Exact (every fp16 value is a float); a NaN is made quiet as F16C's vcvtph2ps does.
HETERO_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (mant << 13));
  const float sub = static_cast<float>(mant) * 0x1p-24f;  // subnormal (or zero): exact
  return float_of(sign | bits_of(sub));
}

// Round to nearest even with overflow to inf and gradual underflow, as F16C's vcvtps2ph does;
// a NaN keeps its sign and top payload bits and is made quiet.
HETERO_INLINE uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a >= 0x38800000u) {  // normal in fp16 (>= 2^-14): rebias the exponent, round 13 bits off
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
  }
  // fp16 subnormal or zero: the result is round(x / 2^-24); x = full * 2^(e - 150).
  const uint32_t e = a >> 23;
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25 (half the least subnormal)
  const uint32_t full = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14..24
  uint32_t q = full >> shift;
  const uint32_t rem = full & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

// ----------------------------------------------------------------------------- the square root
//
// torch's Tensor.sqrt is not always IEEE sqrt: a torch built with MKL (the x86 wheels) computes
// float sqrt with MKL's vmsSqrt in its "high accuracy" mode, which is faithful but not correctly
// rounded (on this project's AMD EPYC, 17% of all floats in [1, 4) get a result 1 ulp off). Adam
// amplifies such differences wherever a gradient is pure rounding noise (m / sqrt(v) normalises it
// to +-1), so to equal torch.optim.Adam after several steps the kernel takes its square roots from
// the same function, a block at a time from L1 (the symbol is resolved weakly from libtorch_cpu,
// which this extension links). Which function torch uses is checked once against at::sqrt. With
// sqrt="ieee" the kernel uses the hardware instruction inline instead (one pass, faster; then it
// equals torch's fused=True CPU AdamW, which does the same, to float32 rounding).

using BlockSqrt = void (*)(int n, const float* in, float* out);
constexpr int64_t kSqrtBlock = 1024;  // elements per block: 4 KiB per fp32 stream, L1-resident

// torch's mode for MKL VML calls (ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr long long kTorchVmlMode = 0x2 | 0x140000 | 0x100;

void mkl_block_sqrt(int n, const float* in, float* out) { vmsSqrt(n, in, out, kTorchVmlMode); }

// Keeps MKL sequential on this thread while alive (restoring the previous setting after): the
// kernel's threads are its parallelism. Without it, MKL called from a thread of the kernel's own
// may start an OpenMP team per call (measured on the 2-core machine: a step ~100x slower).
class MklSequential {
 public:
  explicit MklSequential(bool active)
      : active_(active && MKL_Set_Num_Threads_Local != nullptr),
        previous_(active_ ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~MklSequential() {
    if (active_) MKL_Set_Num_Threads_Local(previous_);
  }
  MklSequential(const MklSequential&) = delete;
  MklSequential& operator=(const MklSequential&) = delete;

 private:
  bool active_;
  int previous_;
};

// How torch's CPU kernels round here. Its vectorized add(alpha), lerp and addcmul use a fused
// multiply-add where torch's kernels were compiled for an FMA capability (AVX2, AVX-512; its
// DEFAULT capability rounds the product and the sum separately), and its sqrt is IEEE or MKL's.
// Measured once by running those torch ops on a spread of values and comparing with both
// candidates; the kernel then takes the same path.
struct TorchNumerics {
  bool fma_add, fma_lerp, fma_addcmul;
  bool mkl_sqrt;
};

const TorchNumerics& torch_numerics() {
  static const TorchNumerics tn = [] {
    constexpr int n = 4096 + 7;  // vector body and scalar tail of torch's loops alike
    std::vector<float> a(n), b(n), c(n);
    const auto mantissa = [n](int64_t i, int64_t prime) {  // a scrambled spread over [1, 2)
      return 1.0f + static_cast<float>((i * prime) % n) / n;
    };
    for (int i = 0; i < n; ++i) {
      a[i] = std::ldexp(mantissa(i, 7919), i % 61 - 30);
      b[i] = std::ldexp(mantissa(i, 104729), i % 13 - 6) * (i % 3 ? 1.0f : -1.0f);
      c[i] = std::ldexp(mantissa(i, 15485863), i % 17 - 8);
    }
    const auto T = [n](std::vector<float>& v) { return at::from_blob(v.data(), {n}, at::kFloat); };
    const float w = 0.1f, alpha = 0.05f, value = 1e-3f;
    const at::Tensor add = at::add(T(a), T(b), alpha).contiguous();
    const at::Tensor lerp = at::lerp(T(a), T(b), w).contiguous();
    const at::Tensor addcmul = at::addcmul(T(c), T(b), T(b), value).contiguous();
    const at::Tensor root = at::sqrt(T(c)).contiguous();
    std::vector<float> mkl(n);
    if (vmsSqrt != nullptr) mkl_block_sqrt(n, c.data(), mkl.data());
    int add_f = 0, add_u = 0, lerp_f = 0, lerp_u = 0, cm_f = 0, cm_u = 0, sq_i = 0, sq_m = 0;
    const auto same = [](float x, float y) { return bits_of(x) == bits_of(y); };
    for (int i = 0; i < n; ++i) {
      add_f += same(add.data_ptr<float>()[i], std::fma(b[i], alpha, a[i]));
      add_u += same(add.data_ptr<float>()[i], b[i] * alpha + a[i]);
      const float d = b[i] - a[i];
      lerp_f += same(lerp.data_ptr<float>()[i], std::fma(w, d, a[i]));
      lerp_u += same(lerp.data_ptr<float>()[i], w * d + a[i]);
      cm_f += same(addcmul.data_ptr<float>()[i], std::fma(value * b[i], b[i], c[i]));
      cm_u += same(addcmul.data_ptr<float>()[i], value * b[i] * b[i] + c[i]);
      sq_i += same(root.data_ptr<float>()[i], std::sqrt(c[i]));
      sq_m += vmsSqrt != nullptr && same(root.data_ptr<float>()[i], mkl[i]);
    }
    return TorchNumerics{add_f > add_u, lerp_f > lerp_u, cm_f > cm_u, sq_m > sq_i};
  }();
  return tn;
}

// Hyper-parameters rounded to float where torch's kernels round them (Scalar.to<float>()).
struct Consts {
  bool scaled, decay, l2, small;
  bool fma_add, fma_lerp, fma_addcmul;  // as torch's kernels (TorchNumerics)
  float scale;   // grad_scale
  float keep;    // 1 - lr*wd (AdamW)
  float wd;      // wd (Adam, L2)
  float w1;      // lerp weight 1 - beta1
  float w1m1;    // w1 - 1, torch's lerp coefficient when w1 >= 0.5
  float b2;      // beta2
  float omb2;    // 1 - beta2
  float bc2s;    // sqrt(1 - beta2^step)
  float eps;
  float neg_ss;  // -lr / (1 - beta1^step)
  BlockSqrt block_sqrt;  // nullptr: IEEE sqrt inline; else square roots a block at a time
};

Consts make_consts(const AdamHyper& h, const TorchNumerics& tn, BlockSqrt block_sqrt) {
  Consts c{};
  c.fma_add = tn.fma_add;
  c.fma_lerp = tn.fma_lerp;
  c.fma_addcmul = tn.fma_addcmul;
  c.block_sqrt = block_sqrt;
  c.scaled = h.grad_scale != 1.0;
  c.scale = static_cast<float>(h.grad_scale);
  c.decay = h.weight_decay != 0 && h.decoupled;
  c.l2 = h.weight_decay != 0 && !h.decoupled;
  c.keep = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.wd = static_cast<float>(h.weight_decay);
  c.w1 = static_cast<float>(1.0 - h.beta1);
  c.small = std::abs(c.w1) < 0.5f;  // torch's is_lerp_weight_small
  c.w1m1 = c.w1 - 1.0f;
  c.b2 = static_cast<float>(h.beta2);
  c.omb2 = static_cast<float>(1.0 - h.beta2);
  // As torch's Python: beta ** float(step), bias_correction2 ** 0.5, all in double.
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  c.bc2s = static_cast<float>(std::pow(bc2, 0.5));
  c.eps = static_cast<float>(h.eps);
  c.neg_ss = static_cast<float>(-(h.lr / bc1));
  return c;
}

struct Ptrs {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* out;
};

template <Grad G>
HETERO_INLINE float load_grad(const void* g, int64_t i) {
  if constexpr (G == Grad::kF32) return static_cast<const float*>(g)[i];
  if constexpr (G == Grad::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  if constexpr (G == Grad::kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <Out O>
HETERO_INLINE void store_out(void* out, int64_t i, float p) {
  if constexpr (O == Out::kBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
  if constexpr (O == Out::kF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
}

// Software prefetch: one cache line of each fp32 stream (and the matching part of the grad) a
// distance ahead, issued once per 16 elements. The one-pass loops prefetch kPrefetchAhead ahead:
// the hardware prefetchers alone leave the division/sqrt-heavy loop short of the bandwidth a plain
// streaming loop reaches. The block-wise (MKL sqrt) loops prefetch the next block between the
// square-root calls of the current one (block_sqrt_prefetching). Prefetching past the end of a
// buffer is harmless (a prefetch never faults).
constexpr int64_t kPrefetchAhead = 1024;  // 4 KiB per fp32 stream

template <Grad G>
HETERO_INLINE void prefetch_line(const Ptrs& t, int64_t i) {
  __builtin_prefetch(t.p + i, 1);
  __builtin_prefetch(t.m + i, 1);
  __builtin_prefetch(t.v + i, 1);
  if constexpr (G == Grad::kF32) {
    __builtin_prefetch(static_cast<const float*>(t.g) + i, 0);
  } else if ((i & 31) == 0) {  // 32 bf16/fp16 grads per line: every other call
    __builtin_prefetch(static_cast<const uint16_t*>(t.g) + i, 0);
  }
}

// The square roots of block [b, e) for the block-wise (MKL sqrt) paths, taken in kSqrtSub-element
// calls, each preceded by prefetches of the matching part of the next block: memory streams the
// next block in while MKL computes, instead of idling through the whole call.
constexpr int64_t kSqrtSub = 256;

template <Grad G>
HETERO_INLINE void block_sqrt_prefetching(const Consts& c, const Ptrs& t, int64_t b, int64_t e,
                                          int64_t end, float* sq) {
  for (int64_t j = b; j < e; j += kSqrtSub) {
    const int64_t je = std::min(e, j + kSqrtSub);
    const int64_t ahead_end = std::min(end, je + kSqrtBlock);
    for (int64_t i = j + kSqrtBlock; i < ahead_end; i += 16) prefetch_line<G>(t, i);
    c.block_sqrt(static_cast<int>(je - j), t.v + j, sq + (j - b));
  }
}

// The update of one element in two halves, the reference every SIMD path reproduces lane by lane:
// moments1 (gradient scale, weight decay, m and v) and param1 (the step, given sqrt(v)). Between
// them the caller takes the square root: inline (IEEE) or over a block (torch's MKL sqrt).
HETERO_INLINE float madd1(bool fused, float a, float b, float c) {
  return fused ? std::fma(a, b, c) : a * b + c;
}

HETERO_INLINE void moments1(const Consts& c, float& p, float g, float& m, float& v) {
  if (c.scaled) g = g * c.scale;
  if (c.decay) p = p * c.keep;
  if (c.l2) g = madd1(c.fma_add, p, c.wd, g);
  const float d = g - m;
  m = c.small ? madd1(c.fma_lerp, c.w1, d, m) : madd1(c.fma_lerp, c.w1m1, d, g);
  v = v * c.b2;
  v = madd1(c.fma_addcmul, c.omb2 * g, g, v);
}

HETERO_INLINE float param1(const Consts& c, float p, float m, float sqrt_v) {
  const float den = sqrt_v / c.bc2s + c.eps;
  return p + (c.neg_ss * m) / den;
}

// The kernels below first copy Consts and Ptrs into locals: their stores go through may_alias
// vector types, so the compiler would otherwise reload every flag and pointer from memory after
// each store (measured: ~20% of single-thread throughput).
template <Grad G, Out O>
void adam_scalar(const Consts& c_in, const Ptrs& t_in, int64_t begin, int64_t end) {
  const Consts c = c_in;
  const Ptrs t = t_in;
  if (c.block_sqrt == nullptr) {
    for (int64_t i = begin; i < end; ++i) {
      moments1(c, t.p[i], load_grad<G>(t.g, i), t.m[i], t.v[i]);
      t.p[i] = param1(c, t.p[i], t.m[i], std::sqrt(t.v[i]));
      store_out<O>(t.out, i, t.p[i]);
    }
    return;
  }
  alignas(64) float sq[kSqrtBlock];
  for (int64_t b = begin; b < end; b += kSqrtBlock) {
    const int64_t e = std::min(end, b + kSqrtBlock);
    for (int64_t i = b; i < e; ++i) moments1(c, t.p[i], load_grad<G>(t.g, i), t.m[i], t.v[i]);
    block_sqrt_prefetching<G>(c, t, b, e, end, sq);
    for (int64_t i = b; i < e; ++i) {
      t.p[i] = param1(c, t.p[i], t.m[i], sq[i - b]);
      store_out<O>(t.out, i, t.p[i]);
    }
  }
}

#if HETERO_X86
// --------------------------------------------------------------------------------------- AVX2

struct Consts8 {
  __m256 scale, keep, wd, w1, w1m1, b2, omb2, bc2s, eps, neg_ss;
};

HETERO_TARGET_AVX2 HETERO_INLINE Consts8 broadcast8(const Consts& c) {
  return {_mm256_set1_ps(c.scale), _mm256_set1_ps(c.keep), _mm256_set1_ps(c.wd),
          _mm256_set1_ps(c.w1),    _mm256_set1_ps(c.w1m1), _mm256_set1_ps(c.b2),
          _mm256_set1_ps(c.omb2),  _mm256_set1_ps(c.bc2s), _mm256_set1_ps(c.eps),
          _mm256_set1_ps(c.neg_ss)};
}

template <Grad G>
HETERO_TARGET_AVX2 HETERO_INLINE __m256 load_grad8(const void* g, int64_t i) {
  if constexpr (G == Grad::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == Grad::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// bf16 bits (in the low 16 bits of each 32-bit lane) of x, rounded to nearest even, NaN quieted.
HETERO_TARGET_AVX2 HETERO_INLINE __m256i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

template <Out O>
HETERO_TARGET_AVX2 HETERO_INLINE void store_out8(void* out, int64_t i, __m256 p) {
  if constexpr (O != Out::kNone) {
    __m128i h;
    if constexpr (O == Out::kF16) {
      h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    } else {
      // packus works per 128-bit lane: [r0..3 r0..3 | r4..7 r4..7]; gather quads 0 and 2.
      const __m256i r = bf16_bits8(p);
      h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
  }
}

HETERO_TARGET_AVX2 HETERO_INLINE __m256 madd8(bool fused, __m256 a, __m256 b, __m256 c) {
  return fused ? _mm256_fmadd_ps(a, b, c) : _mm256_add_ps(_mm256_mul_ps(a, b), c);
}

HETERO_TARGET_AVX2 HETERO_INLINE void moments8(const Consts& c, const Consts8& k, __m256& p,
                                               __m256 g, __m256& m, __m256& v) {
  if (c.scaled) g = _mm256_mul_ps(g, k.scale);
  if (c.decay) p = _mm256_mul_ps(p, k.keep);
  if (c.l2) g = madd8(c.fma_add, p, k.wd, g);
  const __m256 d = _mm256_sub_ps(g, m);
  m = c.small ? madd8(c.fma_lerp, k.w1, d, m) : madd8(c.fma_lerp, k.w1m1, d, g);
  v = madd8(c.fma_addcmul, _mm256_mul_ps(k.omb2, g), g, _mm256_mul_ps(v, k.b2));
}

HETERO_TARGET_AVX2 HETERO_INLINE __m256 param8(const Consts8& k, __m256 p, __m256 m,
                                               __m256 sqrt_v) {
  const __m256 den = _mm256_add_ps(_mm256_div_ps(sqrt_v, k.bc2s), k.eps);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(k.neg_ss, m), den));
}

// The whole update of 8 elements in one pass (hardware sqrt).
template <Grad G, Out O>
HETERO_TARGET_AVX2 HETERO_INLINE void one_pass8(const Consts& c, const Consts8& k, const Ptrs& t,
                                                int64_t i) {
  __m256 p = _mm256_loadu_ps(t.p + i), m = _mm256_loadu_ps(t.m + i), v = _mm256_loadu_ps(t.v + i);
  moments8(c, k, p, load_grad8<G>(t.g, i), m, v);
  p = param8(k, p, m, _mm256_sqrt_ps(v));
  _mm256_storeu_ps(t.p + i, p);
  _mm256_storeu_ps(t.m + i, m);
  _mm256_storeu_ps(t.v + i, v);
  store_out8<O>(t.out, i, p);
}

template <Grad G, Out O>
HETERO_TARGET_AVX2 void adam_avx2(const Consts& c_in, const Ptrs& t_in, int64_t begin,
                                  int64_t end) {
  const Consts c = c_in;
  const Ptrs t = t_in;
  const Consts8 k = broadcast8(c);
  if (c.block_sqrt == nullptr) {  // one pass, hardware sqrt
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {  // a cache line of fp32 per stream per iteration
      prefetch_line<G>(t, i + kPrefetchAhead);
      one_pass8<G, O>(c, k, t, i);
      one_pass8<G, O>(c, k, t, i + 8);
    }
    for (; i + 8 <= end; i += 8) one_pass8<G, O>(c, k, t, i);
    adam_scalar<G, O>(c_in, t_in, i, end);  // < 8 left; bit-identical to the lanes above
    return;
  }
  // Block-wise: moments of a block, its square roots in one call, then the params (from L1).
  alignas(64) float sq[kSqrtBlock];
  for (int64_t b = begin; b < end; b += kSqrtBlock) {
    const int64_t e = std::min(end, b + kSqrtBlock);
    int64_t i = b;
    for (; i + 8 <= e; i += 8) {
      __m256 p = _mm256_loadu_ps(t.p + i), m = _mm256_loadu_ps(t.m + i),
             v = _mm256_loadu_ps(t.v + i);
      moments8(c, k, p, load_grad8<G>(t.g, i), m, v);
      if (c.decay) _mm256_storeu_ps(t.p + i, p);
      _mm256_storeu_ps(t.m + i, m);
      _mm256_storeu_ps(t.v + i, v);
    }
    for (; i < e; ++i) moments1(c, t.p[i], load_grad<G>(t.g, i), t.m[i], t.v[i]);
    block_sqrt_prefetching<G>(c, t, b, e, end, sq);
    for (i = b; i + 8 <= e; i += 8) {
      const __m256 p = param8(k, _mm256_loadu_ps(t.p + i), _mm256_loadu_ps(t.m + i),
                              _mm256_load_ps(sq + (i - b)));
      _mm256_storeu_ps(t.p + i, p);
      store_out8<O>(t.out, i, p);
    }
    for (; i < e; ++i) {
      t.p[i] = param1(c, t.p[i], t.m[i], sq[i - b]);
      store_out<O>(t.out, i, t.p[i]);
    }
  }
}

// ------------------------------------------------------------------------------------- AVX-512
//
// GCC 12's avx512fintrin.h feeds an undefined register to unmasked intrinsics as their unused
// merge source and then warns that it "may be used uninitialized" (GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

struct Consts16 {
  __m512 scale, keep, wd, w1, w1m1, b2, omb2, bc2s, eps, neg_ss;
};

HETERO_TARGET_AVX512 HETERO_INLINE Consts16 broadcast16(const Consts& c) {
  return {_mm512_set1_ps(c.scale), _mm512_set1_ps(c.keep), _mm512_set1_ps(c.wd),
          _mm512_set1_ps(c.w1),    _mm512_set1_ps(c.w1m1), _mm512_set1_ps(c.b2),
          _mm512_set1_ps(c.omb2),  _mm512_set1_ps(c.bc2s), _mm512_set1_ps(c.eps),
          _mm512_set1_ps(c.neg_ss)};
}

// Masked loads and stores touch only the lanes in `k` (no fault past the end), so the tail runs
// through the same code as the body.
template <Grad G>
HETERO_TARGET_AVX512 HETERO_INLINE __m512 load_grad16(const void* g, int64_t i, __mmask16 k) {
  if constexpr (G == Grad::kF32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm512_castsi512_si256(
        _mm512_maskz_loadu_epi16(static_cast<__mmask32>(k), static_cast<const uint16_t*>(g) + i));
    if constexpr (G == Grad::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <Out O>
HETERO_TARGET_AVX512 HETERO_INLINE void store_out16(void* out, int64_t i, __m512 p, __mmask16 k) {
  if constexpr (O != Out::kNone) {
    __m256i h;
    if constexpr (O == Out::kF16) {
      h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m512i u = _mm512_castps_si512(p);
      const __m512i hi = _mm512_srli_epi32(u, 16);
      const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                            _mm512_set1_epi32(0x7FFF));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
      const __m512i nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
      const __mmask16 is_nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
    }
    _mm512_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, static_cast<__mmask32>(k),
                             _mm512_castsi256_si512(h));
  }
}

HETERO_TARGET_AVX512 HETERO_INLINE __mmask16 lanes16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

HETERO_TARGET_AVX512 HETERO_INLINE __m512 madd16(bool fused, __m512 a, __m512 b, __m512 c) {
  return fused ? _mm512_fmadd_ps(a, b, c) : _mm512_add_ps(_mm512_mul_ps(a, b), c);
}

HETERO_TARGET_AVX512 HETERO_INLINE void moments16(const Consts& c, const Consts16& q, __m512& p,
                                                  __m512 g, __m512& m, __m512& v) {
  if (c.scaled) g = _mm512_mul_ps(g, q.scale);
  if (c.decay) p = _mm512_mul_ps(p, q.keep);
  if (c.l2) g = madd16(c.fma_add, p, q.wd, g);
  const __m512 d = _mm512_sub_ps(g, m);
  m = c.small ? madd16(c.fma_lerp, q.w1, d, m) : madd16(c.fma_lerp, q.w1m1, d, g);
  v = madd16(c.fma_addcmul, _mm512_mul_ps(q.omb2, g), g, _mm512_mul_ps(v, q.b2));
}

HETERO_TARGET_AVX512 HETERO_INLINE __m512 param16(const Consts16& q, __m512 p, __m512 m,
                                                  __m512 sqrt_v) {
  const __m512 den = _mm512_add_ps(_mm512_div_ps(sqrt_v, q.bc2s), q.eps);
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(q.neg_ss, m), den));
}

template <Grad G, Out O>
HETERO_TARGET_AVX512 void adam_avx512(const Consts& c_in, const Ptrs& t_in, int64_t begin,
                                      int64_t end) {
  const Consts c = c_in;
  const Ptrs t = t_in;
  const Consts16 q = broadcast16(c);
  if (c.block_sqrt == nullptr) {  // one pass, hardware sqrt
    for (int64_t i = begin; i < end; i += 16) {
      prefetch_line<G>(t, i + kPrefetchAhead);
      const __mmask16 k = lanes16(end - i);
      __m512 p = _mm512_maskz_loadu_ps(k, t.p + i), m = _mm512_maskz_loadu_ps(k, t.m + i),
             v = _mm512_maskz_loadu_ps(k, t.v + i);
      moments16(c, q, p, load_grad16<G>(t.g, i, k), m, v);
      p = param16(q, p, m, _mm512_sqrt_ps(v));
      _mm512_mask_storeu_ps(t.p + i, k, p);
      _mm512_mask_storeu_ps(t.m + i, k, m);
      _mm512_mask_storeu_ps(t.v + i, k, v);
      store_out16<O>(t.out, i, p, k);
    }
    return;
  }
  alignas(64) float sq[kSqrtBlock];
  for (int64_t b = begin; b < end; b += kSqrtBlock) {
    const int64_t e = std::min(end, b + kSqrtBlock);
    for (int64_t i = b; i < e; i += 16) {
      const __mmask16 k = lanes16(e - i);
      __m512 p = _mm512_maskz_loadu_ps(k, t.p + i), m = _mm512_maskz_loadu_ps(k, t.m + i),
             v = _mm512_maskz_loadu_ps(k, t.v + i);
      moments16(c, q, p, load_grad16<G>(t.g, i, k), m, v);
      if (c.decay) _mm512_mask_storeu_ps(t.p + i, k, p);
      _mm512_mask_storeu_ps(t.m + i, k, m);
      _mm512_mask_storeu_ps(t.v + i, k, v);
    }
    block_sqrt_prefetching<G>(c, t, b, e, end, sq);
    for (int64_t i = b; i < e; i += 16) {
      const __mmask16 k = lanes16(e - i);
      const __m512 p = param16(q, _mm512_maskz_loadu_ps(k, t.p + i),
                               _mm512_maskz_loadu_ps(k, t.m + i),
                               _mm512_maskz_loadu_ps(k, sq + (i - b)));
      _mm512_mask_storeu_ps(t.p + i, k, p);
      store_out16<O>(t.out, i, p, k);
    }
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // HETERO_X86

// ------------------------------------------------------------------------------------ dispatch

using AdamFn = void (*)(const Consts&, const Ptrs&, int64_t, int64_t);

template <Grad G, Out O>
AdamFn pick(CpuIsa isa) {
#if HETERO_X86
  if (isa == CpuIsa::kAvx512) return &adam_avx512<G, O>;
  if (isa == CpuIsa::kAvx2) return &adam_avx2<G, O>;
#endif
  (void)isa;
  return &adam_scalar<G, O>;
}

template <Grad G>
AdamFn pick(CpuIsa isa, Out o) {
  switch (o) {
    case Out::kBF16: return pick<G, Out::kBF16>(isa);
    case Out::kF16: return pick<G, Out::kF16>(isa);
    default: return pick<G, Out::kNone>(isa);
  }
}

AdamFn pick(CpuIsa isa, Grad g, Out o) {
  switch (g) {
    case Grad::kBF16: return pick<Grad::kBF16>(isa, o);
    case Grad::kF16: return pick<Grad::kF16>(isa, o);
    default: return pick<Grad::kF32>(isa, o);
  }
}

void check_flat(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.defined(), name, " is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " is on ", t.device(), "; expected a CPU tensor");
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " is not contiguous; expected a flat chunk slice");
  TORCH_CHECK_VALUE(t.numel() == numel, name, " has ", t.numel(), " elements; expected ", numel,
                    " (as param)");
}

// --------------------------------------------------------------------------------- stream probe

constexpr int kMaxStreams = 8;

struct StreamPtrs {
  const float* read[kMaxStreams];
  float* update[kMaxStreams];
  int nr, nu;
  float scale;
};

// Per vector: acc = scale * sum of the read streams, then u += acc for each update stream, so
// every stream advances together as in the Adam kernel, with the same software prefetch (one line
// of every stream kPrefetchAhead elements ahead per 16 elements): the probe must not be slower at
// moving bytes than the kernel it bounds. The pointers are copied to locals first (as in the Adam
// kernels: vector stores may alias anything else).
HETERO_INLINE void stream_prefetch(const StreamPtrs& s, int64_t i) {
  for (int r = 0; r < s.nr; ++r) __builtin_prefetch(s.read[r] + i, 0);
  for (int u = 0; u < s.nu; ++u) __builtin_prefetch(s.update[u] + i, 1);
}

void stream_scalar(const StreamPtrs& s_in, int64_t begin, int64_t end) {
  const StreamPtrs s = s_in;
  for (int64_t i = begin; i < end; ++i) {
    if ((i - begin) % 16 == 0) stream_prefetch(s, i + kPrefetchAhead);
    float acc = 0.0f;
    for (int r = 0; r < s.nr; ++r) acc += s.read[r][i];
    acc = acc * s.scale;
    for (int u = 0; u < s.nu; ++u) s.update[u][i] += acc;
  }
}

#if HETERO_X86
HETERO_TARGET_AVX2 HETERO_INLINE void stream8(const StreamPtrs& s, __m256 scale, int64_t i) {
  __m256 acc = _mm256_setzero_ps();
  for (int r = 0; r < s.nr; ++r) acc = _mm256_add_ps(acc, _mm256_loadu_ps(s.read[r] + i));
  acc = _mm256_mul_ps(acc, scale);
  for (int u = 0; u < s.nu; ++u)
    _mm256_storeu_ps(s.update[u] + i, _mm256_add_ps(_mm256_loadu_ps(s.update[u] + i), acc));
}

HETERO_TARGET_AVX2 void stream_avx2(const StreamPtrs& s_in, int64_t begin, int64_t end) {
  const StreamPtrs s = s_in;
  const __m256 scale = _mm256_set1_ps(s.scale);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    stream_prefetch(s, i + kPrefetchAhead);
    stream8(s, scale, i);
    stream8(s, scale, i + 8);
  }
  for (; i + 8 <= end; i += 8) stream8(s, scale, i);
  stream_scalar(s_in, i, end);
}

HETERO_TARGET_AVX512 void stream_avx512(const StreamPtrs& s_in, int64_t begin, int64_t end) {
  const StreamPtrs s = s_in;
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t i = begin; i < end; i += 16) {
    stream_prefetch(s, i + kPrefetchAhead);
    const __mmask16 k = lanes16(end - i);
    __m512 acc = _mm512_setzero_ps();
    for (int r = 0; r < s.nr; ++r)
      acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(k, s.read[r] + i));
    acc = _mm512_mul_ps(acc, scale);
    for (int u = 0; u < s.nu; ++u)
      _mm512_mask_storeu_ps(s.update[u] + i, k,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(k, s.update[u] + i), acc));
  }
}
#endif  // HETERO_X86

}  // namespace

// ---------------------------------------------------------------------------------- public API

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

bool isa_supported(CpuIsa isa) {
#if HETERO_X86
  __builtin_cpu_init();
  switch (isa) {
    case CpuIsa::kAvx512:
#if defined(HETERO_EMULATE_AVX512)
      return isa_supported(CpuIsa::kAvx2);
#else
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             isa_supported(CpuIsa::kAvx2);
#endif
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default: return true;
  }
#else
  return isa == CpuIsa::kScalar;
#endif
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kScalar})
    if (isa_supported(isa)) out.emplace_back(isa_name(isa));
  return out;
}

CpuIsa resolve_isa(const std::string& requested) {
  std::string name = requested;
  const char* source = "isa";
  if (name.empty() || name == "auto") {
    const char* env = std::getenv("HETERO_ADAM_ISA");
    if (env == nullptr || *env == '\0') return best_isa();
    name = env;
    source = "HETERO_ADAM_ISA";
  }
  const CpuIsa isa = parse_isa(name, source);
  if (!isa_supported(isa)) {
    std::string have;
    for (const auto& s : available_isas()) have += (have.empty() ? "" : ", ") + s;
    throw std::invalid_argument(std::string(source) + "='" + name +
                                "' is not supported by this CPU; available: " + have);
  }
  return isa;
}

std::string torch_sqrt() { return torch_numerics().mkl_sqrt ? "mkl" : "ieee"; }

bool torch_uses_fma() {
  const TorchNumerics& tn = torch_numerics();
  return tn.fma_add && tn.fma_lerp && tn.fma_addcmul;
}

struct PreparedAdam {
  Consts c;
  Ptrs t;
  AdamFn fn;
  int64_t n;
  int64_t threads;
  bool mkl;
};

std::shared_ptr<const PreparedAdam> prepare_adam_step(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
    const AdamHyper& hyper, const std::string& isa_name_requested, int64_t threads,
    const std::string& sqrt) {
  TORCH_CHECK_VALUE(param.defined(), "param is undefined");
  const int64_t n = param.numel();
  check_flat(param, "param", n);
  check_flat(grad, "grad", n);
  check_flat(exp_avg, "exp_avg", n);
  check_flat(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK_TYPE(param.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                       exp_avg_sq.scalar_type() == at::kFloat,
                   "param, exp_avg and exp_avg_sq must be float32; got ", param.scalar_type(), ", ",
                   exp_avg.scalar_type(), ", ", exp_avg_sq.scalar_type());
  Grad g;
  switch (grad.scalar_type()) {
    case at::kFloat: g = Grad::kF32; break;
    case at::kBFloat16: g = Grad::kBF16; break;
    case at::kHalf: g = Grad::kF16; break;
    default: TORCH_CHECK_TYPE(false, "grad must be float32, bfloat16 or float16; got ",
                              grad.scalar_type());
  }
  Out o = Out::kNone;
  if (param_out.has_value() && param_out->defined()) {
    check_flat(*param_out, "param_out", n);
    switch (param_out->scalar_type()) {
      case at::kBFloat16: o = Out::kBF16; break;
      case at::kHalf: o = Out::kF16; break;
      default: TORCH_CHECK_TYPE(false, "param_out must be bfloat16 or float16; got ",
                                param_out->scalar_type());
    }
  }
  TORCH_CHECK_VALUE(hyper.step >= 1, "step must be >= 1 (the step count after this update); got ",
                    hyper.step);
  TORCH_CHECK_VALUE(sqrt == "torch" || sqrt == "ieee", "sqrt='", sqrt,
                    "' is not accepted; expected 'torch' or 'ieee'");
  const CpuIsa isa = resolve_isa(isa_name_requested);
  const TorchNumerics& tn = torch_numerics();
  const bool mkl = sqrt == "torch" && tn.mkl_sqrt;
  return std::make_shared<const PreparedAdam>(PreparedAdam{
      make_consts(hyper, tn, mkl ? &mkl_block_sqrt : nullptr),
      Ptrs{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(),
           exp_avg_sq.data_ptr<float>(), o == Out::kNone ? nullptr : param_out->data_ptr()},
      pick(isa, g, o), n, resolve_threads(threads), mkl});
}

void run_prepared_adam(const PreparedAdam& p) {
  if (p.n == 0) return;
  parallel_ranges(p.n, p.threads, [&](int64_t begin, int64_t end) {
    const MklSequential sequential(p.mkl);
    p.fn(p.c, p.t, begin, end);
  });
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
               const AdamHyper& hyper, const std::string& isa, int64_t threads,
               const std::string& sqrt) {
  run_prepared_adam(*prepare_adam_step(param, grad, exp_avg, exp_avg_sq, param_out, hyper, isa,
                                       threads, sqrt));
}

int64_t stream_update(const std::vector<at::Tensor>& read, const std::vector<at::Tensor>& update,
                      double scale, const std::string& isa_name_requested, int64_t threads) {
  TORCH_CHECK_VALUE(!update.empty(), "stream_update needs at least one tensor to update");
  TORCH_CHECK_VALUE(read.size() <= kMaxStreams && update.size() <= kMaxStreams,
                    "stream_update takes at most ", kMaxStreams, " read and ", kMaxStreams,
                    " update tensors");
  const int64_t n = update[0].numel();
  StreamPtrs s{};
  s.nr = static_cast<int>(read.size());
  s.nu = static_cast<int>(update.size());
  s.scale = static_cast<float>(scale);
  for (size_t r = 0; r < read.size(); ++r) {
    check_flat(read[r], "read tensor", n);
    TORCH_CHECK_TYPE(read[r].scalar_type() == at::kFloat, "stream_update takes float32 tensors");
    s.read[r] = read[r].data_ptr<float>();
  }
  for (size_t u = 0; u < update.size(); ++u) {
    check_flat(update[u], "update tensor", n);
    TORCH_CHECK_TYPE(update[u].scalar_type() == at::kFloat, "stream_update takes float32 tensors");
    s.update[u] = update[u].data_ptr<float>();
  }
  const CpuIsa isa = resolve_isa(isa_name_requested);
  void (*fn)(const StreamPtrs&, int64_t, int64_t) = &stream_scalar;
#if HETERO_X86
  if (isa == CpuIsa::kAvx512) fn = &stream_avx512;
  if (isa == CpuIsa::kAvx2) fn = &stream_avx2;
#endif
  parallel_ranges(n, resolve_threads(threads),
                  [&](int64_t begin, int64_t end) { fn(s, begin, end); });
  return n * 4 * (s.nr + 2 * s.nu);
}

}  // namespace hetero
