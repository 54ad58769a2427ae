#include "tests/unit/engine/reference_model.h"

#include <cmath>

#include "tandem/kernels/matmul.h"
#include "tandem/kernels/quant.h"

namespace tandem::testing {
namespace {

using Vec = std::vector<double>;

Vec Row(const engine::WeightView& w, int64_t r) {
  std::vector<float> f(w.cols);
  if (w.packed) {
    kernels::GetPackedRow(w.type, w.data, w.cols, r, f.data());
  } else {
    const size_t rb = kernels::RowBytes(w.type, w.cols);
    kernels::DequantizeRow(w.type, static_cast<const uint8_t*>(w.data) + r * rb, f.data(),
                           w.cols);
  }
  return Vec(f.begin(), f.end());
}

Vec MatVec(const engine::WeightView& w, const Vec& x) {
  Vec y(w.rows);
  for (int64_t r = 0; r < w.rows; ++r) {
    Vec row = Row(w, r);
    double s = 0;
    for (int64_t c = 0; c < w.cols; ++c) s += row[c] * x[c];
    y[r] = s;
  }
  return y;
}

Vec RmsNorm(const Vec& x, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double scale = 1.0 / std::sqrt(ss / x.size() + eps);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * scale * w[i];
  return y;
}

void Rope(const engine::ModelConfig& c, const std::vector<float>& factors, Vec& x, int n_heads,
          int pos) {
  const int hd = c.head_dim;
  for (int h = 0; h < n_heads; ++h) {
    double* v = x.data() + h * hd;
    for (int i = 0; i < c.n_rot / 2; ++i) {
      double theta = pos * std::pow(double(c.rope_base), -2.0 * i / c.n_rot) * c.rope_freq_scale;
      if (!factors.empty()) theta /= factors[i];
      const double cs = std::cos(theta), sn = std::sin(theta);
      int a, b;
      if (c.rope_mode == kernels::RopeMode::kNormal) {
        a = 2 * i;
        b = 2 * i + 1;
      } else {
        a = i;
        b = i + c.n_rot / 2;
      }
      const double x0 = v[a], x1 = v[b];
      v[a] = x0 * cs - x1 * sn;
      v[b] = x0 * sn + x1 * cs;
    }
  }
}

}  // namespace

std::vector<double> ReferenceForward(const engine::Model& m, const std::vector<int32_t>& tokens) {
  const engine::ModelConfig& c = m.config();
  const int n = static_cast<int>(tokens.size());
  const int hd = c.head_dim;
  std::vector<Vec> x(n);
  for (int t = 0; t < n; ++t) x[t] = Row(m.token_embd(), tokens[t]);
  for (int l = 0; l < c.n_layer; ++l) {
    const engine::LayerWeights& w = m.layer(l);
    std::vector<Vec> q(n), k(n), v(n);
    for (int t = 0; t < n; ++t) {
      Vec xn = RmsNorm(x[t], w.attn_norm, c.norm_eps);
      q[t] = MatVec(w.wq, xn);
      k[t] = MatVec(w.wk, xn);
      v[t] = MatVec(w.wv, xn);
      for (size_t i = 0; i < w.bq.size(); ++i) q[t][i] += w.bq[i];
      for (size_t i = 0; i < w.bk.size(); ++i) k[t][i] += w.bk[i];
      for (size_t i = 0; i < w.bv.size(); ++i) v[t][i] += w.bv[i];
      Rope(c, m.rope_freqs(), q[t], c.n_head, t);
      Rope(c, m.rope_freqs(), k[t], c.n_head_kv, t);
    }
    const int group = c.n_head / c.n_head_kv;
    for (int t = 0; t < n; ++t) {
      Vec attn(size_t(c.n_head) * hd, 0.0);
      for (int h = 0; h < c.n_head; ++h) {
        const int kvh = h / group;
        Vec s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          double acc = 0;
          for (int i = 0; i < hd; ++i) acc += q[t][h * hd + i] * k[j][kvh * hd + i];
          s[j] = acc / std::sqrt(double(hd));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int j = 0; j <= t; ++j) {
          for (int i = 0; i < hd; ++i) attn[h * hd + i] += s[j] / sum * v[j][kvh * hd + i];
        }
      }
      Vec o = MatVec(w.wo, attn);
      for (int i = 0; i < c.n_embd; ++i) x[t][i] += o[i];
      Vec xn = RmsNorm(x[t], w.ffn_norm, c.norm_eps);
      Vec g = MatVec(w.w_gate, xn), u = MatVec(w.w_up, xn);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      Vec dn = MatVec(w.w_down, g);
      for (int i = 0; i < c.n_embd; ++i) x[t][i] += dn[i];
    }
  }
  Vec xn = RmsNorm(x[n - 1], m.output_norm(), c.norm_eps);
  return MatVec(m.output(), xn);
}

}  // namespace tandem::testing
