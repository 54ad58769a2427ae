#include "tandem/kernels/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/util/thread_pool.h"
#include "internal.h"
#include "tandem/kernels/cpu_features.h"
#include "tandem/kernels/fp16.h"
#include "tandem/kernels/kv_quant.h"

namespace tandem::kernels {
namespace {

// Pointer to the head_dim elements of kv head `kvh` at position t.
template <typename T>
const T* Slot(const PagedAttentionParams& p, const void* cache, int64_t t, int64_t kvh) {
  const int64_t block = p.block_table[t / p.block_size];
  const int64_t slot = t % p.block_size;
  return static_cast<const T*>(cache) +
         ((block * p.block_size + slot) * p.n_kv_head + kvh) * p.head_dim;
}

// Dequantises the head_dim values of kv head `kvh` at position t of a quantised cache.
void LoadQuantRow(const PagedAttentionParams& p, const void* cache, int64_t t, int64_t kvh,
                  float* out) {
  const int64_t block = p.block_table[t / p.block_size];
  const int64_t slot = t % p.block_size;
  const int64_t slot_bytes = KvQuantSlotBytes(p.n_kv_head, p.head_dim);
  const uint8_t* s =
      static_cast<const uint8_t*>(cache) + (block * p.block_size + slot) * slot_bytes;
  float scale;
  std::memcpy(&scale, s + KvQuantCodeBytes(p.n_kv_head, p.head_dim) + 4 * kvh, 4);
  const uint8_t* codes = s + kvh * p.head_dim;
  if (p.kv_type == DType::kI8) {
    DequantizeRowInt8(reinterpret_cast<const int8_t*>(codes), scale, p.head_dim, out);
  } else {
    DequantizeRowFp8E4M3(codes, scale, p.head_dim, out);
  }
}

// Tag for the quantised instantiation of AttendOne (the element type is not a C++ type).
struct QuantTag {};

inline float DotF32(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (query, head) pair. scores has room for q_pos + 1 floats, kbuf for head_dim.
template <typename T>
void AttendOne(const PagedAttentionParams& p, int64_t qi, int64_t h, float* scores,
               float* kbuf) {
  const int64_t group = p.n_head / p.n_kv_head;
  const int64_t kvh = h / group;
  const float* q = p.q + qi * p.q_stride + h * p.head_dim;
  const int64_t n_keys = p.q_pos[qi] + 1;
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, n_keys - p.window) : 0;
  const int64_t d = p.head_dim;

  float max_s = -INFINITY;
  for (int64_t t = first; t < n_keys; ++t) {
    const T* k = nullptr;
    if constexpr (!std::is_same_v<T, QuantTag>) k = Slot<T>(p, p.k_cache, t, kvh);
    float s;
    if constexpr (std::is_same_v<T, float>) {
      s = DotF32(q, k, d);
    } else if constexpr (std::is_same_v<T, QuantTag>) {
      LoadQuantRow(p, p.k_cache, t, kvh, kbuf);
      s = DotF32(q, kbuf, d);
    } else {
      Fp16ToF32Row(k, kbuf, d);
      s = DotF32(q, kbuf, d);
    }
    s *= p.scale;
    scores[t] = s;
    max_s = std::max(max_s, s);
  }
  if (p.sinks != nullptr) max_s = std::max(max_s, p.sinks[h]);
  double sum = 0.0;
  for (int64_t t = first; t < n_keys; ++t) {
    const float e = std::exp(scores[t] - max_s);
    scores[t] = e;
    sum += e;
  }
  if (p.sinks != nullptr) sum += std::exp(p.sinks[h] - max_s);
  const float inv = static_cast<float>(1.0 / sum);
  float* out = p.out + qi * p.out_stride + h * d;
  std::fill(out, out + d, 0.0f);
  for (int64_t t = first; t < n_keys; ++t) {
    const float w = scores[t] * inv;
    if constexpr (std::is_same_v<T, float>) {
      const T* v = Slot<T>(p, p.v_cache, t, kvh);
      for (int64_t i = 0; i < d; ++i) out[i] += w * v[i];
    } else if constexpr (std::is_same_v<T, QuantTag>) {
      LoadQuantRow(p, p.v_cache, t, kvh, kbuf);
      for (int64_t i = 0; i < d; ++i) out[i] += w * kbuf[i];
    } else {
      const T* v = Slot<T>(p, p.v_cache, t, kvh);
      Fp16ToF32Row(v, kbuf, d);
      for (int64_t i = 0; i < d; ++i) out[i] += w * kbuf[i];
    }
  }
}

// One query row over one KV head: every query head of the group, one at a time. scores has
// room for q_pos + 1 floats, kbuf for head_dim.
void AttendItemScalar(const PagedAttentionParams& p, int64_t qi, int64_t kvh, float* scores,
                      float* kbuf) {
  const int64_t group = p.n_head / p.n_kv_head;
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    if (p.kv_type == DType::kF16) {
      AttendOne<uint16_t>(p, qi, h, scores, kbuf);
    } else if (IsQuantizedKvType(p.kv_type)) {
      AttendOne<QuantTag>(p, qi, h, scores, kbuf);
    } else {
      AttendOne<float>(p, qi, h, scores, kbuf);
    }
  }
}

}  // namespace

void PagedAttention(const PagedAttentionParams& p, util::ThreadPool* pool) {
  PagedAttentionBatch(std::span<const PagedAttentionParams>(&p, 1), pool);
}

void PagedAttentionBatch(std::span<const PagedAttentionParams> seqs, util::ThreadPool* pool) {
  // Work items are (sequence, tile of query rows, KV head): one row on the scalar path, up to
  // kTile consecutive rows on the AVX-512 path, which loads each K and V row once for all of
  // them. Causal rows differ in cost (the last row of a prefill reads every key, the first reads
  // one), so threads take items one at a time from a shared counter, the most expensive tiles
  // of each sequence first, instead of fixed ranges.
  std::vector<int64_t> first_item(seqs.size() + 1, 0);
  int64_t max_keys = 0, max_dim = 0;
  bool simd = false;
#if TANDEM_KERNELS_X86
  simd = ActiveIsa() >= Isa::kAvx512;
#endif
  for (const PagedAttentionParams& p : seqs) {
    for (int64_t i = 0; i < p.n_q; ++i) max_keys = std::max<int64_t>(max_keys, p.q_pos[i] + 1);
    max_dim = std::max(max_dim, p.head_dim);
#if TANDEM_KERNELS_X86
    simd = simd && internal::avx512::AttentionSupports(p);
#endif
  }
  constexpr int64_t kTile = 8;
  const int64_t tile = simd ? kTile : 1;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const PagedAttentionParams& p = seqs[s];
    first_item[s + 1] = first_item[s] + (p.n_q + tile - 1) / tile * p.n_kv_head;
  }
  const int64_t items = first_item.back();
  if (items == 0) return;
  const int64_t stride = (max_keys + 15) / 16 * 16;
#if TANDEM_KERNELS_X86
  const int64_t score_rows = simd ? internal::avx512::ScoreRows() : 4;
#else
  const int64_t score_rows = 4;
#endif
  std::atomic<int64_t> next{0};
  auto worker = [&](int) {
    thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>(score_rows * stride + max_dim);
    if (scratch.size() < need) scratch.resize(need);
    size_t s = 0;
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      while (item >= first_item[s + 1]) ++s;
      const PagedAttentionParams& p = seqs[s];
      const int64_t local = item - first_item[s];
      const int64_t kvh = local % p.n_kv_head;
      // Tiles from the end of the chunk: its last rows read the most keys.
      const int64_t end = p.n_q - (local / p.n_kv_head) * tile;
      const int64_t begin = std::max<int64_t>(0, end - tile);
#if TANDEM_KERNELS_X86
      if (simd) {
        internal::avx512::AttendItem(p, begin, end - begin, kvh, scratch.data(), stride);
        continue;
      }
#endif
      AttendItemScalar(p, begin, kvh, scratch.data(), scratch.data() + 4 * stride);
    }
  };
  if (pool == nullptr || items == 1) {
    worker(0);
  } else {
    pool->RunOnAll(worker);
  }
}

void PagedAttentionReference(const PagedAttentionParams& p) {
  const int64_t group = p.n_head / p.n_kv_head;
  const int64_t d = p.head_dim;
  auto load = [&](const void* cache, int64_t t, int64_t kvh, int64_t i) -> double {
    const int64_t block = p.block_table[t / p.block_size];
    if (IsQuantizedKvType(p.kv_type)) {
      const uint8_t* s = static_cast<const uint8_t*>(cache) +
                         (block * p.block_size + t % p.block_size) *
                             KvQuantSlotBytes(p.n_kv_head, d);
      float scale;
      std::memcpy(&scale, s + KvQuantCodeBytes(p.n_kv_head, d) + 4 * kvh, 4);
      const uint8_t c = s[kvh * d + i];
      const double v = p.kv_type == DType::kI8 ? double(static_cast<int8_t>(c))
                                               : double(Fp8E4M3ToF32(c));
      return v * scale;
    }
    const int64_t idx = ((block * p.block_size + t % p.block_size) * p.n_kv_head + kvh) * d + i;
    if (p.kv_type == DType::kF16) return Fp16ToF32(static_cast<const uint16_t*>(cache)[idx]);
    return static_cast<const float*>(cache)[idx];
  };
  for (int64_t qi = 0; qi < p.n_q; ++qi) {
    for (int64_t h = 0; h < p.n_head; ++h) {
      const int64_t kvh = h / group;
      const float* q = p.q + qi * p.q_stride + h * d;
      const int64_t n_keys = p.q_pos[qi] + 1;
      const int64_t first = p.window > 0 ? std::max<int64_t>(0, n_keys - p.window) : 0;
      std::vector<double> s(n_keys, -INFINITY);
      double mx = p.sinks != nullptr ? double(p.sinks[h]) : -INFINITY;
      for (int64_t t = first; t < n_keys; ++t) {
        double acc = 0;
        for (int64_t i = 0; i < d; ++i) acc += double(q[i]) * load(p.k_cache, t, kvh, i);
        s[t] = acc * p.scale;
        mx = std::max(mx, s[t]);
      }
      double sum = p.sinks != nullptr ? std::exp(double(p.sinks[h]) - mx) : 0.0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      float* out = p.out + qi * p.out_stride + h * d;
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0;
        for (int64_t t = first; t < n_keys; ++t) acc += s[t] / sum * load(p.v_cache, t, kvh, i);
        out[i] = static_cast<float>(acc);
      }
    }
  }
}

}  // namespace tandem::kernels
