// What an engine step costs, learned from the engine's own steps, and how well it used the
// machine.
//
// StepShape is what a step did: prefill tokens (every row of a chunk longer than one token),
// decode sequences (one-token chunks) and the positions those decode rows attend to.
// StepCostModel fits step seconds = intercept + a * prefill tokens + b * decode sequences +
// c * decode KV tokens by least squares over the steps seen, old ones forgotten, so the router
// (through heartbeats) and the planner can predict a step from a queue's shape. StepWork counts
// the bytes a step had to move at least (every weight once, each sequence's K/V read once, the
// new K/V written) and its FLOPs (two per weight per token, plus attention), which over the
// step's time and the machine's measured peaks give model bandwidth utilisation (MBU) and model
// FLOPs utilisation (MFU).
//
// Threading: StepCostModel is not thread-safe; the engine's thread owns it. MeasurePeaks spawns
// its own threads and takes a fraction of a second.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <span>

#include "engine/model/model.h"

namespace tandem::engine {

struct SeqChunk;

struct StepShape {
  int64_t prefill_tokens = 0;
  int64_t decode_seqs = 0;
  int64_t decode_kv_tokens = 0;  // positions the decode rows attend to, their own included
};

StepShape ShapeOf(std::span<const SeqChunk> chunks);

// Non-negative least squares over the features (1, prefill tokens, decode sequences, decode KV
// tokens), with the normal equations' sums decayed by kForget per step and a small ridge, so a
// feature that never varied (no prefill on a decode worker) keeps a coefficient near 0 instead
// of an arbitrary one, and no coefficient is negative (a cost never is).
class StepCostModel {
 public:
  static constexpr double kForget = 0.995;

  struct Coefficients {
    double intercept_s = 0;
    double prefill_token_s = 0;
    double decode_seq_s = 0;
    double decode_kv_token_s = 0;
  };

  void Observe(const StepShape& shape, double seconds);
  // Predicted seconds of a step of this shape; 0 before any step was observed.
  double Predict(const StepShape& shape) const;
  // The fit (solved on demand; all 0 before any step).
  Coefficients coefficients() const;
  int64_t steps() const { return steps_; }
  // Root mean square relative error of the prediction made just before each recent step
  // (decayed like the fit), as a fraction; 0 before two steps.
  double relative_rmse() const;

 private:
  static constexpr int kF = 4;
  static std::array<double, kF> Features(const StepShape& s);
  std::array<double, kF * kF> xx_{};
  std::array<double, kF> xy_{};
  double w_ = 0;
  int64_t steps_ = 0;
  double err2_ = 0, err_w_ = 0;
};

// Decode admission by time per output token (TPOT). A decode step makes one token for every
// sequence of the batch, so the batch's TPOT is its step time, and one more sequence slows every
// member. A member as admission sees it:
struct DecodeMember {
  // Positions it attends to, averaged over its life: prompt + half its max_tokens.
  int64_t context_tokens = 0;
  double tpot_target_s = 0;  // 0: none
};
struct TpotCheck {
  bool admit = true;
  double predicted_s = 0;  // the batch's decode step with the newcomer; 0: not predicted
  double target_s = 0;     // the tightest target among them; 0: none
};
// Whether `joining` may join `batch`: refused only when the fit has seen at least `min_steps`
// steps, the batch is not empty, some sequence (the newcomer included) has a target, and the
// predicted decode step of every member plus the newcomer is past the tightest target. A
// newcomer to an empty batch is always admitted: alone, it runs as fast as this worker can.
TpotCheck CheckDecodeTpot(const StepCostModel& cost, int64_t min_steps,
                          std::span<const DecodeMember> batch, const DecodeMember& joining);

// Bytes and FLOPs a step needs at least, for a model and KV element size.
struct StepWork {
  double bytes = 0;
  double flops = 0;
};
StepWork WorkOf(const Model& model, int64_t kv_bytes_per_position, std::span<const SeqChunk> chunks);

// The machine's peaks that MBU and MFU are measured against.
struct DevicePeaks {
  double read_gbs = 0;  // 1e9 bytes/s, a STREAM-like read with the engine's threads
  double gflops = 0;    // 1e9 FLOP/s, f32 FMAs in registers on every thread
};
// Measures both on the CPU with `threads` threads (about half a second on an idle machine,
// 256 MiB); the threads it starts inherit the caller's scheduling policy. Once `*cancel` is set
// it skips the work left (every slice of a few MiB checks) and returns what it has (0 for a
// peak it did not finish), so a measurement starved of CPU never holds up its owner's exit.
DevicePeaks MeasureCpuPeaks(int32_t threads, const std::atomic<bool>* cancel = nullptr);

}  // namespace tandem::engine
