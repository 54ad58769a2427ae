#include "tests/unit/engine/reference_model.h"

#include <algorithm>
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
      double extrap = pos * std::pow(double(c.rope_base), -2.0 * i / c.n_rot);
      if (!factors.empty()) extrap /= factors[i];
      double theta = extrap * c.rope_freq_scale;
      double mscale = 1.0;
      if (c.rope_ext_factor != 0) {
        // YaRN: pairs between the correction dims (the pairs making beta_fast = 32 down to
        // beta_slow = 1 turns over the original context) blend from the unscaled angle to the
        // interpolated one; the magnitude grows by 1 + 0.1 ln(factor).
        auto corr = [&](double turns) {
          return c.n_rot * std::log(c.rope_ctx_orig / (turns * 2 * M_PI)) /
                 (2 * std::log(double(c.rope_base)));
        };
        const double lo = std::max(0.0, std::floor(corr(32)));
        const double hi = std::min(c.n_rot - 1.0, std::ceil(corr(1)));
        const double ramp = 1 - std::clamp((i - lo) / std::max(0.001, hi - lo), 0.0, 1.0);
        theta = theta * (1 - ramp) + extrap * ramp;
        mscale = 1 + 0.1 * std::log(1 / double(c.rope_freq_scale));
      }
      const double cs = std::cos(theta) * mscale, sn = std::sin(theta) * mscale;
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

// Each head_dim slice normalised on its own (qwen3's q/k norms).
void HeadNorm(Vec& x, const std::vector<float>& w, int n_heads, double eps) {
  const size_t hd = w.size();
  for (int h = 0; h < n_heads; ++h) {
    Vec head(x.begin() + h * hd, x.begin() + (h + 1) * hd);
    head = RmsNorm(head, w, eps);
    std::copy(head.begin(), head.end(), x.begin() + h * hd);
  }
}

Vec Ffn(const engine::WeightView& gate, const engine::WeightView& up,
        const engine::WeightView& down, const Vec& xn) {
  Vec g = MatVec(gate, xn), u = MatVec(up, xn);
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
  return MatVec(down, g);
}

// Softmax over the router's logits, the n_expert_used most probable experts weighted by their
// probabilities (renormalised when the arch does), plus the sigmoid-gated shared expert.
// gpt-oss's expert: biases after each projection, and the clamped SwiGLU
// min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1).
Vec OaiExpert(const engine::LayerWeights& w, int e, const Vec& xn) {
  Vec g = MatVec(w.exp_gate[e], xn), u = MatVec(w.exp_up[e], xn);
  const size_t ff = g.size(), d = xn.size();
  for (size_t i = 0; i < ff; ++i) {
    const double gx = std::min(g[i] + w.exp_gate_b[e * ff + i], 7.0);
    const double uy = std::clamp(u[i] + w.exp_up_b[e * ff + i], -7.0, 7.0);
    g[i] = gx / (1 + std::exp(-1.702 * gx)) * (uy + 1);
  }
  Vec y = MatVec(w.exp_down[e], g);
  for (size_t i = 0; i < d; ++i) y[i] += w.exp_down_b[e * d + i];
  return y;
}

Vec MoeFfn(const engine::ModelConfig& c, const engine::LayerWeights& w, const Vec& xn) {
  // Decided here from the architecture, not from the loader's flags under test: gpt-oss
  // chooses on the (biased) logits and weights by a softmax over the chosen; the others by a
  // softmax over all experts, renormalised over the chosen except in qwen2moe.
  const bool gpt_oss = c.arch_name == "gpt-oss";
  Vec logits = MatVec(w.ffn_gate_inp, xn);
  for (size_t e = 0; e < w.gate_inp_b.size(); ++e) logits[e] += w.gate_inp_b[e];
  Vec probs = logits;
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (double& l : probs) sum += (l = std::exp(l - mx));
  for (double& l : probs) l /= sum;
  std::vector<int> order(c.n_expert);
  for (int e = 0; e < c.n_expert; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  double chosen = 0;
  for (int s = 0; s < c.n_expert_used; ++s) chosen += probs[order[s]];
  Vec out(c.n_embd, 0.0);
  for (int s = 0; s < c.n_expert_used; ++s) {
    const int e = order[s];
    const double wt = gpt_oss || c.arch_name != "qwen2moe" ? probs[e] / chosen : probs[e];
    Vec y = gpt_oss ? OaiExpert(w, e, xn) : Ffn(w.exp_gate[e], w.exp_up[e], w.exp_down[e], xn);
    for (int i = 0; i < c.n_embd; ++i) out[i] += wt * y[i];
  }
  if (c.n_ff_shexp > 0) {
    double g = 0;
    for (int i = 0; i < c.n_embd; ++i) g += w.sh_gate_inp[i] * xn[i];
    const double gate = 1 / (1 + std::exp(-g));
    Vec y = Ffn(w.sh_gate, w.sh_up, w.sh_down, xn);
    for (int i = 0; i < c.n_embd; ++i) out[i] += gate * y[i];
  }
  return out;
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
      if (c.qk_norm) {
        HeadNorm(q[t], w.q_norm, c.n_head, c.norm_eps);
        HeadNorm(k[t], w.k_norm, c.n_head_kv, c.norm_eps);
      }
      Rope(c, m.rope_freqs(), q[t], c.n_head, t);
      Rope(c, m.rope_freqs(), k[t], c.n_head_kv, t);
    }
    const int group = c.n_head / c.n_head_kv;
    // gpt-oss: even layers see only the last n_swa positions; every head has a sink logit.
    const bool gpt_oss = c.arch_name == "gpt-oss";
    const int window = gpt_oss && l % 2 == 0 ? c.n_swa : 0;
    for (int t = 0; t < n; ++t) {
      Vec attn(size_t(c.n_head) * hd, 0.0);
      const int first = window > 0 ? std::max(0, t + 1 - window) : 0;
      for (int h = 0; h < c.n_head; ++h) {
        const int kvh = h / group;
        Vec s(t + 1, 0.0);
        double mx = gpt_oss ? double(w.sinks[h]) : -1e300;
        for (int j = first; j <= t; ++j) {
          double acc = 0;
          for (int i = 0; i < hd; ++i) acc += q[t][h * hd + i] * k[j][kvh * hd + i];
          s[j] = acc / std::sqrt(double(hd));
          mx = std::max(mx, s[j]);
        }
        double sum = gpt_oss ? std::exp(double(w.sinks[h]) - mx) : 0.0;
        for (int j = first; j <= t; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int j = first; j <= t; ++j) {
          for (int i = 0; i < hd; ++i) attn[h * hd + i] += s[j] / sum * v[j][kvh * hd + i];
        }
      }
      Vec o = MatVec(w.wo, attn);
      for (size_t i = 0; i < w.bo.size(); ++i) o[i] += w.bo[i];
      for (int i = 0; i < c.n_embd; ++i) x[t][i] += o[i];
      Vec xn = RmsNorm(x[t], w.ffn_norm, c.norm_eps);
      Vec dn = c.is_moe() ? MoeFfn(c, w, xn) : Ffn(w.w_gate, w.w_up, w.w_down, xn);
      for (int i = 0; i < c.n_embd; ++i) x[t][i] += dn[i];
    }
  }
  Vec xn = RmsNorm(x[n - 1], m.output_norm(), c.norm_eps);
  return MatVec(m.output(), xn);
}

}  // namespace tandem::testing
