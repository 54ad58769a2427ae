// Constrained decoding: a context-free grammar over bytes, a matcher that follows one
// sequence through it, and the token masks that keep the sampler inside it.
//
// Grammar: rules of alternatives, each a sequence of byte sets and references to rules (no left
// recursion; the builders in json_schema.h never make any). Matching follows llama.cpp's
// grammar sampler: the state is a set of stacks of positions, each stack's top a byte set the
// next byte must be in; a reference in tail position replaces its caller's frame, so right
// recursion (repetition) keeps the stacks short.
//
// TokenConstraint: a grammar against one tokenizer. The mask of a state (which tokens may come
// next) is found by walking a trie of the vocabulary's bytes with the state, pruning every
// branch the grammar refuses (over a DFA of the grammar's states, built as the walks meet
// them), and is cached by state (bounded, shared by every sequence that
// uses the constraint), since JSON output returns to the same few states again and again. End-
// of-generation tokens are allowed exactly when the grammar is complete; once nothing else can
// follow, they are all that is allowed.
//
// Threading: Grammar and TokenConstraint are immutable apart from the mask cache, which takes
// a mutex; a GrammarMatcher belongs to one sequence.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::engine {

// 256 bits: the bytes an element accepts.
struct ByteSet {
  uint64_t bits[4] = {0, 0, 0, 0};
  void Add(uint8_t b) { bits[b >> 6] |= uint64_t{1} << (b & 63); }
  void AddRange(uint8_t lo, uint8_t hi) {
    for (int b = lo; b <= hi; ++b) Add(static_cast<uint8_t>(b));
  }
  bool Has(uint8_t b) const { return (bits[b >> 6] >> (b & 63)) & 1; }
  static ByteSet Of(uint8_t b) {
    ByteSet s;
    s.Add(b);
    return s;
  }
  static ByteSet Range(uint8_t lo, uint8_t hi) {
    ByteSet s;
    s.AddRange(lo, hi);
    return s;
  }
};

class Grammar {
 public:
  struct Elem {
    enum Kind : uint8_t { kBytes, kRule, kEnd } kind = kEnd;
    uint32_t arg = 0;  // kBytes: index into byte sets; kRule: rule id
  };
  using Stack = std::vector<uint32_t>;  // positions in elems(), the top last

  // The root rule's alternatives, each normalised: the starting state.
  std::vector<Stack> Start() const;
  // The state after `byte`: every stack whose top accepts it, advanced and normalised (stacks
  // that end the root become the empty stack). Empty when no stack accepts the byte.
  void Advance(const std::vector<Stack>& in, uint8_t byte, std::vector<Stack>* out) const;
  static bool Complete(const std::vector<Stack>& s) {
    for (const Stack& st : s) {
      if (st.empty()) return true;
    }
    return false;
  }
  // Whether any stack can take another byte.
  static bool CanContinue(const std::vector<Stack>& s) {
    for (const Stack& st : s) {
      if (!st.empty()) return true;
    }
    return false;
  }

  size_t rules() const { return rule_alts_.size(); }
  size_t size() const { return elems_.size(); }
  const Elem& elem(uint32_t pos) const { return elems_[pos]; }
  const ByteSet& bytes(uint32_t i) const { return sets_[i]; }

 private:
  friend class GrammarBuilder;
  void Normalize(Stack s, std::vector<Stack>* out, int depth) const;

  std::vector<Elem> elems_;                   // every alternative, each ended by kEnd
  std::vector<std::vector<uint32_t>> rule_alts_;  // rule -> start positions of its alternatives
  std::vector<ByteSet> sets_;
  uint32_t root_ = 0;
};

// Builds a Grammar. Rules may refer to rules made later (their alternatives added afterwards),
// which is how recursive ones are written.
class GrammarBuilder {
 public:
  using Elem = Grammar::Elem;
  using Seq = std::vector<Elem>;

  uint32_t NewRule();
  size_t rules() const { return rules_.size(); }
  void AddAlt(uint32_t rule, Seq alt);
  Elem Bytes(const ByteSet& s);
  Elem Byte(char c) { return Bytes(ByteSet::Of(static_cast<uint8_t>(c))); }
  static Elem Ref(uint32_t rule) { return {Elem::kRule, rule}; }
  Seq Literal(std::string_view text);
  // A rule matching `body` repeated between min and max times (max < 0: unbounded).
  uint32_t Repeat(const Seq& body, int min, int max);
  // A rule matching any one of `alts`.
  uint32_t Choice(std::vector<Seq> alts);
  // A rule matching one character, UTF-8 encoded, whose code point lies in one of `ranges`
  // (inclusive bounds, in any order; surrogates and code points past U+10FFFF never match).
  // INVALID_ARGUMENT when that leaves nothing.
  using CodepointRanges = std::vector<std::pair<uint32_t, uint32_t>>;
  absl::StatusOr<uint32_t> Codepoints(CodepointRanges ranges);
  // Fails when a rule has no alternative or a rule refers to itself first (left recursion).
  absl::StatusOr<Grammar> Build(uint32_t root) &&;

 private:
  std::vector<std::vector<Seq>> rules_;
  std::vector<ByteSet> sets_;
};

// The vocabulary as a byte trie (TokenToPiece without special rendering), and its end-of-
// generation tokens. One per tokenizer; build it once (Get caches by tokenizer).
class VocabTrie {
 public:
  static std::shared_ptr<const VocabTrie> Get(const Tokenizer& tok);
  explicit VocabTrie(const Tokenizer& tok);

  struct Node {
    uint32_t first_child = 0;  // children are nodes [first_child, first_child + n_children)
    uint32_t n_children = 0;
    uint32_t first_token = 0;  // tokens ending here: token_ids_[first_token, + n_tokens)
    uint32_t n_tokens = 0;
    uint8_t byte = 0;  // the edge from the parent
  };
  const std::vector<Node>& nodes() const { return nodes_; }
  std::span<const int32_t> TokensAt(const Node& n) const {
    return {token_ids_.data() + n.first_token, n.n_tokens};
  }
  const std::vector<int32_t>& eog() const { return eog_; }
  bool is_eog(int32_t id) const { return is_eog_[static_cast<size_t>(id)]; }
  int32_t vocab() const { return vocab_; }
  const std::string& piece(int32_t id) const { return pieces_[static_cast<size_t>(id)]; }

 private:
  std::vector<Node> nodes_;  // nodes_[0] is the root; children stored contiguously (BFS)
  std::vector<int32_t> token_ids_;
  std::vector<int32_t> eog_;
  std::vector<bool> is_eog_;
  std::vector<std::string> pieces_;
  int32_t vocab_ = 0;
};

// A grammar against a tokenizer's vocabulary, with its mask cache.
class TokenConstraint {
 public:
  static absl::StatusOr<std::shared_ptr<const TokenConstraint>> Create(
      Grammar grammar, std::shared_ptr<const VocabTrie> trie);
  const Grammar& grammar() const { return grammar_; }
  const VocabTrie& trie() const { return *trie_; }
  // The tokens allowed in state `s`, one bit per id (cached).
  std::shared_ptr<const std::vector<uint64_t>> Mask(const std::vector<Grammar::Stack>& s) const;
  // Masks computed (cache misses) and served from the cache, since creation.
  int64_t masks_computed() const;
  int64_t masks_cached() const;

 private:
  TokenConstraint(Grammar g, std::shared_ptr<const VocabTrie> trie)
      : grammar_(std::move(g)), trie_(std::move(trie)) {}
  std::vector<uint64_t> ComputeMask(const std::vector<Grammar::Stack>& s) const;
  // The states met so far, interned, and their byte transitions: a DFA built as masks need it,
  // so walking the trie costs a table lookup per node. Reset when it grows past kMaxDfaStates.
  int32_t Intern(std::vector<Grammar::Stack> s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(dfa_mu_);
  int32_t Next(int32_t state, uint8_t byte) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(dfa_mu_);

  Grammar grammar_;
  std::shared_ptr<const VocabTrie> trie_;
  static constexpr size_t kMaxDfaStates = 1 << 17;
  mutable absl::Mutex dfa_mu_;
  mutable std::vector<std::vector<Grammar::Stack>> dfa_states_ ABSL_GUARDED_BY(dfa_mu_);
  mutable absl::flat_hash_map<std::string, int32_t> dfa_ids_ ABSL_GUARDED_BY(dfa_mu_);
  // (state << 8 | byte) -> the next state, -1 when the byte is refused.
  mutable absl::flat_hash_map<uint64_t, int32_t> dfa_next_ ABSL_GUARDED_BY(dfa_mu_);
  static constexpr size_t kMaxCached = 1024;
  mutable absl::Mutex mu_;
  using Entry = std::pair<std::string, std::shared_ptr<const std::vector<uint64_t>>>;
  mutable std::list<Entry> lru_ ABSL_GUARDED_BY(mu_);  // most recent first
  mutable absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_
      ABSL_GUARDED_BY(mu_);
  mutable int64_t computed_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int64_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

// One sequence's position in a constraint.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const TokenConstraint> c);
  // Moves past `token`. INVALID_ARGUMENT when the grammar does not allow it (then nothing
  // changes); an end-of-generation token is allowed once the grammar is complete.
  absl::Status Accept(int32_t token);
  // Sets the logits of every token the grammar does not allow next to -inf.
  void Apply(std::span<float> logits) const;
  bool Allowed(int32_t token) const;
  bool complete() const { return Grammar::Complete(state_); }
  bool finished() const { return finished_; }  // an end-of-generation token was accepted
  const TokenConstraint& constraint() const { return *c_; }

 private:
  std::shared_ptr<const TokenConstraint> c_;
  std::vector<Grammar::Stack> state_;
  bool finished_ = false;
};

}  // namespace tandem::engine
