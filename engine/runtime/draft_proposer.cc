#include "engine/runtime/draft_proposer.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/util/status_util.h"

namespace tandem::engine {

namespace {

constexpr uint64_t kOneOff = std::numeric_limits<uint64_t>::max();

absl::Status CheckSameVocabulary(const Model& draft, const Model& target) {
  const Tokenizer& d = draft.tokenizer();
  const Tokenizer& t = target.tokenizer();
  if (d.vocab_size() != t.vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the draft model has ", d.vocab_size(),
                                                   " tokens; the target has ", t.vocab_size()));
  }
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (d.piece(id) != t.piece(id)) {
      return absl::InvalidArgumentError(absl::StrCat("the draft model's token ", id, " is '",
                                                     d.piece(id), "'; the target's is '",
                                                     t.piece(id), "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DraftModelProposer>> DraftModelProposer::Create(
    std::string name, std::shared_ptr<const Model> draft, const Engine& target,
    const EngineFactory& make_engine) {
  if (draft == nullptr) return absl::InvalidArgumentError("no draft model");
  TANDEM_RETURN_IF_ERROR(CheckSameVocabulary(*draft, target.model()));
  const EngineOptions o = DraftEngineOptions(target);
  const double cost =
      static_cast<double>(draft->weight_bytes_per_token()) /
      static_cast<double>(std::max<uint64_t>(1, target.model().weight_bytes_per_token()));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          make_engine ? make_engine(std::move(draft), o)
                                      : Engine::Create(std::move(draft), o));
  return std::unique_ptr<DraftModelProposer>(
      new DraftModelProposer(std::move(name), std::move(engine), std::clamp(cost, 0.01, 1.0)));
}

EngineOptions DraftEngineOptions(const Engine& target) {
  EngineOptions o = target.options();
  o.kv_blocks = 0;  // enough for max_seqs full contexts of the draft's own shape
  o.kv_memory = nullptr;
  o.kv_memory_bytes = 0;
  return o;
}

bool DraftModelProposer::Cover(State& st, int64_t positions) {
  const int64_t bs = engine_->kv().block_size();
  const int64_t need = (positions + bs - 1) / bs - static_cast<int64_t>(st.blocks.size());
  if (need <= 0) return true;
  auto more = engine_->kv().pool().AllocateN(static_cast<int32_t>(need));
  if (!more.ok()) return false;
  st.blocks.insert(st.blocks.end(), more->begin(), more->end());
  return true;
}

void DraftModelProposer::Forget(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  engine_->kv().pool().UnrefAll(it->second.blocks).IgnoreError();
  seqs_.erase(it);
}

void DraftModelProposer::Adopt(uint64_t seq, std::span<const int32_t> tokens,
                               std::vector<int32_t> blocks) {
  Forget(seq);
  State& st = seqs_[seq];
  st.blocks = std::move(blocks);
  st.fed.assign(tokens.begin(), tokens.end());
  st.stable = static_cast<int64_t>(st.fed.size());
}

void DraftModelProposer::Propose(std::span<const int32_t> tokens, int32_t max_draft,
                                 std::vector<int32_t>* draft) {
  const DraftSlot slot{kOneOff, tokens, max_draft, draft};
  if (!ProposeBatch({&slot, 1}).ok()) draft->clear();
  Forget(kOneOff);
}

absl::Status DraftModelProposer::ProposeBatch(std::span<const DraftSlot> slots) {
  struct Work {
    const DraftSlot* slot;
    State* st;
    int64_t fed;  // positions whose K/V are in the draft's cache
    int32_t k;
  };
  const int64_t ctx = engine_->ctx_size();
  const int64_t budget = engine_->options().max_batch_tokens;
  last_step_seconds_ = 0;
  std::vector<Work> work;
  for (const DraftSlot& s : slots) {
    s.draft->clear();
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    // Positions len-1 .. len+k-2 are fed: they must lie within the context.
    const int32_t k = static_cast<int32_t>(std::min<int64_t>(s.max_draft, ctx - len + 1));
    if (k <= 0 || len == 0) continue;
    State& st = seqs_[s.seq];
    // Tokens only grow, so positions below `stable` still match; past it, the rejected drafts
    // of the last proposal are where the two part.
    int64_t m = std::min<int64_t>(st.stable, len);
    const int64_t fed_n = static_cast<int64_t>(st.fed.size());
    while (m < fed_n && m < len && st.fed[m] == s.tokens[m]) ++m;
    // The last token is always fed again, for its logits.
    m = std::min(m, len - 1);
    st.fed.resize(m);
    st.stable = m;
    if (!Cover(st, len + k - 1)) continue;  // the draft's pool is full: no draft this time
    work.push_back({&s, &st, m, k});
  }
  if (work.empty()) return absl::OkStatus();

  auto fail = [&](absl::Status st) {
    // Nothing fed in a failed step can be trusted: every sequence starts over.
    for (Work& w : work) {
      w.slot->draft->clear();
      w.st->fed.clear();
      w.st->stable = 0;
    }
    return st;
  };
  // Catch up: every token but the last, in chunks that fill the step budget.
  std::vector<SeqChunk> chunks;
  for (;;) {
    chunks.clear();
    std::vector<std::pair<Work*, int64_t>> fed_now;
    int64_t used = 0;
    for (Work& w : work) {
      const int64_t rest = static_cast<int64_t>(w.slot->tokens.size()) - 1 - w.fed;
      const int64_t n = std::min(rest, budget - used);
      if (n <= 0) continue;
      chunks.push_back(
          {w.slot->tokens.subspan(w.fed, n), static_cast<int32_t>(w.fed), w.st->blocks, false});
      fed_now.emplace_back(&w, n);
      used += n;
    }
    if (chunks.empty()) break;
    if (absl::Status st = engine_->Step(chunks, &logits_); !st.ok()) return fail(st);
    for (auto [w, n] : fed_now) w->fed += n;
  }
  // Then k one-token steps, each sequence's greedy token feeding its next step.
  const int32_t vocab = engine_->model().config().n_vocab;
  std::vector<int32_t> cur(work.size());
  for (size_t i = 0; i < work.size(); ++i) cur[i] = work[i].slot->tokens.back();
  int32_t max_k = 0;
  for (const Work& w : work) max_k = std::max(max_k, w.k);
  std::vector<size_t> active;
  const absl::Time t0 = absl::Now();
  for (int32_t j = 0; j < max_k; ++j) {
    chunks.clear();
    active.clear();
    for (size_t i = 0; i < work.size(); ++i) {
      if (j >= work[i].k) continue;
      chunks.push_back({std::span<const int32_t>(&cur[i], 1), static_cast<int32_t>(work[i].fed),
                        work[i].st->blocks, true});
      active.push_back(i);
    }
    if (absl::Status st = engine_->Step(chunks, &logits_); !st.ok()) return fail(st);
    for (size_t r = 0; r < active.size(); ++r) {
      Work& w = work[active[r]];
      const float* row = logits_.data() + static_cast<int64_t>(r) * vocab;
      const int32_t next = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      w.slot->draft->push_back(next);
      ++w.fed;
      cur[active[r]] = next;
    }
  }
  last_step_seconds_ = max_k > 0 ? absl::ToDoubleSeconds(absl::Now() - t0) / max_k : 0.0;
  // What the draft's cache now holds: the sequence's tokens, then all drafts but the last.
  for (Work& w : work) {
    const std::span<const int32_t> t = w.slot->tokens;
    w.st->fed.insert(w.st->fed.end(), t.begin() + static_cast<int64_t>(w.st->fed.size()), t.end());
    w.st->fed.insert(w.st->fed.end(), w.slot->draft->begin(), w.slot->draft->end() - 1);
    w.st->stable = static_cast<int64_t>(t.size());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Model>> LoadDraftModel(const SpeculativeOptions& o,
                                                            const Engine& target) {
  ModelLoadOptions lo;
  lo.pack_weights = target.options().device == Device::kCpu;  // packing is a CPU layout
  std::unique_ptr<Model> m;
  switch (o.method) {
    case SpecMethod::kOff:
    case SpecMethod::kNgram:
      return nullptr;
    case SpecMethod::kSelf: {
      if (target.options().device != Device::kCpu) {
        // The CUDA engine uploads the file's own tensors; write the draft with `tandem quantize`.
        return absl::InvalidArgumentError(
            "--speculative self:TYPE runs on the CPU only; on a GPU give the draft as draft:PATH "
            "(tandem quantize MODEL OUT --type TYPE writes it)");
      }
      lo.matrix_type = o.self_type;
      TANDEM_ASSIGN_OR_RETURN(m, Model::Load(target.model().file().path(), lo));
      break;
    }
    case SpecMethod::kDraft:
      TANDEM_ASSIGN_OR_RETURN(m, Model::Load(o.draft_path, lo));
      break;
  }
  TANDEM_RETURN_IF_ERROR(CheckSameVocabulary(*m, target.model()));
  return std::shared_ptr<const Model>(std::move(m));
}

absl::StatusOr<std::shared_ptr<Proposer>> MakeSpecProposer(
    const SpeculativeOptions& o, const Engine& target,
    const DraftModelProposer::EngineFactory& make_engine) {
  if (o.method == SpecMethod::kOff) return nullptr;
  if (o.method == SpecMethod::kNgram) return std::shared_ptr<Proposer>(MakeProposer(o));
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<const Model> draft, LoadDraftModel(o, target));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<DraftModelProposer> p,
                          DraftModelProposer::Create(std::string(SpecMethodName(o.method)),
                                                     std::move(draft), target, make_engine));
  return std::shared_ptr<Proposer>(std::move(p));
}

}  // namespace tandem::engine
