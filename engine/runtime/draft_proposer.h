// Speculative decoding with a draft model: `draft:PATH` (another GGUF with the target's
// vocabulary) and `self:TYPE` (the target's own file with its matrices converted to TYPE at
// load, e.g. a Q4_0 draft for a Q8_0 target).
//
// The draft runs in its own Engine with its own paged KV pool, sized like the target's (same
// context, max_seqs and block size). Each sequence's draft K/V live in blocks of that pool,
// keyed by DraftSlot::seq. A proposal catches the draft up on the tokens it has not seen (the
// whole prompt the first time, afterwards the tokens the target accepted and added) and then
// runs k one-token steps, all sequences of the batch in each, taking the draft's greedy token at
// each: a point mass, which Sampler::Verify's rule needs. Rejected drafts' K/V are rolled back
// by position, as in the target: the draft remembers which tokens it fed and, on the next
// proposal, keeps only the prefix that still matches the sequence.
//
// In a P/D cluster both workers load the draft. The decode worker's draft proposes; its KV pool
// is a transport region, and a reservation hands prefill draft blocks there beside the target's.
// Prefill runs the draft over the prompt and writes its K/V layer by layer in the same transfer;
// decode adopts those blocks (Adopt) and feeds the draft only what follows the prompt. Without
// them (decode chose to compute them, had no draft blocks free, or they failed their checksum)
// the draft computes the prompt's K/V on the sequence's first proposal
// (docs/perf/speculative.md measures both).
//
// Threading: as the Scheduler, one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/runtime/engine.h"
#include "engine/spec/proposer.h"

namespace tandem::engine {

class DraftModelProposer final : public Proposer {
 public:
  // The draft must have the target's vocabulary, token for token: INVALID_ARGUMENT naming the
  // first difference otherwise. The draft's engine takes the target's options (threads, device,
  // context, max_seqs, block size, KV type, batch budget) and its own KV memory.
  // `make_engine`, when given, creates the draft's engine from the model and options (a decode
  // worker puts its KV pool in a transport region that way); Engine::Create otherwise.
  using EngineFactory = std::function<absl::StatusOr<std::unique_ptr<Engine>>(
      std::shared_ptr<const Model>, const EngineOptions&)>;
  static absl::StatusOr<std::unique_ptr<DraftModelProposer>> Create(
      std::string name, std::shared_ptr<const Model> draft, const Engine& target,
      const EngineFactory& make_engine = nullptr);

  std::string_view name() const override { return name_; }
  // One sequence, with no state kept: the draft computes the whole context each call.
  void Propose(std::span<const int32_t> tokens, int32_t max_draft,
               std::vector<int32_t>* draft) override;
  absl::Status ProposeBatch(std::span<const DraftSlot> slots) override;
  void Forget(uint64_t seq) override;
  // The blocks come from engine().kv().pool() and hold the draft's K/V of `tokens`.
  void Adopt(uint64_t seq, std::span<const int32_t> tokens, std::vector<int32_t> blocks) override;
  // The draft's weight bytes per token over the target's: a decode step reads its weights once,
  // so that is what one draft step costs relative to one of the target's.
  double draft_cost() const override { return draft_cost_; }
  // A draft model of the target's family agrees with it most of the time; the first few
  // verify steps correct the estimate either way.
  double prior_acceptance() const override { return 0.8; }
  double last_step_seconds() const override { return last_step_seconds_; }

  Engine& engine() { return *engine_; }
  size_t num_sequences() const { return seqs_.size(); }

 private:
  struct State {
    std::vector<int32_t> blocks;
    std::vector<int32_t> fed;  // tokens whose K/V are in blocks, by position
    int64_t stable = 0;        // fed[0, stable) are known to equal the sequence's tokens
  };
  DraftModelProposer(std::string name, std::unique_ptr<Engine> engine, double draft_cost)
      : name_(std::move(name)), engine_(std::move(engine)), draft_cost_(draft_cost) {}
  // Grows st's blocks to cover `positions` positions; false when the pool is out of blocks.
  bool Cover(State& st, int64_t positions);

  std::string name_;
  std::unique_ptr<Engine> engine_;
  double draft_cost_;
  absl::node_hash_map<uint64_t, State> seqs_;  // node: Work keeps pointers across inserts
  std::vector<float> logits_;
  double last_step_seconds_ = 0;
};

// The proposer o.method names: null for kOff, the n-gram proposer, or a draft model loaded for
// `target` (kSelf: the target's own file, converted; kDraft: o.draft_path). Loading errors come
// back as they are (NOT_FOUND for a missing file, INVALID_ARGUMENT for another vocabulary).
absl::StatusOr<std::shared_ptr<Proposer>> MakeSpecProposer(
    const SpeculativeOptions& o, const Engine& target,
    const DraftModelProposer::EngineFactory& make_engine = nullptr);

// The draft model o.method names, loaded for `target` and checked against its vocabulary; null
// for kOff and kNgram. MakeSpecProposer uses it, and so does a prefill worker, which runs the
// draft over prompts (DraftEngineOptions) without proposing.
absl::StatusOr<std::shared_ptr<const Model>> LoadDraftModel(const SpeculativeOptions& o,
                                                            const Engine& target);
// The draft's engine options: the target's (threads, device, context, max_seqs, block size,
// KV type, batch budget) with a KV pool of its own, sized for the draft's shape.
EngineOptions DraftEngineOptions(const Engine& target);

}  // namespace tandem::engine
