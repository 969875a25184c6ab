// tolk::int8_linear: y[m, n] = scales[n] * sum_k x[m, k] * w[n, k] for float32 x, int8 w.
//
// Weight-only int8 for the small-M GEMMs of decode, where a CPU is bound by reading the
// weights: a quarter of float32's bytes, and small enough (SmolLM2: 135 MB) to stay in a
// large L3. Each task takes a range of output rows. Up to 4 activation rows (decode at small
// batch, bound by memory) it reads them one weight row at a time in memory order, one
// sequential stream per task; with more activation rows (bound by arithmetic) four weight rows
// at a time, each widened weight vector used for up to four activation rows.
//
// Two kinds of inner loop:
// - 16-bit (the default where AVX512-VNNI or AVX2 exists): each activation row as 16-bit fixed
//   point (xq = round(x / xs), xs = max|x| / 32767) and an int16 dot product on int8 -> int16
//   weights, summed exactly in int32: vpdpwssd with VNNI (two instructions per 32 weights),
//   vpmaddwd + vpaddd with AVX2 (six per 32). Error ~1e-4 of the output range: ~8x below
//   rounding the activations to bfloat16, as torch's int8 kernel does
//   (tests/kernels/test_int8_linear.py); both ISAs give the same integer sums.
// - exact_float32=true (and AVX-512 CPUs without VNNI): int8 -> float32 and FMA in float32, at
//   16 lanes with AVX-512, at 8 with AVX2 + FMA (block_avx2).
// Without either, the plain loop at the end is what the compiler vectorizes.
//
// Built at first use by kernels/cpu_ops.py (torch.utils.cpp_extension.load, -O3 -march=native
// -fopenmp: at::parallel_for is OpenMP, inline in the headers).
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: ~4 s less of g++ per build
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <algorithm>
#include <cmath>
#include <atomic>
#include <vector>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOLK_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOLK_AVX2 1
#endif

namespace {

constexpr int64_t kRows = 4;  // weight rows per inner block
// Up to this many activation rows (at most 4), the 16-bit loop reads weight rows one at a time
// in memory order (rows_int16_streamed); above it, in 4-row blocks that reuse each widened
// weight (rows_int16_blocked). Which is faster depends on the machine's memory system, so
// kernels/int8_linear.py times both once per process and sets it
// (`tolk::int8_linear_streamed_rows`; without a 16-bit loop the setting has no effect).
std::atomic<int64_t> g_streamed_max_rows{4};

#ifdef TOLK_AVX512
// MT activation rows x 4 weight rows starting at n.
template <int MT>
inline void block_avx512(const float* x, int64_t K, const int8_t* w, const float* scales,
                         float* y, int64_t N, int64_t n) {
  __m512 acc[MT][kRows];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r) {
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + r) * K + k));
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    }
    for (int m = 0; m < MT; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  if (k < K) {  // tail: masked loads
    __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r) {
      __m128i q = _mm_maskz_loadu_epi8(mask, w + (n + r) * K + k);
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    }
    for (int m = 0; m < MT; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r)
      y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]) * scales[n + r];
}
#endif

#ifdef TOLK_AVX2
// The float32 loop of block_avx512 at 8 lanes, for CPUs with AVX2 and FMA but no AVX-512
// (AMD EPYC Zen 2 / 3, Intel before Skylake-SP): MT <= 2 activation rows x 4 weight rows keep
// the 8 accumulators, 4 widened weight vectors and the activation in AVX2's 16 registers.
// The plain loop it replaces ran Gemma 3's LM head (262144 x 640) at one activation row in
// 94 ms, slower than float32's 69 ms (AMD EPYC family 25 model 1, 2 vCPU).
inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MT>
inline void block_avx2(const float* x, int64_t K, const int8_t* w, const float* scales,
                       float* y, int64_t N, int64_t n) {
  __m256 acc[MT][kRows];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[kRows];
    for (int r = 0; r < kRows; ++r) {
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + (n + r) * K + k));
      wv[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
    for (int m = 0; m < MT; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) {
      float sum = hsum_avx2(acc[m][r]);
      const int8_t* wr = w + (n + r) * K;
      for (int64_t kk = k; kk < K; ++kk) sum += x[m * K + kk] * static_cast<float>(wr[kk]);
      y[m * N + n + r] = sum * scales[n + r];
    }
}
#endif

#ifdef TOLK_AVX2
// The 16-bit loops at 8 lanes, for AVX2 CPUs (no vpdpwssd): vpmaddwd multiplies 16 int16 pairs
// and adds each pair into one of 8 int32 lanes, vpaddd accumulates. Against block_avx2's float32
// loop (per 8 weights: widen to int32, convert to float, FMA), a third of the instructions per
// weight; that loop read Gemma 3's LM head at one activation row at 10.9 GB/s where the machine
// streams 26 (AMD EPYC family 25 model 1, 2 vCPU): bound by its instructions, not memory.
// Lanes are flushed to float32 every kChunk16 columns: per lane and flush at most
// 2048 / 16 steps x 2 products x 32767 x 127 ~ 1.07e9 < 2^31. Columns past the last whole step
// (K not a multiple of the step) are summed in scalar int32.
constexpr int64_t kChunk16 = 2048;

inline __m256i widen16(const int8_t* p) {  // 16 int8 weights -> 16 int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i madd_add(__m256i acc, __m256i w, const int16_t* x) {
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
}

inline int32_t dot_tail(const int16_t* xq, const int8_t* wr, int64_t k0, int64_t K) {
  int32_t sum = 0;
  for (int64_t k = k0; k < K; ++k) sum += static_cast<int32_t>(xq[k]) * wr[k];
  return sum;
}

// One weight row `wr` against MT <= 4 activation rows, read front to back (the VNNI kernel's
// order), two accumulator chains per activation row (even and odd 16-column halves of each 32).
template <int MT>
inline void row_int16(const int16_t* xq, int64_t Kp, const float* xs, int64_t K,
                      const int8_t* wr, float scale, float* y, int64_t N) {
  const int64_t K32 = K / 32 * 32;
  __m256 accf[MT];
  for (int m = 0; m < MT; ++m) accf[m] = _mm256_setzero_ps();
  for (int64_t kc = 0; kc < K32; kc += kChunk16) {
    const int64_t kend = std::min(K32, kc + kChunk16);
    __m256i a0[MT], a1[MT];
    for (int m = 0; m < MT; ++m) a0[m] = a1[m] = _mm256_setzero_si256();
    for (int64_t k = kc; k < kend; k += 32) {
      const __m256i w0 = widen16(wr + k), w1 = widen16(wr + k + 16);
      for (int m = 0; m < MT; ++m) {
        a0[m] = madd_add(a0[m], w0, xq + m * Kp + k);
        a1[m] = madd_add(a1[m], w1, xq + m * Kp + k + 16);
      }
    }
    for (int m = 0; m < MT; ++m)
      accf[m] = _mm256_add_ps(accf[m], _mm256_add_ps(_mm256_cvtepi32_ps(a0[m]),
                                                     _mm256_cvtepi32_ps(a1[m])));
  }
  for (int m = 0; m < MT; ++m) {
    const float tail = static_cast<float>(dot_tail(xq + m * Kp, wr, K32, K));
    y[m * N] = (hsum_avx2(accf[m]) + tail) * (scale * xs[m]);
  }
}

// MT <= 2 activation rows x 4 weight rows starting at n, each widened weight vector used for
// both activation rows (8 accumulators, 4 weights and one activation in AVX2's 16 registers).
template <int MT>
inline void block_avx2_i16(const int16_t* xq, int64_t Kp, const float* xs, int64_t K,
                           const int8_t* w, const float* scales, float* y, int64_t N,
                           int64_t n) {
  const int64_t K16 = K / 16 * 16;
  __m256 accf[MT][kRows];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) accf[m][r] = _mm256_setzero_ps();
  for (int64_t kc = 0; kc < K16; kc += kChunk16) {
    const int64_t kend = std::min(K16, kc + kChunk16);
    __m256i acc[MT][kRows];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_si256();
    for (int64_t k = kc; k < kend; k += 16) {
      __m256i wv[kRows];
      for (int r = 0; r < kRows; ++r) wv[r] = widen16(w + (n + r) * K + k);
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + k));
        for (int r = 0; r < kRows; ++r)
          acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(wv[r], xv));
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kRows; ++r)
        accf[m][r] = _mm256_add_ps(accf[m][r], _mm256_cvtepi32_ps(acc[m][r]));
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) {
      const float tail = static_cast<float>(dot_tail(xq + m * Kp, w + (n + r) * K, K16, K));
      y[m * N + n + r] = (hsum_avx2(accf[m][r]) + tail) * (scales[n + r] * xs[m]);
    }
}

void rows_int16_blocked(const int16_t* xq, int64_t Kp, const float* xs, int64_t M, int64_t K,
                        const int8_t* w, const float* scales, float* y, int64_t N,
                        int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; n += kRows) {  // n_end - n_begin is a multiple of 4
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      block_avx2_i16<2>(xq + m * Kp, Kp, xs + m, K, w, scales, y + m * N, N, n);
    if (m < M) block_avx2_i16<1>(xq + m * Kp, Kp, xs + m, K, w, scales, y + m * N, N, n);
  }
}

#define TOLK_INT16 1
#endif

#if defined(TOLK_AVX512) && defined(__AVX512VNNI__)
#define TOLK_VNNI 1
#define TOLK_INT16 1
// The VNNI path: each activation row is held as 16-bit fixed point, xq = round(x / xs) with
// xs = max|x| / 32767, so a dot product is vpdpwssd (32 int16 x int16 products, summed in
// pairs into 16 int32 lanes, one instruction) on weights widened int8 -> int16: two
// instructions per 32 weights instead of six. Lanes are flushed to float32 every kChunk
// columns, far below int32 overflow (kChunk / 32 * 2 * 32767 * 127 < 2^31).
constexpr int64_t kChunk = 4096;

// acc += pairwise products of a and b (vpdpwssd), the accumulator updated in place. With the
// intrinsic `_mm512_dpwssd_epi32`, GCC 12 copied each of block_vnni's 16 accumulators to a
// fresh register and back at every step (32 moves and a spill per 16 multiply-adds); at 8-64
// activation rows the op ran at ~80 G multiply-adds a second on two Zen 4 cores, ~125 with this.
inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// One 32-column step of a block: four weight rows widened int8 -> int16 (masked loads on the
// last, partial step; xq is zero-padded to Kp), each multiplied with MT activation rows.
template <int MT, bool kMasked>
inline void step_vnni(const int16_t* xq, int64_t Kp, const int8_t* w, int64_t K, int64_t n,
                      int64_t k, __mmask32 mask, __m512i (&acc)[MT][kRows]) {
  __m512i wv[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int8_t* p = w + (n + r) * K + k;
    wv[r] = _mm512_cvtepi8_epi16(
        kMasked ? _mm256_maskz_loadu_epi8(mask, p)
                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  for (int m = 0; m < MT; ++m) {
    const __m512i xv = _mm512_loadu_si512(xq + m * Kp + k);
    for (int r = 0; r < kRows; ++r) acc[m][r] = dpwssd(acc[m][r], wv[r], xv);
  }
}

// MT activation rows x 4 weight rows starting at n: the whole 32-column steps in a loop, then
// the partial last one (masked).
template <int MT>
inline void block_vnni(const int16_t* xq, int64_t Kp, const float* xs, int64_t K,
                       const int8_t* w, const float* scales, float* y, int64_t N, int64_t n,
                       bool prefetch) {
  if (prefetch)  // the next 4-row block, every cache line of it, while this one computes
    for (int r = 0; r < kRows; ++r)
      for (int64_t k = 0; k < K; k += 64) __builtin_prefetch(w + (n + kRows + r) * K + k);
  __m512 accf[MT][kRows];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) accf[m][r] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < K; kc += kChunk) {
    const int64_t kend = std::min(K, kc + kChunk);
    const int64_t kfull = kc + (kend - kc) / 32 * 32;
    __m512i acc[MT][kRows];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_si512();
    for (int64_t k = kc; k < kfull; k += 32) step_vnni<MT, false>(xq, Kp, w, K, n, k, 0, acc);
    if (kfull < kend)
      step_vnni<MT, true>(xq, Kp, w, K, n, kfull,
                          static_cast<__mmask32>((1ull << (kend - kfull)) - 1), acc);
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < kRows; ++r)
        accf[m][r] = _mm512_add_ps(accf[m][r], _mm512_cvtepi32_ps(acc[m][r]));
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r)
      y[m * N + n + r] = _mm512_reduce_add_ps(accf[m][r]) * (scales[n + r] * xs[m]);
}

// One weight row `wr` against MT activation rows, the row read once, front to back. Rows are
// taken in memory order, so a task streams its share of `w` as one sequential read: the
// hardware prefetcher's best case. (block_vnni reads four rows side by side, four short
// streams K bytes apart: at one activation row on an AMD EPYC Zen 4 that drew ~18 GB/s from
// memory where one stream draws ~34, and Gemma 3's LM head, about half of a decode step, took
// 8.0 ms instead of 3.6.)
// Two accumulator chains per activation row (even and odd 32-column steps) keep vpdpwssd's
// latency hidden at MT = 1.
template <int MT>
inline void row_int16(const int16_t* xq, int64_t Kp, const float* xs, int64_t K,
                      const int8_t* wr, float scale, float* y, int64_t N) {
  __m512 accf[MT];
  for (int m = 0; m < MT; ++m) accf[m] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < K; kc += kChunk) {
    const int64_t kend = std::min(K, kc + kChunk);
    __m512i a0[MT], a1[MT];
    for (int m = 0; m < MT; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
    int64_t k = kc;
    for (; k + 64 <= kend; k += 64) {
      const __m512i w0 = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)));
      const __m512i w1 = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k + 32)));
      for (int m = 0; m < MT; ++m) {
        a0[m] = dpwssd(a0[m], w0, _mm512_loadu_si512(xq + m * Kp + k));
        a1[m] = dpwssd(a1[m], w1, _mm512_loadu_si512(xq + m * Kp + k + 32));
      }
    }
    for (; k < kend; k += 32) {  // the last 32 or fewer: masked weight loads (xq is zero-padded)
      const int64_t left = kend - k;
      const __mmask32 mask =
          left >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << left) - 1);
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, wr + k));
      for (int m = 0; m < MT; ++m)
        a0[m] = dpwssd(a0[m], w0, _mm512_loadu_si512(xq + m * Kp + k));
    }
    for (int m = 0; m < MT; ++m)
      accf[m] = _mm512_add_ps(accf[m], _mm512_add_ps(_mm512_cvtepi32_ps(a0[m]),
                                                     _mm512_cvtepi32_ps(a1[m])));
  }
  for (int m = 0; m < MT; ++m) y[m * N] = _mm512_reduce_add_ps(accf[m]) * (scale * xs[m]);
}

void rows_int16_blocked(const int16_t* xq, int64_t Kp, const float* xs, int64_t M, int64_t K,
                        const int8_t* w, const float* scales, float* y, int64_t N,
                        int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; n += kRows) {  // n_end - n_begin is a multiple of 4
    const bool pf = n + 2 * kRows <= n_end;  // prefetch the next block while on this one
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      block_vnni<4>(xq + m * Kp, Kp, xs + m, K, w, scales, y + m * N, N, n, pf && m == 0);
    switch (M - m) {
      case 3: block_vnni<3>(xq + m * Kp, Kp, xs + m, K, w, scales, y + m * N, N, n, pf && m == 0); break;
      case 2: block_vnni<2>(xq + m * Kp, Kp, xs + m, K, w, scales, y + m * N, N, n, pf && m == 0); break;
      case 1: block_vnni<1>(xq + m * Kp, Kp, xs + m, K, w, scales, y + m * N, N, n, pf && m == 0); break;
      default: break;
    }
  }
}

#endif

#ifdef TOLK_INT16
// x [M, K] float32 -> xq [M, Kp] int16 (zero-padded), xs [M] (one scale per row)
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* xq,
                          float* xs) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(xr[k]));
    const float scale = amax > 0.f ? amax / 32767.f : 1.f;
    const float inv = 1.f / scale;
    int16_t* qr = xq + m * Kp;
    for (int64_t k = 0; k < K; ++k) qr[k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
    for (int64_t k = K; k < Kp; ++k) qr[k] = 0;
    xs[m] = scale;
  }
}


// Weight rows in memory order, each against all M <= 4 activation rows (row_int16: the VNNI or
// the AVX2 kernel, whichever this build has). Each row first asks for the one kAheadRows
// later (software prefetch): the hardware's stream prefetcher alone left two cores at 18-19
// GB/s on Gemma 3's layers where, asked ahead, they read 22-24 (AMD EPYC family 25 model 1,
// a standalone copy of the loop); the op itself, a step's 72 layer calls, 0.94-0.96x its time
// before (its fixed costs a call stay). Prefetches past the tensor's end are dropped.
constexpr int64_t kAheadRows = 4;

void rows_int16_streamed(const int16_t* xq, int64_t Kp, const float* xs, int64_t M, int64_t K,
                         const int8_t* w, const float* scales, float* y, int64_t N,
                         int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {  // weight rows in memory order; M <= 4
    const int8_t* wr = w + n * K;
    for (int64_t off = 0; off < K; off += 64) __builtin_prefetch(wr + kAheadRows * K + off);
    switch (M) {
      case 4: row_int16<4>(xq, Kp, xs, K, wr, scales[n], y + n, N); break;
      case 3: row_int16<3>(xq, Kp, xs, K, wr, scales[n], y + n, N); break;
      case 2: row_int16<2>(xq, Kp, xs, K, wr, scales[n], y + n, N); break;
      default: row_int16<1>(xq, Kp, xs, K, wr, scales[n], y + n, N); break;
    }
  }
}
#endif

// One output row n for activation rows [0, M): the portable path (and the N % 4 rest).
inline void row_plain(const float* x, int64_t M, int64_t K, const int8_t* w,
                      const float* scales, float* y, int64_t N, int64_t n) {
  const int8_t* wr = w + n * K;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(wr[k]);
    y[m * N + n] = acc * scales[n];
  }
}

void rows(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, float* y,
          int64_t N, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
#ifdef TOLK_AVX512
  for (; n + kRows <= n_end; n += kRows) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) block_avx512<4>(x + m * K, K, w, scales, y + m * N, N, n);
    switch (M - m) {
      case 3: block_avx512<3>(x + m * K, K, w, scales, y + m * N, N, n); break;
      case 2: block_avx512<2>(x + m * K, K, w, scales, y + m * N, N, n); break;
      case 1: block_avx512<1>(x + m * K, K, w, scales, y + m * N, N, n); break;
      default: break;
    }
  }
#elif defined(TOLK_AVX2)
  for (; n + kRows <= n_end; n += kRows) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) block_avx2<2>(x + m * K, K, w, scales, y + m * N, N, n);
    if (m < M) block_avx2<1>(x + m * K, K, w, scales, y + m * N, N, n);
  }
#endif
  for (; n < n_end; ++n) row_plain(x, M, K, w, scales, y, N, n);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       bool exact_float32) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scales.device().is_cpu(),
              "tolk::int8_linear is a CPU op");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2, "w must be int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1, "scales: float32 [N]");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, w expects ", K);
  TORCH_CHECK(scales.size(0) == N, "scales must have ", N, " entries");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  at::Tensor wc = w.contiguous(), sc = scales.contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(out_shape);
  const float* xp = x2.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // tasks are ranges of 4-row blocks; grain keeps a task above ~64 KB of weights
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K));
#ifdef TOLK_INT16
  if (!exact_float32) {
    const int64_t Kp = (K + 31) / 32 * 32;
    std::vector<int16_t> xq(static_cast<size_t>(M * Kp));
    std::vector<float> xs(static_cast<size_t>(M));
    quantize_rows(xp, M, K, Kp, xq.data(), xs.data());
    if (M <= g_streamed_max_rows.load(std::memory_order_relaxed)) {  // small batch: reading w
      at::parallel_for(0, N, grain * kRows, [&](int64_t n0, int64_t n1) {
        rows_int16_streamed(xq.data(), Kp, xs.data(), M, K, wp, sp, yp, N, n0, n1);
      });
      return y.view(out_shape);
    }
    const int64_t full = N / kRows;  // whole 4-row blocks; the rest runs the plain loop
    at::parallel_for(0, full, grain, [&](int64_t b0, int64_t b1) {
      rows_int16_blocked(xq.data(), Kp, xs.data(), M, K, wp, sp, yp, N, b0 * kRows, b1 * kRows);
    });
    for (int64_t n = full * kRows; n < N; ++n) row_plain(xp, M, K, wp, sp, yp, N, n);
    return y.view(out_shape);
  }
#endif
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    rows(xp, M, K, wp, sp, yp, N, b0 * kRows, std::min(N, b1 * kRows));
  });
  return y.view(out_shape);
}

// Sets the streamed loop's row limit when `rows` >= 0 (clamped to 0..4; 0: never streamed);
// returns the limit in force.
int64_t int8_linear_streamed_rows(int64_t rows) {
  if (rows >= 0) g_streamed_max_rows.store(std::min<int64_t>(rows, 4));
  return g_streamed_max_rows.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tolk, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, bool exact_float32=False) -> Tensor");
  m.def("int8_linear_streamed_rows(int rows=-1) -> int", &int8_linear_streamed_rows);
}

TORCH_LIBRARY_IMPL(tolk, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
