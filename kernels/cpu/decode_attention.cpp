// tolk::decode_attention: one query token per sequence attending over its paged K/V, read in
// place from the block pool (no gather).
//
// q [B, H, D] float32; k_cache, v_cache [NB, BS, KVH, D] float32; blocks [B, n] int64: the
// blocks each row reads (in order); valid [B, n * BS] bool: which of those positions the row
// sees (causal end, sliding window, null padding). out [B, H, D].
//
// One task per (row, KV head): the G = H / KVH query heads of that KV head are scored together
// against each visible position (each K row read once for all G), soft-capped if asked, then a
// float32 softmax per head and the weighted sum of V rows (each V row read once for all G).
// When there are fewer tasks than threads (batch 1 of a model with one KV head, Gemma 3 270M:
// one task, so one core idle), each task's positions are split into chunks, one per thread
// (flash-decoding): a chunk keeps its running max, its sum of exponentials and its unnormalised
// output, and the chunks are merged by rescaling to the common max. The same function as the
// torch path in kernels/attention.py (`decode_attention_reference`), up to float rounding.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: ~4 s less of g++ per build
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kAhead = 16;  // positions prefetched ahead
constexpr int64_t kMinChunk = 64;  // positions a split chunk holds at least

// 16 independent lanes (vectorized without reassociating a single sum), then the tail
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[d + l] * b[d + l];
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& blocks,
                            const at::Tensor& valid, double scale, std::optional<double> softcap) {
  TORCH_CHECK(q.device().is_cpu(), "tolk::decode_attention is a CPU op");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "tolk::decode_attention: float32 q and caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [B, H, D], caches [NB, BS, KVH, D]");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && valid.scalar_type() == at::kBool,
              "blocks int64 [B, n], valid bool [B, n * BS]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head shapes do not match");
  const int64_t n = blocks.size(1), L = n * BS, G = H / KVH;
  TORCH_CHECK(blocks.size(0) == B && valid.size(0) == B && valid.size(1) == L,
              "blocks / valid do not match the batch");
  at::Tensor qc = q.contiguous(), bc = blocks.contiguous(), vc = valid.contiguous();
  at::Tensor out = at::zeros_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bp = bc.data_ptr<int64_t>();
  const bool* mp = vc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const bool capped = softcap.has_value();
  const float cap = capped ? static_cast<float>(*softcap) : 1.f;
  const int64_t row_stride = KVH * D;  // between consecutive slots of a block

  // chunks per task: one unless threads would idle, and never shorter than kMinChunk positions
  const int64_t tasks = B * KVH, threads = at::get_num_threads();
  const int64_t S = tasks >= threads ? 1
                                     : std::max<int64_t>(1, std::min((threads + tasks - 1) / tasks,
                                                                     L / kMinChunk));
  // per (task, chunk, head): running max, sum of exponentials, unnormalised output [D]
  std::vector<float> part_max(static_cast<size_t>(tasks * S * G));
  std::vector<float> part_sum(static_cast<size_t>(tasks * S * G));
  std::vector<float> part_out(static_cast<size_t>(tasks * S * G * D), 0.f);

  at::parallel_for(0, tasks * S, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<int64_t> slots(static_cast<size_t>(L));
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t t = item / S, chunk = item % S;
      const int64_t b = t / KVH, kh = t % KVH;
      // visible positions -> their slots in the pool
      int64_t m = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t blk = bp[b * n + i];
        TORCH_CHECK(blk >= 0 && blk < NB, "block id out of range");
        for (int64_t s = 0; s < BS; ++s)
          if (mp[b * L + i * BS + s]) slots[static_cast<size_t>(m++)] = blk * BS + s;
      }
      const int64_t j0 = m * chunk / S, j1 = m * (chunk + 1) / S, len = j1 - j0;
      scores.resize(static_cast<size_t>(G * std::max<int64_t>(len, 1)));
      const float* qh = qp + (b * H + kh * G) * D;  // the G query heads of this KV head
      for (int64_t j = j0; j < j1; ++j) {
        if (j + kAhead < j1) {  // the pool is read by slot: prefetch rows the hardware won't
          const int64_t ahead = slots[static_cast<size_t>(j + kAhead)] * row_stride + kh * D;
          for (int64_t d = 0; d < D; d += 16) {
            __builtin_prefetch(kp + ahead + d);
            __builtin_prefetch(vp + ahead + d);
          }
        }
        const float* kr = kp + slots[static_cast<size_t>(j)] * row_stride + kh * D;
        for (int64_t g = 0; g < G; ++g) {
          float s = dot(qh + g * D, kr, D) * sc;
          if (capped) s = std::tanh(s / cap) * cap;
          scores[static_cast<size_t>(g * len + (j - j0))] = s;
        }
      }
      const int64_t part = item * G;  // (t * S + chunk) * G
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sg[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        part_max[static_cast<size_t>(part + g)] = mx;
        part_sum[static_cast<size_t>(part + g)] = sum;
      }
      float* po = part_out.data() + part * D;
      for (int64_t j = 0; j < len; ++j) {  // each V row once, for all G heads
        const float* vr = vp + slots[static_cast<size_t>(j0 + j)] * row_stride + kh * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[static_cast<size_t>(g * len + j)];
          float* o = po + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
        }
      }
    }
  });

  // merge the chunks of each (task, head): rescale to the common max, normalise once
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t b = t / KVH, kh = t % KVH;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < S; ++c)
        mx = std::max(mx, part_max[static_cast<size_t>((t * S + c) * G + g)]);
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // nothing visible: zeros
      float total = 0.f;
      float* o = op + (b * H + kh * G + g) * D;
      for (int64_t c = 0; c < S; ++c) {
        const size_t part = static_cast<size_t>((t * S + c) * G + g);
        const float w = std::exp(part_max[part] - mx);  // 0 for an empty chunk
        total += w * part_sum[part];
        const float* po = part_out.data() + part * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * po[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tolk, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, Tensor valid, "
      "float scale, float? softcap=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tolk, CPU, m) { m.impl("decode_attention", &decode_attention); }
