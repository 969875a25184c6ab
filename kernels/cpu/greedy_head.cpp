// tolk::screened_argmax: the greedy token of each row from screened approximate logits.
//
// x [N, K] float32 (the final hidden states), approx [N, V] float32 (int8 logits from
// tolk::int8_linear), weight [V, K] float32 (the LM head), act [V], wt [V] float32 (the error
// bound's per-entry constants, see kernels/greedy_head.py). Per row r:
//   bound_n = a_r * act_n + ||x_r||_2 * wt_n,  a_r = max|x_r| / 32767
//   pass 1: best = max_n (approx_n - bound_n)
//   pass 2: every n with approx_n + bound_n + slack >= best is a candidate; its logit is
//           recomputed from the float32 weight (accumulated in double), soft-capped in float32
//           as torch does, and the largest wins (the lowest index on ties, like torch.argmax).
// The same rule as the torch version in kernels/greedy_head.py. One task per row, or, with
// fewer rows than threads, each row's passes split over vocabulary chunks.
//
// tolk::int4_screen_union: the same two passes for the int4 screen of an int8 head
// (kernels/int8_head_screen.py), with its margin, bound_n = dx_r * act_n + ||x_r|| * wt_n where
// dx_r bounds the norm of the int4 op's activation rounding (int8 per group of 32, half a step
// of max|x_g| / 127 each, 0.51 with float rounding, times 1.01 for the int8 op's own), and no
// recomputation: the ascending ids of every entry that is a candidate of at least one row
// (long [U]). The caller scores those with the int8 rows.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: ~4 s less of g++ per build
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr double kActSteps = 32767.0;
constexpr int64_t kLanes = 16;  // independent maxima, so the scan vectorizes
constexpr int64_t kChunk = 16384;  // vocabulary entries per task when rows are few

struct RowBound {
  float a, norm;  // bound_n = a * act_n + norm * wt_n
};

RowBound row_bound(const float* x, int64_t K) {
  double amax = 0.0, sq = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    amax = std::max(amax, static_cast<double>(std::abs(x[k])));
    sq += static_cast<double>(x[k]) * x[k];
  }
  return {static_cast<float>(amax * (1.0 + 1e-6) / kActSteps),
          static_cast<float>(std::sqrt(sq) * (1.0 + 1e-5))};
}

// pass 1 over [n0, n1): the best lower bound (max of approx - bound), max |approx| and the
// widest bound
struct Scan {
  float best, top, widest;
};

Scan scan(const float* approx, const float* act, const float* wt, RowBound b, int64_t n0,
          int64_t n1) {
  float lo[kLanes], big[kLanes], wide[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    lo[l] = -std::numeric_limits<float>::infinity();
    big[l] = wide[l] = 0.f;
  }
  int64_t n = n0;
  for (; n + kLanes <= n1; n += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = approx[n + l], bound = b.a * act[n + l] + b.norm * wt[n + l];
      lo[l] = std::max(lo[l], v - bound);
      big[l] = std::max(big[l], std::abs(v));
      wide[l] = std::max(wide[l], bound);
    }
  for (; n < n1; ++n) {
    const float bound = b.a * act[n] + b.norm * wt[n];
    lo[0] = std::max(lo[0], approx[n] - bound);
    big[0] = std::max(big[0], std::abs(approx[n]));
    wide[0] = std::max(wide[0], bound);
  }
  Scan out{lo[0], big[0], wide[0]};
  for (int64_t l = 1; l < kLanes; ++l) {
    out.best = std::max(out.best, lo[l]);
    out.top = std::max(out.top, big[l]);
    out.widest = std::max(out.widest, wide[l]);
  }
  return out;
}

struct Pick {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
  void take(float v, int64_t n) {  // larger wins; on ties the lower index
    if (index < 0 || v > value || (v == value && n < index)) {
      value = v;
      index = n;
    }
  }
};

// pass 2 over [n0, n1): the candidates' exact logits (double accumulation, float soft-cap)
Pick pick(const float* x, const float* approx, const float* weight, const float* act,
          const float* wt, RowBound b, float threshold, int64_t K, int64_t n0, int64_t n1,
          std::optional<double> softcap) {
  Pick best;
  for (int64_t n = n0; n < n1; ++n) {
    if (approx[n] + (b.a * act[n] + b.norm * wt[n]) < threshold) continue;
    const float* w = weight + n * K;
    double acc = 0.0;
    for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[k]) * w[k];
    float v = static_cast<float>(acc);
    if (softcap) {
      const float c = static_cast<float>(*softcap);
      v = std::tanh(v / c) * c;
    }
    best.take(v, n);
  }
  return best;
}

int64_t screen_row(const float* x, const float* approx, const float* weight, const float* act,
                   const float* wt, int64_t K, int64_t V, std::optional<double> softcap,
                   bool split) {
  const RowBound b = row_bound(x, K);
  const int64_t chunks = split ? (V + kChunk - 1) / kChunk : 1;
  const int64_t size = split ? kChunk : V;
  std::vector<Scan> scans(static_cast<size_t>(chunks));
  std::vector<Pick> picks(static_cast<size_t>(chunks));
  auto over_chunks = [&](auto&& fn) {
    if (split)
      at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) fn(c);
      });
    else
      fn(0);
  };
  over_chunks([&](int64_t c) {
    scans[c] = scan(approx, act, wt, b, c * size, std::min(V, (c + 1) * size));
  });
  float best = -std::numeric_limits<float>::infinity(), big = 0.f;
  for (const Scan& sc : scans) {
    best = std::max(best, sc.best);
    big = std::max(big, sc.top);
  }
  const float threshold = best - big * 1e-6f;  // slack: float rounding of approx +- bound
  over_chunks([&](int64_t c) {
    picks[c] = pick(x, approx, weight, act, wt, b, threshold, K, c * size,
                    std::min(V, (c + 1) * size), softcap);
  });
  Pick out;
  for (const Pick& p : picks)
    if (p.index >= 0) out.take(p.value, p.index);
  return out.index;
}

at::Tensor screened_argmax(const at::Tensor& x, const at::Tensor& approx, const at::Tensor& weight,
                           const at::Tensor& act, const at::Tensor& wt,
                           std::optional<double> softcap) {
  TORCH_CHECK(x.device().is_cpu(), "tolk::screened_argmax is a CPU op");
  for (const at::Tensor* t : {&x, &approx, &weight, &act, &wt})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "tolk::screened_argmax: float32 tensors only");
  TORCH_CHECK(x.dim() == 2 && approx.dim() == 2 && weight.dim() == 2, "x, approx, weight: 2-d");
  const int64_t N = x.size(0), K = x.size(1), V = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must be [V, ", K, "]");
  TORCH_CHECK(approx.size(0) == N && approx.size(1) == V, "approx must be [", N, ", ", V, "]");
  TORCH_CHECK(act.numel() == V && wt.numel() == V, "act, wt must have ", V, " entries");
  TORCH_CHECK(V > 0, "empty vocabulary");
  at::Tensor xc = x.contiguous(), ac = approx.contiguous(), wc = weight.contiguous();
  at::Tensor actc = act.contiguous(), wtc = wt.contiguous();
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  const float *xp = xc.data_ptr<float>(), *ap = ac.data_ptr<float>(), *wp = wc.data_ptr<float>();
  const float *actp = actc.data_ptr<float>(), *wtp = wtc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  if (N < at::get_num_threads()) {  // few rows: each row's vocabulary split across threads
    for (int64_t r = 0; r < N; ++r)
      op[r] = screen_row(xp + r * K, ap + r * V, wp, actp, wtp, K, V, softcap, true);
  } else {
    at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        op[r] = screen_row(xp + r * K, ap + r * V, wp, actp, wtp, K, V, softcap, false);
    });
  }
  return out;
}

constexpr int64_t kInt4Group = 32;

RowBound int4_row_bound(const float* x, int64_t K) {
  double sq = 0.0, steps = 0.0;
  for (int64_t g = 0; g < K; g += kInt4Group) {
    double amax = 0.0;
    for (int64_t k = g; k < g + kInt4Group; ++k) {
      amax = std::max(amax, static_cast<double>(std::abs(x[k])));
      sq += static_cast<double>(x[k]) * x[k];
    }
    const double half_step = 0.51 * amax / 127.0;
    steps += kInt4Group * half_step * half_step;
  }
  return {static_cast<float>(std::sqrt(steps) * 1.01), static_cast<float>(std::sqrt(sq))};
}

at::Tensor int4_screen_union(const at::Tensor& x, const at::Tensor& approx, const at::Tensor& act,
                             const at::Tensor& wt) {
  TORCH_CHECK(approx.device().is_cpu(), "tolk::int4_screen_union is a CPU op");
  for (const at::Tensor* t : {&x, &approx, &act, &wt})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "tolk::int4_screen_union: float32 tensors only");
  TORCH_CHECK(x.dim() == 2 && approx.dim() == 2, "x must be [N, K], approx [N, V]");
  const int64_t N = approx.size(0), V = approx.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == N, "x must have ", N, " rows");
  TORCH_CHECK(K % kInt4Group == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(act.numel() == V && wt.numel() == V, "act, wt must have ", V, " entries");
  at::Tensor xc = x.contiguous(), ac = approx.contiguous();
  at::Tensor actc = act.contiguous(), wtc = wt.contiguous();
  const float *xp = xc.data_ptr<float>(), *ap = ac.data_ptr<float>();
  const float *actp = actc.data_ptr<float>(), *wtp = wtc.data_ptr<float>();
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  std::vector<uint8_t> mark(static_cast<size_t>(V), 0);
  std::vector<Scan> scans(static_cast<size_t>(chunks));
  for (int64_t r = 0; r < N; ++r) {  // rows one after another, each over vocabulary chunks
    const float* row = ap + r * V;
    const RowBound b = int4_row_bound(xp + r * K, K);
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        scans[c] = scan(row, actp, wtp, b, c * kChunk, std::min(V, (c + 1) * kChunk));
    });
    float best = -std::numeric_limits<float>::infinity(), big = 0.f, widest = 0.f;
    for (const Scan& sc : scans) {
      best = std::max(best, sc.best);
      big = std::max(big, sc.top);
      widest = std::max(widest, sc.widest);
    }
    const float threshold = best - big * 1e-6f;  // slack: float rounding of approx +- bound
    // an entry below threshold - widest cannot qualify: most are ruled out by approx alone
    const float reach = threshold - widest * (1.f + 1e-6f);
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t n = c0 * kChunk; n < std::min(V, c1 * kChunk); ++n)
        if (row[n] >= reach && row[n] + (b.a * actp[n] + b.norm * wtp[n]) >= threshold)
          mark[n] = 1;
    });
  }
  std::vector<std::vector<int64_t>> ids(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t n = c * kChunk; n < std::min(V, (c + 1) * kChunk); ++n)
        if (mark[n]) ids[c].push_back(n);
  });
  int64_t total = 0;
  for (const auto& v : ids) total += static_cast<int64_t>(v.size());
  at::Tensor out = at::empty({total}, approx.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (const auto& v : ids) op = std::copy(v.begin(), v.end(), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tolk, m) {
  m.def(
      "screened_argmax(Tensor x, Tensor approx, Tensor weight, Tensor act, Tensor wt, "
      "float? softcap=None) -> Tensor");
  m.def("int4_screen_union(Tensor x, Tensor approx, Tensor act, Tensor wt) -> Tensor");
}

TORCH_LIBRARY_IMPL(tolk, CPU, m) {
  m.impl("screened_argmax", &screened_argmax);
  m.impl("int4_screen_union", &int4_screen_union);
}
