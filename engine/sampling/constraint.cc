#include "engine/sampling/constraint.h"

#include <list>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/sampling/grammar_text.h"
#include "engine/sampling/json_schema.h"

namespace tandem::engine {
namespace {

constexpr size_t kMaxCompiled = 32;

struct Compiled {
  Constraint::Kind kind;
  std::string text;
  const Tokenizer* tok;
  std::shared_ptr<const TokenConstraint> constraint;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const TokenConstraint>> CompileConstraint(const Constraint& c,
                                                                         const Tokenizer& tok) {
  if (c.kind == Constraint::Kind::kNone) return nullptr;
  static absl::Mutex mu(absl::kConstInit);
  static auto* cache ABSL_PT_GUARDED_BY(mu) = new std::list<Compiled>();  // most recent first
  {
    absl::MutexLock lock(&mu);
    for (auto it = cache->begin(); it != cache->end(); ++it) {
      if (it->kind == c.kind && it->tok == &tok && it->text == c.text &&
          it->constraint->trie().vocab() == tok.vocab_size()) {
        cache->splice(cache->begin(), *cache, it);
        return cache->front().constraint;
      }
    }
  }
  absl::StatusOr<Grammar> g = [&]() -> absl::StatusOr<Grammar> {
    switch (c.kind) {
      case Constraint::Kind::kJsonObject: return JsonObjectGrammar();
      case Constraint::Kind::kJsonSchema: return JsonSchemaGrammarFromText(c.text);
      case Constraint::Kind::kGrammar: return GbnfGrammar(c.text);
      case Constraint::Kind::kRegex: return RegexGrammar(c.text);
      case Constraint::Kind::kNone: break;
    }
    return absl::InternalError("no grammar for this constraint kind");
  }();
  if (!g.ok()) return g.status();
  absl::StatusOr<std::shared_ptr<const TokenConstraint>> tc =
      TokenConstraint::Create(std::move(*g), VocabTrie::Get(tok));
  if (!tc.ok()) return tc.status();
  absl::MutexLock lock(&mu);
  cache->push_front({c.kind, c.text, &tok, *tc});
  if (cache->size() > kMaxCompiled) cache->pop_back();
  return *tc;
}

absl::StatusOr<std::unique_ptr<Sampler>> MakeSampler(const SamplingParams& p,
                                                     const Tokenizer& tok,
                                                     std::span<const int32_t> prompt) {
  auto s = std::make_unique<Sampler>(p);
  absl::StatusOr<std::shared_ptr<const TokenConstraint>> c = CompileConstraint(p.constraint, tok);
  if (!c.ok()) return c.status();
  if (*c == nullptr) return s;
  const int32_t n = p.constraint.generated;
  if (n < 0 || static_cast<size_t>(n) > prompt.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "constraint.generated must be in [0, ", prompt.size(), "] (the prompt's length), got ", n));
  }
  auto m = std::make_unique<GrammarMatcher>(*c);
  for (int32_t t : prompt.subspan(prompt.size() - static_cast<size_t>(n))) {
    if (absl::Status st = m->Accept(t); !st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("constraint.generated: the output so far breaks the constraint (",
                       st.message(), ")"));
    }
  }
  s->Constrain(std::move(m));
  return s;
}

}  // namespace tandem::engine
