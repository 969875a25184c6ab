// tolk::int4_linear: y[m, n] = sum_g sum_{k in g} x[m, k] * (scales[n, g] * q[n, k] + mins[n, g])
// for float32 x and 4-bit weights q in 0..15, groups g of 32 columns (asymmetric, float16 scale
// and offset per group: 5 bits a weight, 5/8 of int8's bytes with its scales).
//
// Batch-1 decode on a CPU reads every weight once per token, so bytes are time, as long as the
// loop's instructions keep up with memory; a 4-bit loop that widens codes, scales each group
// and adds them up per group does not (measured: 8 GB/s a core against int8's 12). So the
// layout puts one *group* in each int32 lane:
//
// - Groups go in blocks of 16 (512 columns; the last block of a row may hold fewer, R).
//   vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and adds each 4 products into one
//   of 16 int32 lanes; lane i of a block is group i. Step t (0..7) of a block takes columns
//   4t..4t+3 of every group, so after 8 steps lane i holds group i's whole dot product.
// - Packing (kernels/int4_linear.py, `pack_codes`): steps 2u and 2u+1 share 4R bytes, byte
//   4i + c holding column 8u + c of group i in its low nibble and column 8u + 4 + c in its high
//   one: one load, two masks give both steps' 64 codes. A row is K / 2 bytes.
// - Activations: each row quantized per group to int8 (scale max|x| / 127 per group, as
//   llama.cpp's Q8 blocks) and laid out in the same step order (a block of 512 bytes, padded),
//   once per call, with each group's sum for the offsets.
// - Per block and weight row: 16 lanes of integer dot products, then one float multiply-add by
//   (weight scale x activation scale) per lane and one by (offset x group sum of x): about 4
//   instructions per 64 weights instead of 13.
// Needs AVX512-VNNI (Intel Ice Lake and later, AMD Zen 4). With AVX2 + FMA + F16C instead (AMD
// Zen 2 / 3, Intel before Ice Lake) the same layout runs on 256-bit halves of each block
// (row_avx2): vpmaddubsw (unsigned codes x signed activations, adjacent pairs summed into int16)
// stands in for vpdpbusd, the eight steps of a block summed in int16 (at most 8 x 2 x 15 x 127
// = 30480, no saturation) and widened to the group's int32 lane once per block by vpmaddwd with
// ones. Elsewhere the plain float32 loop (also the tests' yardstick, `int4_linear_plain`).
//
// Built at first use by kernels/cpu_ops.py with the other ops (-O3 -march=native -fopenmp).
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: ~4 s less of g++ per build
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TOLK_INT4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <cstring>
#define TOLK_INT4_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;   // columns per scale
constexpr int64_t kLanes = 16;   // groups per block
constexpr int64_t kBlockCols = kGroup * kLanes;  // 512
constexpr int64_t kRows4 = 4;    // weight rows per inner block

// Byte offset of (group g, column j of the group) in a packed row, and its nibble (0 low).
inline void locate(int64_t G, int64_t g, int64_t j, int64_t* byte, int* high) {
  const int64_t b = g / kLanes, i = g % kLanes;
  const int64_t R = std::min(kLanes, G - b * kLanes);
  const int64_t u = j / 8, h = (j / 4) % 2, c = j % 4;
  *byte = b * kLanes * 16 + u * 4 * R + i * 4 + c;
  *high = static_cast<int>(h);
}

// One weight row n for activation rows [0, M): float32, any CPU.
inline void row_plain(const float* x, int64_t M, int64_t K, const uint8_t* w,
                      const at::Half* scales, const at::Half* mins, float* y, int64_t N,
                      int64_t n) {
  const uint8_t* wr = w + n * (K / 2);
  const int64_t G = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float part = 0.f, xsum = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) {
        int64_t byte;
        int high;
        locate(G, g, j, &byte, &high);
        const int q = high ? (wr[byte] >> 4) : (wr[byte] & 15);
        part += xr[g * kGroup + j] * static_cast<float>(q);
        xsum += xr[g * kGroup + j];
      }
      acc += static_cast<float>(scales[n * G + g]) * part +
             static_cast<float>(mins[n * G + g]) * xsum;
    }
    y[m * N + n] = acc;
  }
}

#if defined(TOLK_INT4_VNNI) || defined(TOLK_INT4_AVX2)
// Activation rows in the kernel's layout: per row, `blocks` blocks of 512 int8 (step-major,
// zero-padded lanes) and per block 16 scales and 16 group sums (zero on padded lanes).
struct PreparedX {
  int64_t blocks;
  std::vector<int8_t> q;    // [M, blocks, 8 steps, 16 lanes, 4]
  std::vector<float> scale;  // [M, blocks, 16]
  std::vector<float> sum;    // [M, blocks, 16]
};

PreparedX prepare_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup, blocks = (G + kLanes - 1) / kLanes;
  PreparedX p{blocks, std::vector<int8_t>(static_cast<size_t>(M * blocks * kBlockCols), 0),
              std::vector<float>(static_cast<size_t>(M * blocks * kLanes), 0.f),
              std::vector<float>(static_cast<size_t>(M * blocks * kLanes), 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * kGroup;
      float amax = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(xg[j]));
      const float scale = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / scale;
      const int64_t b = g / kLanes, i = g % kLanes;
      int8_t* qb = p.q.data() + (m * blocks + b) * kBlockCols;
      int32_t qsum = 0;
      for (int64_t j = 0; j < kGroup; ++j) {  // step j / 4, lane i, column j % 4
        const auto q = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
        qb[(j / 4) * 64 + i * 4 + j % 4] = q;
        qsum += q;
      }
      p.scale[(m * blocks + b) * kLanes + i] = scale;
      // the offsets see the same (quantized) activations as the codes: then the error is
      // that of (scale * q + offset) . (x~ - x), whose weights are centred, not of
      // (scale * q) . (x~ - x), whose weights are all >= 0 (about 2x the error measured)
      p.sum[(m * blocks + b) * kLanes + i] = static_cast<float>(qsum) * scale;
    }
  }
  return p;
}
#endif

#ifdef TOLK_INT4_VNNI
// The last block of a row when it holds at most 8 groups: the same steps on 256-bit vectors
// (lanes 0-7; a masked 512-bit block would do twice the work for nothing), added into the
// 512-bit accumulators zero-extended.
template <int MT>
inline void narrow_block(const PreparedX& px, int64_t m0, const int8_t* const* xb, int64_t b,
                         int64_t R, int64_t G, int64_t Kb, const uint8_t* w,
                         const at::Half* scales, const at::Half* mins, int64_t n,
                         __m512 (*acc)[kRows4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __mmask32 bytes = static_cast<__mmask32>((1ull << (4 * R)) - 1);
  const __mmask8 lanes = static_cast<__mmask8>((1u << R) - 1);
  for (int r = 0; r < kRows4; ++r) {
    const uint8_t* wb = w + (n + r) * Kb + b * kLanes * 16;
    __m256i dot[MT];
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_setzero_si256();
    for (int u = 0; u < 4; ++u) {
      const __m256i packed = _mm256_maskz_loadu_epi8(bytes, wb + u * 4 * R);
      const __m256i lo = _mm256_and_si256(packed, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xs = xb[m] + (2 * u) * 64;
        const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs));
        const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 64));
        dot[m] = _mm256_dpbusd_epi32(dot[m], lo, x_lo);
        dot[m] = _mm256_dpbusd_epi32(dot[m], hi, x_hi);
      }
    }
    const int64_t g0 = (n + r) * G + b * kLanes;
    const __m256 ws = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(lanes, scales + g0));
    const __m256 wm = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(lanes, mins + g0));
    for (int m = 0; m < MT; ++m) {
      const int64_t xo = ((m0 + m) * px.blocks + b) * kLanes;
      const __m256 s = _mm256_mul_ps(ws, _mm256_loadu_ps(px.scale.data() + xo));
      __m256 part = _mm256_mul_ps(wm, _mm256_loadu_ps(px.sum.data() + xo));
      part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), s, part);
      acc[m][r] = _mm512_add_ps(acc[m][r], _mm512_zextps256_ps512(part));
    }
  }
}

// MT activation rows x 4 weight rows starting at n.
template <int MT>
inline void block_vnni(const PreparedX& px, int64_t m0, int64_t K, const uint8_t* w,
                       const at::Half* scales, const at::Half* mins, float* y, int64_t N,
                       int64_t n, bool prefetch) {
  const int64_t G = K / kGroup, Kb = K / 2, blocks = px.blocks;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][kRows4];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows4; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t R = std::min(kLanes, G - b * kLanes);
    const int8_t* xb[MT];
    for (int m = 0; m < MT; ++m) xb[m] = px.q.data() + ((m0 + m) * blocks + b) * kBlockCols;
    if (R <= kLanes / 2) {  // a narrow last block (Gemma 3's K = 640: 4 groups): 256-bit
      narrow_block<MT>(px, m0, xb, b, R, G, Kb, w, scales, mins, n, acc);
      continue;
    }
    const __mmask64 bytes = R == kLanes ? ~0ull : (1ull << (4 * R)) - 1;
    const __mmask16 lanes = static_cast<__mmask16>((1u << R) - 1);
    for (int r = 0; r < kRows4; ++r) {
      const uint8_t* wb = w + (n + r) * Kb + b * kLanes * 16;
      if (prefetch)
        for (int64_t off = 0; off < 16 * R; off += 64) __builtin_prefetch(wb + kRows4 * Kb + off);
      __m512i dot[MT];
      for (int m = 0; m < MT; ++m) dot[m] = _mm512_setzero_si512();
      for (int u = 0; u < 4; ++u) {
        const __m512i packed = _mm512_maskz_loadu_epi8(bytes, wb + u * 4 * R);
        const __m512i lo = _mm512_and_si512(packed, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        for (int m = 0; m < MT; ++m) {
          dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_loadu_si512(xb[m] + (2 * u) * 64));
          dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_loadu_si512(xb[m] + (2 * u + 1) * 64));
        }
      }
      const int64_t g0 = (n + r) * G + b * kLanes;
      const __m512 ws = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales + g0));
      const __m512 wm = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, mins + g0));
      for (int m = 0; m < MT; ++m) {
        const int64_t xo = ((m0 + m) * blocks + b) * kLanes;
        const __m512 s = _mm512_mul_ps(ws, _mm512_loadu_ps(px.scale.data() + xo));
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), s, acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(px.sum.data() + xo), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows4; ++r) y[(m0 + m) * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
}

void rows_vnni(const PreparedX& px, int64_t M, int64_t K, const uint8_t* w,
               const at::Half* scales, const at::Half* mins, float* y, int64_t N,
               int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; n += kRows4) {  // n_end - n_begin: a multiple of 4
    const bool pf = n + 2 * kRows4 <= n_end;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) block_vnni<4>(px, m, K, w, scales, mins, y, N, n, pf && m == 0);
    if (m + 2 <= M) {
      block_vnni<2>(px, m, K, w, scales, mins, y, N, n, pf && m == 0);
      m += 2;
    }
    if (m < M) block_vnni<1>(px, m, K, w, scales, mins, y, N, n, pf && m == 0);
  }
}
#endif

#ifdef TOLK_INT4_AVX2
// Four code bytes per lane at p (a step pair's 4R bytes), as two 256-bit halves: lanes 0-7 and
// 8-15; lanes at or past R read as zero (masked 32-bit loads: never past the row's bytes).
inline void load_codes(const uint8_t* p, int64_t R, __m256i* half0, __m256i* half1) {
  if (R == kLanes) {
    *half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto in = [&](int64_t n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane); };
  *half0 = _mm256_maskload_epi32(reinterpret_cast<const int*>(p), in(std::min<int64_t>(R, 8)));
  *half1 = R > 8 ? _mm256_maskload_epi32(reinterpret_cast<const int*>(p + 32), in(R - 8))
                 : _mm256_setzero_si256();
}

// Up to 8 float16 values from p as float32, zero past `lanes`. A whole 16-byte load where it
// stays before `end` (the tensor's end; the values past `lanes` then belong to the next row and
// are masked off), else a copy through the stack: a wide load over narrower stores stalls on
// store forwarding, so it is kept for a tensor's last row.
inline __m256 load_halves(const at::Half* p, int64_t lanes, const at::Half* end) {
  if (lanes <= 0) return _mm256_setzero_ps();
  if (p + 8 <= end) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (lanes >= 8) return v;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes)), lane);
    return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
  }
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, static_cast<size_t>(std::min<int64_t>(lanes, 8)) * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
}

// A last block of exactly four groups (Gemma 3's K = 640: 512 + 128 columns) holds 16 code
// bytes a step pair: half of each 256-bit load of `row_avx2`'s generic path. With one
// activation row (the batch-1 decode's LM head) `narrow4_row` takes two step pairs a load
// instead, their activations gathered once a call (`Narrow4`): measured 0.85-0.92x the op's time
// on Gemma 3's head, two cores of an AMD EPYC family 25 model 1 (K = 512 and 1024 unchanged).
struct Narrow4 {  // the activations of such a block, two step pairs a vector
  __m256i lo[2], hi[2];
};

// Pair p of a 4-group block at xb: codes of steps 2u (low nibbles) and 2u + 1 (high) for u = 2p
// in the low 128 bits and u = 2p + 1 in the high ones, as the codes lie (16 bytes a pair).
inline Narrow4 narrow4_x(const int8_t* xb) {
  const auto step = [&](int s) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + s * 64));  // lanes 0-3
  };
  Narrow4 nx;
  for (int p = 0; p < 2; ++p) {
    nx.lo[p] = _mm256_set_m128i(step(4 * p + 2), step(4 * p));
    nx.hi[p] = _mm256_set_m128i(step(4 * p + 3), step(4 * p + 1));
  }
  return nx;
}

// Block b (4 groups) of one weight row against `narrow4_x`'s activations: the block's
// contribution to the row's 8-lane accumulator (lanes 0-3).
inline __m256 narrow4_row(const uint8_t* wb, const at::Half* sr, const at::Half* mr,
                          const float* xs, const float* xm, const Narrow4& nx) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i d = _mm256_setzero_si256();
  for (int p = 0; p < 2; ++p) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * p));
    const __m256i lo = _mm256_and_si256(c, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
    d = _mm256_add_epi16(d, _mm256_maddubs_epi16(lo, nx.lo[p]));
    d = _mm256_add_epi16(d, _mm256_maddubs_epi16(hi, nx.hi[p]));
  }
  const __m256i d32 = _mm256_madd_epi16(d, ones);  // lanes 0-3: u even, 4-7: u odd
  const __m128i dot =
      _mm_add_epi32(_mm256_castsi256_si128(d32), _mm256_extracti128_si256(d32, 1));
  const auto halves4 = [](const at::Half* h) {  // 8 bytes: never past the group's values
    return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
  };
  const __m128 part = _mm_fmadd_ps(_mm_cvtepi32_ps(dot), _mm_mul_ps(halves4(sr), _mm_loadu_ps(xs)),
                                   _mm_mul_ps(halves4(mr), _mm_loadu_ps(xm)));
  return _mm256_set_m128(_mm_setzero_ps(), part);
}

// One weight row (`wr`: K / 2 packed bytes; `sr`, `mr`: its G scales and offsets, `send`,
// `mend`: the ends of those tensors) against MT <= 4 activation rows from m0: per block, int16
// sums per half (d0: lanes 0-7, d1: 8-15; a block of at most 8 groups, like Gemma 3's last one
// at K = 640, only the first), then per lane one float multiply-add by (weight scale x
// activation scale) and one by (offset x sum). The codes of a step pair are unpacked once for
// the MT activation rows. Rows are read front to back, one after another (each task one
// sequential stream).
template <int MT>
inline void row_avx2(const PreparedX& px, int64_t m0, int64_t K, const uint8_t* wr,
                     const at::Half* sr, const at::Half* mr, const at::Half* send,
                     const at::Half* mend, float* y, int64_t N,
                     const Narrow4* narrow = nullptr) {
  const int64_t G = K / kGroup, blocks = px.blocks;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t R = std::min(kLanes, G - b * kLanes);
    const bool wide = R > 8;
    const uint8_t* wb = wr + b * kLanes * 16;
    if (MT == 1 && narrow != nullptr && R == 4) {  // (only a last block has 4 groups)
      const int64_t g0 = b * kLanes;
      acc[0] = _mm256_add_ps(acc[0], narrow4_row(wb, sr + g0, mr + g0, px.scale.data() + g0,
                                                  px.sum.data() + g0, *narrow));
      continue;
    }
    const int8_t* xb[MT];
    for (int m = 0; m < MT; ++m) xb[m] = px.q.data() + ((m0 + m) * blocks + b) * kBlockCols;
    __m256i d0[MT], d1[MT];
    for (int m = 0; m < MT; ++m) d0[m] = d1[m] = _mm256_setzero_si256();
    for (int u = 0; u < 4; ++u) {
      __m256i c0, c1;
      load_codes(wb + u * 4 * R, R, &c0, &c1);
      const __m256i lo0 = _mm256_and_si256(c0, low4);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(c0, 4), low4);
      for (int m = 0; m < MT; ++m) {
        const auto* xs = reinterpret_cast<const __m256i*>(xb[m] + (2 * u) * 64);  // 2 steps
        d0[m] = _mm256_add_epi16(d0[m], _mm256_maddubs_epi16(lo0, _mm256_loadu_si256(xs)));
        d0[m] = _mm256_add_epi16(d0[m], _mm256_maddubs_epi16(hi0, _mm256_loadu_si256(xs + 2)));
      }
      if (!wide) continue;
      const __m256i lo1 = _mm256_and_si256(c1, low4);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(c1, 4), low4);
      for (int m = 0; m < MT; ++m) {
        const auto* xs = reinterpret_cast<const __m256i*>(xb[m] + (2 * u) * 64);
        d1[m] = _mm256_add_epi16(d1[m], _mm256_maddubs_epi16(lo1, _mm256_loadu_si256(xs + 1)));
        d1[m] = _mm256_add_epi16(d1[m], _mm256_maddubs_epi16(hi1, _mm256_loadu_si256(xs + 3)));
      }
    }
    const int64_t g0 = b * kLanes, r0 = std::min<int64_t>(R, 8), r1 = R - r0;
    const __m256 ws0 = load_halves(sr + g0, r0, send), wm0 = load_halves(mr + g0, r0, mend);
    for (int m = 0; m < MT; ++m) {
      const int64_t xo = ((m0 + m) * blocks + b) * kLanes;
      const __m256 dot0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(d0[m], ones));
      acc[m] = _mm256_fmadd_ps(
          dot0, _mm256_mul_ps(ws0, _mm256_loadu_ps(px.scale.data() + xo)), acc[m]);
      acc[m] = _mm256_fmadd_ps(wm0, _mm256_loadu_ps(px.sum.data() + xo), acc[m]);
    }
    if (!wide) continue;
    const __m256 ws1 = load_halves(sr + g0 + 8, r1, send);
    const __m256 wm1 = load_halves(mr + g0 + 8, r1, mend);
    for (int m = 0; m < MT; ++m) {
      const int64_t xo = ((m0 + m) * blocks + b) * kLanes + 8;
      const __m256 dot1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(d1[m], ones));
      acc[m] = _mm256_fmadd_ps(
          dot1, _mm256_mul_ps(ws1, _mm256_loadu_ps(px.scale.data() + xo)), acc[m]);
      acc[m] = _mm256_fmadd_ps(wm1, _mm256_loadu_ps(px.sum.data() + xo), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    y[(m0 + m) * N] = _mm_cvtss_f32(s);
  }
}

// Weight rows [n_begin, n_end) against all M activation rows. The outputs of a tile of kTile
// weight rows are gathered in a small buffer and written out after it: written in place, M
// output rows N floats apart are M more memory streams beside the weights' one, and from 4 of
// them on (AMD EPYC family 25 model 1) the op ran 2.5x slower than at 3. Each row first asks
// for the one kAheadRows later (codes, scales, offsets: software prefetch; 4, 8 and 16 rows
// measured alike): with the narrow block above, Gemma 3's head at one row took 0.75-0.81x
// the time before on that EPYC (one or two cores, huge pages; the two builds timed in turn in
// one process), K = 1024 0.82-0.86x.
constexpr int64_t kTile = 64;
constexpr int64_t kAheadRows = 8;

void rows_avx2(const PreparedX& px, int64_t M, int64_t K, const uint8_t* w,
               const at::Half* scales, const at::Half* mins, float* y, int64_t N,
               int64_t n_begin, int64_t n_end) {
  const int64_t G = K / kGroup, Kb = K / 2;
  const at::Half *send = scales + N * G, *mend = mins + N * G;
  std::vector<float> tile(static_cast<size_t>(M * kTile));
  const int64_t last = px.blocks - 1;  // a last block of 4 groups: its activations in pairs
  const bool four = M == 1 && G - last * kLanes == 4;
  const Narrow4 nx = four ? narrow4_x(px.q.data() + last * kBlockCols) : Narrow4{};
  const Narrow4* narrow = four ? &nx : nullptr;
  for (int64_t t0 = n_begin; t0 < n_end; t0 += kTile) {
    const int64_t t1 = std::min(n_end, t0 + kTile);
    for (int64_t n = t0; n < t1; ++n) {
      const uint8_t* wr = w + n * Kb;
      const at::Half *sr = scales + n * G, *mr = mins + n * G;
      for (int64_t off = 0; off < Kb; off += 64) __builtin_prefetch(wr + kAheadRows * Kb + off);
      for (int64_t off = 0; off < G; off += 32) {  // 32 float16 a cache line
        __builtin_prefetch(sr + kAheadRows * G + off);
        __builtin_prefetch(mr + kAheadRows * G + off);
      }
      float* out = tile.data() + (n - t0);
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) row_avx2<3>(px, m, K, wr, sr, mr, send, mend, out, kTile);
      switch (M - m) {
        case 2: row_avx2<2>(px, m, K, wr, sr, mr, send, mend, out, kTile); break;
        case 1: row_avx2<1>(px, m, K, wr, sr, mr, send, mend, out, kTile, narrow); break;
        default: break;
      }
    }
    for (int64_t m = 0; m < M; ++m)
      std::copy(tile.data() + m * kTile, tile.data() + m * kTile + (t1 - t0), y + m * N + t0);
  }
}
#endif

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scales.device().is_cpu() &&
                  mins.device().is_cpu(),
              "tolk::int4_linear is a CPU op");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2, "w must be uint8 [N, K / 2]");
  const int64_t N = w.size(0), K = w.size(1) * 2, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "int4 weights need K a multiple of 32, got ", K);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf &&
                  scales.sizes() == mins.sizes() && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == G,
              "scales and mins: float16 [N, K / 32]");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, w expects ", K);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  at::Tensor wc = w.contiguous(), sc = scales.contiguous(), mc = mins.contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(out_shape);
  const float* xp = x2.data_ptr<float>();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  const at::Half* mp = mc.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows4 * K / 2));
#ifdef TOLK_INT4_VNNI
  const PreparedX px = prepare_rows(xp, M, K);
  const int64_t full = N / kRows4;  // whole 4-row blocks; the rest runs the plain loop
  at::parallel_for(0, full, grain, [&](int64_t b0, int64_t b1) {
    rows_vnni(px, M, K, wp, sp, mp, yp, N, b0 * kRows4, b1 * kRows4);
  });
  for (int64_t n = full * kRows4; n < N; ++n) row_plain(xp, M, K, wp, sp, mp, yp, N, n);
#elif defined(TOLK_INT4_AVX2)
  const PreparedX px = prepare_rows(xp, M, K);
  at::parallel_for(0, N, grain * kRows4, [&](int64_t n0, int64_t n1) {
    rows_avx2(px, M, K, wp, sp, mp, yp, N, n0, n1);
  });
#else
  at::parallel_for(0, N, grain * kRows4, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) row_plain(xp, M, K, wp, sp, mp, yp, N, n);
  });
#endif
  return y.view(out_shape);
}

// The portable float32 loop on any CPU: the yardstick the vector loops are tested against.
at::Tensor int4_linear_plain(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                             const at::Tensor& mins) {
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf &&
                  K % kGroup == 0 && x.size(-1) == K,
              "int4_linear_plain: float32 x [.., K], uint8 w [N, K / 2], float16 scales/mins");
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  at::Tensor wc = w.contiguous(), sc = scales.contiguous(), mc = mins.contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  for (int64_t n = 0; n < N; ++n)
    row_plain(x2.data_ptr<float>(), M, K, wc.data_ptr<uint8_t>(), sc.data_ptr<at::Half>(),
              mc.data_ptr<at::Half>(), y.data_ptr<float>(), N, n);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  return y.view(out_shape);
}

// Whether this build runs a vector loop (AVX512-VNNI, else AVX2): else every call is the plain
// float32 loop, slower than int8 on the same CPU; callers that pick int4 for speed ask first.
bool int4_linear_vector_loop() {
#if defined(TOLK_INT4_VNNI) || defined(TOLK_INT4_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tolk, m) {
  m.def("int4_linear_vector_loop() -> bool", &int4_linear_vector_loop);
  m.def("int4_linear(Tensor x, Tensor w, Tensor scales, Tensor mins) -> Tensor");
  m.def("int4_linear_plain(Tensor x, Tensor w, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(tolk, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_plain", &int4_linear_plain);
}
