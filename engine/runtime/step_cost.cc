#include "engine/runtime/step_cost.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "engine/runtime/engine.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tandem::engine {

StepShape ShapeOf(std::span<const SeqChunk> chunks) {
  StepShape s;
  for (const SeqChunk& ch : chunks) {
    const int64_t n = static_cast<int64_t>(ch.tokens.size());
    if (n == 1) {
      ++s.decode_seqs;
      s.decode_kv_tokens += int64_t{ch.start_pos} + 1;
    } else {
      s.prefill_tokens += n;
    }
  }
  return s;
}

std::array<double, StepCostModel::kF> StepCostModel::Features(const StepShape& s) {
  // Scaled to similar magnitudes (a step has up to hundreds of tokens and sequences and up to
  // hundreds of thousands of KV positions), which keeps the normal equations well conditioned.
  return {1.0, s.prefill_tokens / 100.0, s.decode_seqs / 10.0, s.decode_kv_tokens / 10000.0};
}

void StepCostModel::Observe(const StepShape& shape, double seconds) {
  if (!(seconds > 0)) return;
  if (steps_ > 0) {
    const double predicted = Predict(shape);
    if (predicted > 0) {
      const double rel = (predicted - seconds) / seconds;
      err2_ = kForget * err2_ + rel * rel;
      err_w_ = kForget * err_w_ + 1;
    }
  }
  const std::array<double, kF> f = Features(shape);
  for (double& v : xx_) v *= kForget;
  for (double& v : xy_) v *= kForget;
  for (int i = 0; i < kF; ++i) {
    for (int j = 0; j < kF; ++j) xx_[i * kF + j] += f[i] * f[j];
    xy_[i] += f[i] * seconds;
  }
  w_ = kForget * w_ + 1;
  ++steps_;
}

StepCostModel::Coefficients StepCostModel::coefficients() const {
  Coefficients c;
  if (steps_ == 0) return c;
  // Non-negative least squares: no cost is negative, but an unconstrained fit over a narrow
  // range of shapes, or of a step time that grows faster than linearly (attention over a long
  // prompt), can give a negative coefficient that another one then overstates, and a model
  // that predicts nonsense outside the shapes it saw. The NNLS solution is the least-squares
  // solution on some subset of the features with every coefficient >= 0, so with four
  // features every subset is solved and the feasible one that fits best wins.
  const double ridge = 1e-6 * std::max(1.0, w_);
  std::array<double, kF> best{};
  double best_loss = 0;
  bool found = false;
  for (unsigned mask = 1; mask < (1u << kF); ++mask) {
    int idx[kF], n = 0;
    for (int i = 0; i < kF; ++i) {
      if (mask & (1u << i)) idx[n++] = i;
    }
    // (X'X + ridge) b = X'y on the subset, by Gaussian elimination with partial pivoting; the
    // ridge is tiny against the sums and only decides features that never varied.
    std::array<double, kF * kF> a{};
    std::array<double, kF> b{};
    for (int r = 0; r < n; ++r) {
      for (int k = 0; k < n; ++k) a[r * kF + k] = xx_[idx[r] * kF + idx[k]];
      if (idx[r] != 0) a[r * kF + r] += ridge;
      b[r] = xy_[idx[r]];
    }
    bool singular = false;
    for (int col = 0; col < n && !singular; ++col) {
      int piv = col;
      for (int r = col + 1; r < n; ++r) {
        if (std::fabs(a[r * kF + col]) > std::fabs(a[piv * kF + col])) piv = r;
      }
      if (std::fabs(a[piv * kF + col]) < 1e-300) {
        singular = true;
        break;
      }
      if (piv != col) {
        for (int k = 0; k < n; ++k) std::swap(a[col * kF + k], a[piv * kF + k]);
        std::swap(b[col], b[piv]);
      }
      for (int r = col + 1; r < n; ++r) {
        const double m = a[r * kF + col] / a[col * kF + col];
        for (int k = col; k < n; ++k) a[r * kF + k] -= m * a[col * kF + k];
        b[r] -= m * b[col];
      }
    }
    if (singular) continue;
    std::array<double, kF> sub{};
    for (int r = n - 1; r >= 0; --r) {
      double v = b[r];
      for (int k = r + 1; k < n; ++k) v -= a[r * kF + k] * sub[k];
      sub[r] = v / a[r * kF + r];
    }
    std::array<double, kF> x{};
    bool feasible = true;
    for (int r = 0; r < n; ++r) {
      x[idx[r]] = sub[r];
      feasible = feasible && sub[r] >= 0;
    }
    if (!feasible) continue;
    // The squared error up to the constant y'y: x'(X'X)x - 2 x'(X'y).
    double loss = 0;
    for (int r = 0; r < kF; ++r) {
      double row = 0;
      for (int k = 0; k < kF; ++k) row += xx_[r * kF + k] * x[k];
      loss += x[r] * row - 2 * x[r] * xy_[r];
    }
    if (!found || loss < best_loss) {
      best = x;
      best_loss = loss;
      found = true;
    }
  }
  if (!found) return c;
  c.intercept_s = best[0];
  c.prefill_token_s = best[1] / 100.0;
  c.decode_seq_s = best[2] / 10.0;
  c.decode_kv_token_s = best[3] / 10000.0;
  return c;
}

double StepCostModel::Predict(const StepShape& s) const {
  if (steps_ == 0) return 0;
  const Coefficients c = coefficients();
  const double t = c.intercept_s + c.prefill_token_s * double(s.prefill_tokens) +
                   c.decode_seq_s * double(s.decode_seqs) +
                   c.decode_kv_token_s * double(s.decode_kv_tokens);
  return std::max(t, 0.0);
}

TpotCheck CheckDecodeTpot(const StepCostModel& cost, int64_t min_steps,
                          std::span<const DecodeMember> batch, const DecodeMember& joining) {
  TpotCheck out;
  StepShape shape;
  shape.decode_seqs = static_cast<int64_t>(batch.size()) + 1;
  shape.decode_kv_tokens = joining.context_tokens;
  out.target_s = joining.tpot_target_s;
  for (const DecodeMember& m : batch) {
    shape.decode_kv_tokens += m.context_tokens;
    if (m.tpot_target_s > 0 && (out.target_s == 0 || m.tpot_target_s < out.target_s)) {
      out.target_s = m.tpot_target_s;
    }
  }
  if (batch.empty() || out.target_s <= 0 || cost.steps() < min_steps) return out;
  out.predicted_s = cost.Predict(shape);
  out.admit = out.predicted_s <= out.target_s;
  return out;
}

double StepCostModel::relative_rmse() const {
  return err_w_ > 0 ? std::sqrt(err2_ / err_w_) : 0.0;
}

StepWork WorkOf(const Model& model, int64_t kv_bytes_per_position,
                std::span<const SeqChunk> chunks) {
  const ModelConfig& c = model.config();
  // Weight elements that multiply each token: every layer's attention and FFN (of an MoE
  // layer, the router and the experts the token is routed to) and the classifier.
  const double d = c.n_embd, q = double(c.n_head) * c.head_dim, kv = double(c.n_head_kv) * c.head_dim;
  const double per_layer = d * (q + 2 * kv) + q * d + c.ffn_params_per_token();
  const double params = c.n_layer * per_layer + d * c.n_vocab;
  StepWork w;
  w.bytes = static_cast<double>(model.weight_bytes_per_token());
  double tokens = 0, logit_rows = 0;
  for (const SeqChunk& ch : chunks) {
    const double n = static_cast<double>(ch.tokens.size());
    const double end = double(ch.start_pos) + n;
    tokens += n;
    if (ch.want_logits) logit_rows += ch.n_logits;
    // This sequence's K/V read once (all its positions) and its new positions written.
    w.bytes += double(kv_bytes_per_position) * (end + n);
    // Attention: QK^T and PV, 2 FLOPs each per head element per attended position; row i of
    // the chunk attends to start_pos + i + 1 positions.
    const double attended = n * double(ch.start_pos) + n * (n + 1) / 2;
    w.flops += 4.0 * double(c.n_layer) * q * attended;
  }
  // The classifier runs only on the rows whose logits were asked for.
  w.flops += 2.0 * (params - d * c.n_vocab) * tokens + 2.0 * d * c.n_vocab * logit_rows;
  return w;
}

namespace {

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

uint64_t SumSlice(const uint64_t* p, size_t n) {
  // Eight independent chains, so the adds never wait on each other.
  uint64_t a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) a[k] += p[i + k];
  }
  for (; i < n; ++i) a[0] += p[i];
  uint64_t s = 0;
  for (uint64_t x : a) s += x;
  return s;
}

#if defined(__x86_64__)
// The same with 256-bit loads in four independent chains of 32-byte adds (a 128-byte stride),
// the loop the membw probe uses, which reaches the read bandwidth the narrower one does not.
__attribute__((target("avx2"))) uint64_t SumSliceAvx2(const uint64_t* p, size_t n) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  const size_t bytes = n * sizeof(uint64_t);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 96)));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t lanes[4];
  std::memcpy(lanes, &s, sizeof(lanes));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + SumSlice(p + i / 8, n - i / 8);
}
#endif

uint64_t SumFast(const uint64_t* p, size_t n) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return SumSliceAvx2(p, n);
#endif
  return SumSlice(p, n);
}

#if defined(__x86_64__)
// Independent FMA chains on 512-bit registers (or 256-bit), as many as hide the latency.
__attribute__((target("avx512f"))) double FmaLoop512(int64_t iters) {
  __m512 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm512_set1_ps(1.0f + k * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm512_fmadd_ps(a[k], m, b);
  }
  __m512 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm512_add_ps(s, a[k]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx2,fma"))) double FmaLoop256(int64_t iters) {
  __m256 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm256_set1_ps(1.0f + k * 1e-3f);
  const __m256 m = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm256_fmadd_ps(a[k], m, b);
  }
  float out[8];
  __m256 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm256_add_ps(s, a[k]);
  _mm256_storeu_ps(out, s);
  return out[0];
}
#endif

// FLOPs one thread does in FmaLoop(iters) and the loop itself; 0 lanes: no vector FMA.
struct FmaKernel {
  int lanes = 0;
  double (*loop)(int64_t) = nullptr;
};
FmaKernel PickFma() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return {16, FmaLoop512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {8, FmaLoop256};
#endif
  return {};
}

}  // namespace

DevicePeaks MeasureCpuPeaks(int32_t threads, const std::atomic<bool>* cancel) {
  threads = std::max(1, threads);
  DevicePeaks peaks;
  using Clock = std::chrono::steady_clock;
  auto cancelled = [cancel] { return cancel != nullptr && cancel->load(); };
  // Read bandwidth: each thread first-touches and then sums its own slice of four times the
  // last-level cache (64 to 256 MiB; it is freed on return), passes started together at a
  // barrier; a pass's bandwidth is all slices over the slowest thread's time (as the membw
  // probe measures it). Every thread arrives at every barrier, cancelled or not.
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  const size_t bytes =
      std::clamp<size_t>(llc > 0 ? 4 * size_t(llc) : 0, size_t{64} << 20, size_t{256} << 20);
  const size_t words = bytes / sizeof(uint64_t);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[words]);
  const size_t slice = words / threads;
  constexpr size_t kChunk = size_t{4} << 20 >> 3;  // words between cancellation checks
  constexpr int kPasses = 8;
  std::vector<std::vector<double>> secs(threads, std::vector<double>(kPasses));
  std::atomic<uint64_t> sink{0};
  std::barrier sync(threads);
  std::vector<std::thread> ts;
  for (int32_t t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      uint64_t* mine = buf.get() + t * slice;
      for (size_t i = 0; i < slice && !cancelled(); ++i) mine[i] = i;
      for (int pass = 0; pass < kPasses; ++pass) {
        sync.arrive_and_wait();
        const auto t0 = Clock::now();
        uint64_t sum = 0;
        for (size_t b = 0; b < slice && !cancelled(); b += kChunk) {
          sum += SumFast(mine + b, std::min(kChunk, slice - b));
        }
        sink += sum;
        secs[t][pass] = std::chrono::duration<double>(Clock::now() - t0).count();
      }
    });
  }
  for (auto& t : ts) t.join();
  if (cancelled()) return peaks;
  std::vector<double> gbs;
  for (int pass = 1; pass < kPasses; ++pass) {
    double slowest = 0;
    for (int32_t t = 0; t < threads; ++t) slowest = std::max(slowest, secs[t][pass]);
    gbs.push_back(double(slice * threads * sizeof(uint64_t)) / slowest / 1e9);
  }
  peaks.read_gbs = MedianOf(gbs);
  // FLOPs: every thread runs independent FMA chains in registers.
  const FmaKernel fma = PickFma();
  auto run = [&](auto&& body) {
    std::vector<std::thread> all;
    for (int32_t t = 0; t < threads; ++t) all.emplace_back(body, t);
    for (auto& t : all) t.join();
  };
  if (fma.loop != nullptr && !cancelled()) {
    constexpr int64_t kIters = 1'000'000;
    std::vector<double> gf;
    for (int pass = 0; pass < 3; ++pass) {
      if (cancelled()) return peaks;
      std::atomic<double> out{0};
      const auto t0 = Clock::now();
      run([&](int32_t) { out.store(fma.loop(kIters)); });
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      gf.push_back(2.0 * 12 * fma.lanes * double(kIters) * threads / s / 1e9);
    }
    peaks.gflops = MedianOf(gf);
  }
  return peaks;
}

}  // namespace tandem::engine
