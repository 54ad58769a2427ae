#include "engine/sampling/grammar.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/unicode.h"

namespace tandem::engine {
namespace {

// Deeper than any grammar built here nests; a guard against runaway expansion.
constexpr int kMaxNormalizeDepth = 512;

void SortUnique(std::vector<Grammar::Stack>* v) {
  std::sort(v->begin(), v->end());
  v->erase(std::unique(v->begin(), v->end()), v->end());
}

// The cache key of a state: its (sorted) stacks, each ended by a separator.
std::string StateKey(const std::vector<Grammar::Stack>& s) {
  std::string key;
  for (const Grammar::Stack& st : s) {
    for (uint32_t p : st) key.append(reinterpret_cast<const char*>(&p), sizeof(p));
    const uint32_t sep = std::numeric_limits<uint32_t>::max();
    key.append(reinterpret_cast<const char*>(&sep), sizeof(sep));
  }
  return key;
}

}  // namespace

void Grammar::Normalize(Stack s, std::vector<Stack>* out, int depth) const {
  if (depth > kMaxNormalizeDepth) return;
  while (true) {
    if (s.empty()) {
      out->push_back(std::move(s));  // the root ended: the input so far is complete
      return;
    }
    const uint32_t p = s.back();
    const Elem& e = elems_[p];
    if (e.kind == Elem::kBytes) {
      out->push_back(std::move(s));
      return;
    }
    if (e.kind == Elem::kEnd) {
      s.pop_back();  // the alternative ended; the caller's continuation is below
      continue;
    }
    // A reference: the caller continues after it, unless it was the caller's last element
    // (then the caller's frame is done: a tail call keeps right recursion flat).
    s.pop_back();
    if (elems_[p + 1].kind != Elem::kEnd) s.push_back(p + 1);
    const std::vector<uint32_t>& alts = rule_alts_[e.arg];
    for (size_t i = 0; i + 1 < alts.size(); ++i) {
      Stack t = s;
      t.push_back(alts[i]);
      Normalize(std::move(t), out, depth + 1);
    }
    if (alts.empty()) return;
    s.push_back(alts.back());
    ++depth;
    if (depth > kMaxNormalizeDepth) return;
  }
}

std::vector<Grammar::Stack> Grammar::Start() const {
  std::vector<Stack> out;
  for (uint32_t a : rule_alts_[root_]) Normalize(Stack{a}, &out, 0);
  SortUnique(&out);
  return out;
}

void Grammar::Advance(const std::vector<Stack>& in, uint8_t byte, std::vector<Stack>* out) const {
  out->clear();
  for (const Stack& s : in) {
    if (s.empty()) continue;
    const uint32_t p = s.back();
    if (!sets_[elems_[p].arg].Has(byte)) continue;
    Stack t = s;
    t.back() = p + 1;
    Normalize(std::move(t), out, 0);
  }
  if (out->size() > 1) SortUnique(out);
}

uint32_t GrammarBuilder::NewRule() {
  rules_.emplace_back();
  return static_cast<uint32_t>(rules_.size() - 1);
}

void GrammarBuilder::AddAlt(uint32_t rule, Seq alt) { rules_[rule].push_back(std::move(alt)); }

GrammarBuilder::Elem GrammarBuilder::Bytes(const ByteSet& s) {
  for (size_t i = 0; i < sets_.size(); ++i) {
    if (std::equal(std::begin(sets_[i].bits), std::end(sets_[i].bits), std::begin(s.bits))) {
      return {Elem::kBytes, static_cast<uint32_t>(i)};
    }
  }
  sets_.push_back(s);
  return {Elem::kBytes, static_cast<uint32_t>(sets_.size() - 1)};
}

GrammarBuilder::Seq GrammarBuilder::Literal(std::string_view text) {
  Seq s;
  for (char c : text) s.push_back(Byte(c));
  return s;
}

uint32_t GrammarBuilder::Repeat(const Seq& body, int min, int max) {
  // Unbounded: star ::= body star | "" (a tail reference); bounded: a chain of optionals.
  uint32_t tail;
  if (max < 0) {
    tail = NewRule();
    Seq more = body;
    more.push_back(Ref(tail));
    AddAlt(tail, std::move(more));
    AddAlt(tail, {});
  } else {
    tail = NewRule();
    AddAlt(tail, {});
    for (int i = min; i < max; ++i) {
      const uint32_t r = NewRule();
      Seq more = body;
      more.push_back(Ref(tail));
      AddAlt(r, std::move(more));
      AddAlt(r, {});
      tail = r;
    }
  }
  const uint32_t rule = NewRule();
  Seq seq;
  for (int i = 0; i < min; ++i) seq.insert(seq.end(), body.begin(), body.end());
  seq.push_back(Ref(tail));
  AddAlt(rule, std::move(seq));
  return rule;
}

uint32_t GrammarBuilder::Choice(std::vector<Seq> alts) {
  const uint32_t r = NewRule();
  for (Seq& a : alts) AddAlt(r, std::move(a));
  return r;
}

namespace {

constexpr uint32_t kMaxCodepoint = 0x10ffff;

int Utf8Length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

// [lo, hi] (one encoded length) as sequences of byte ranges: split until every code point
// between the bounds differs from them only in bytes whose whole continuation range is covered.
void SplitUtf8(uint32_t lo, uint32_t hi, std::vector<std::vector<ByteSet>>* out) {
  const int n = Utf8Length(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (uint32_t{1} << (6 * i)) - 1;
    if ((lo & ~m) == (hi & ~m)) continue;
    if ((lo & m) != 0) {
      SplitUtf8(lo, lo | m, out);
      SplitUtf8((lo | m) + 1, hi, out);
      return;
    }
    if ((hi & m) != m) {
      SplitUtf8(lo, (hi & ~m) - 1, out);
      SplitUtf8(hi & ~m, hi, out);
      return;
    }
  }
  std::string a, b;
  unicode::AppendUtf8(lo, &a);
  unicode::AppendUtf8(hi, &b);
  std::vector<ByteSet> seq;
  for (int k = 0; k < n; ++k) {
    seq.push_back(ByteSet::Range(static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k])));
  }
  out->push_back(std::move(seq));
}

}  // namespace

absl::StatusOr<uint32_t> GrammarBuilder::Codepoints(CodepointRanges ranges) {
  // Clamp, drop the surrogates, merge.
  CodepointRanges clean;
  for (auto [lo, hi] : ranges) {
    hi = std::min(hi, kMaxCodepoint);
    if (lo > hi) continue;
    if (lo < 0xd800 && hi >= 0xd800) {
      clean.push_back({lo, 0xd7ff});
      lo = 0xe000;
    } else if (lo >= 0xd800 && lo <= 0xdfff) {
      lo = 0xe000;
    }
    if (lo <= hi) clean.push_back({lo, hi});
  }
  std::sort(clean.begin(), clean.end());
  CodepointRanges merged;
  for (const auto& r : clean) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  if (merged.empty()) return absl::InvalidArgumentError("a character class matches nothing");
  ByteSet ascii;
  std::vector<std::vector<ByteSet>> seqs;
  for (auto [lo, hi] : merged) {
    for (uint32_t bound : {0x7fu, 0x7ffu, 0xffffu, kMaxCodepoint}) {
      if (lo > hi) break;
      if (lo > bound) continue;
      const uint32_t end = std::min(hi, bound);
      if (bound == 0x7f) {
        ascii.AddRange(static_cast<uint8_t>(lo), static_cast<uint8_t>(end));
      } else {
        SplitUtf8(lo, end, &seqs);
      }
      lo = end + 1;
    }
  }
  const uint32_t r = NewRule();
  if (std::any_of(std::begin(ascii.bits), std::end(ascii.bits), [](uint64_t w) { return w; })) {
    AddAlt(r, {Bytes(ascii)});
  }
  for (const std::vector<ByteSet>& seq : seqs) {
    Seq alt;
    for (const ByteSet& b : seq) alt.push_back(Bytes(b));
    AddAlt(r, std::move(alt));
  }
  return r;
}

absl::StatusOr<Grammar> GrammarBuilder::Build(uint32_t root) && {
  const size_t n = rules_.size();
  if (root >= n) return absl::InvalidArgumentError("grammar root is not a rule");
  for (size_t r = 0; r < n; ++r) {
    if (rules_[r].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("grammar rule ", r, " has no alternative"));
    }
    for (const Seq& alt : rules_[r]) {
      for (const Elem& e : alt) {
        if (e.kind == Elem::kRule && e.arg >= n) {
          return absl::InvalidArgumentError(absl::StrCat("grammar rule ", r, " refers to ", e.arg,
                                                         ", which does not exist"));
        }
      }
    }
  }
  // Left recursion: a rule reachable from itself through references preceded only by rules
  // that can match nothing. Nullable rules first (a fixpoint), then a cycle search.
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const Seq& alt : rules_[r]) {
        const bool all = std::all_of(alt.begin(), alt.end(), [&](const Elem& e) {
          return e.kind == Elem::kRule && nullable[e.arg];
        });
        if (all) {
          nullable[r] = changed = true;
          break;
        }
      }
    }
  }
  std::vector<std::vector<uint32_t>> first(n);
  for (size_t r = 0; r < n; ++r) {
    for (const Seq& alt : rules_[r]) {
      for (const Elem& e : alt) {
        if (e.kind != Elem::kRule) break;
        first[r].push_back(e.arg);
        if (!nullable[e.arg]) break;
      }
    }
  }
  std::vector<int> color(n, 0);  // 0 unseen, 1 on the path, 2 done
  std::vector<std::pair<uint32_t, size_t>> path;
  for (uint32_t start = 0; start < n; ++start) {
    if (color[start] != 0) continue;
    path.push_back({start, 0});
    color[start] = 1;
    while (!path.empty()) {
      auto& [r, i] = path.back();
      if (i == first[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t next = first[r][i++];
      if (color[next] == 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("grammar rule ", next, " is left-recursive"));
      }
      if (color[next] == 0) {
        color[next] = 1;
        path.push_back({next, 0});
      }
    }
  }

  Grammar g;
  g.sets_ = std::move(sets_);
  g.root_ = root;
  g.rule_alts_.resize(n);
  for (size_t r = 0; r < n; ++r) {
    for (const Seq& alt : rules_[r]) {
      g.rule_alts_[r].push_back(static_cast<uint32_t>(g.elems_.size()));
      g.elems_.insert(g.elems_.end(), alt.begin(), alt.end());
      g.elems_.push_back({Elem::kEnd, 0});
    }
  }
  return g;
}

VocabTrie::VocabTrie(const Tokenizer& tok) : vocab_(tok.vocab_size()) {
  pieces_.resize(static_cast<size_t>(vocab_));
  is_eog_.assign(static_cast<size_t>(vocab_), false);
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < vocab_; ++id) {
    if (tok.IsEog(id)) {
      eog_.push_back(id);
      is_eog_[static_cast<size_t>(id)] = true;
      continue;
    }
    pieces_[static_cast<size_t>(id)] = tok.TokenToPiece(id, /*special=*/false);
    if (!pieces_[static_cast<size_t>(id)].empty()) ids.push_back(id);
  }
  // Sorted by bytes, every subtree's tokens are contiguous: the trie is laid out level by
  // level, each node's children next to one another, from ranges of this order.
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return pieces_[static_cast<size_t>(a)] < pieces_[static_cast<size_t>(b)];
  });
  struct Range {
    uint32_t node;
    size_t lo, hi, depth;
  };
  nodes_.push_back(Node{});
  std::vector<Range> level = {{0, 0, ids.size(), 0}};
  while (!level.empty()) {
    std::vector<Range> next;
    for (const Range& r : level) {
      size_t i = r.lo;
      // Tokens that end at this node (their piece is exactly depth bytes long).
      Node& self = nodes_[r.node];
      self.first_token = static_cast<uint32_t>(token_ids_.size());
      while (i < r.hi && pieces_[static_cast<size_t>(ids[i])].size() == r.depth) {
        token_ids_.push_back(ids[i++]);
      }
      nodes_[r.node].n_tokens = static_cast<uint32_t>(token_ids_.size()) -
                                nodes_[r.node].first_token;
      nodes_[r.node].first_child = static_cast<uint32_t>(nodes_.size());
      while (i < r.hi) {
        const uint8_t b =
            static_cast<uint8_t>(pieces_[static_cast<size_t>(ids[i])][r.depth]);
        size_t j = i;
        auto byte_at = [&](size_t k) {
          return static_cast<uint8_t>(pieces_[static_cast<size_t>(ids[k])][r.depth]);
        };
        while (j < r.hi && byte_at(j) == b) ++j;
        Node child;
        child.byte = b;
        nodes_.push_back(child);
        next.push_back({static_cast<uint32_t>(nodes_.size() - 1), i, j, r.depth + 1});
        i = j;
      }
      nodes_[r.node].n_children =
          static_cast<uint32_t>(nodes_.size()) - nodes_[r.node].first_child;
    }
    level = std::move(next);
  }
}

std::shared_ptr<const VocabTrie> VocabTrie::Get(const Tokenizer& tok) {
  // One trie per live tokenizer, keyed by address and checked against its vocabulary size (a
  // later tokenizer at a freed one's address gets a trie of its own).
  static absl::Mutex mu(absl::kConstInit);
  static auto* cache ABSL_PT_GUARDED_BY(mu) =
      new std::map<const Tokenizer*, std::weak_ptr<const VocabTrie>>();
  absl::MutexLock lock(&mu);
  for (auto it = cache->begin(); it != cache->end();) {
    it = it->second.expired() ? cache->erase(it) : std::next(it);
  }
  if (auto it = cache->find(&tok); it != cache->end()) {
    std::shared_ptr<const VocabTrie> t = it->second.lock();
    if (t != nullptr && t->vocab() == tok.vocab_size()) return t;
  }
  auto t = std::make_shared<const VocabTrie>(tok);
  (*cache)[&tok] = t;
  return t;
}

absl::StatusOr<std::shared_ptr<const TokenConstraint>> TokenConstraint::Create(
    Grammar grammar, std::shared_ptr<const VocabTrie> trie) {
  if (trie == nullptr) return absl::InvalidArgumentError("a constraint needs a vocabulary");
  if (grammar.Start().empty()) {
    return absl::InvalidArgumentError("the grammar matches nothing");
  }
  return std::shared_ptr<const TokenConstraint>(
      new TokenConstraint(std::move(grammar), std::move(trie)));
}

int32_t TokenConstraint::Intern(std::vector<Grammar::Stack> s) const {
  std::string key = StateKey(s);
  if (auto it = dfa_ids_.find(key); it != dfa_ids_.end()) return it->second;
  const auto id = static_cast<int32_t>(dfa_states_.size());
  dfa_states_.push_back(std::move(s));
  dfa_ids_.emplace(std::move(key), id);
  return id;
}

int32_t TokenConstraint::Next(int32_t state, uint8_t byte) const {
  const uint64_t key = static_cast<uint64_t>(state) << 8 | byte;
  if (auto it = dfa_next_.find(key); it != dfa_next_.end()) return it->second;
  std::vector<Grammar::Stack> next;
  grammar_.Advance(dfa_states_[static_cast<size_t>(state)], byte, &next);
  const int32_t id = next.empty() ? -1 : Intern(std::move(next));
  dfa_next_.emplace(key, id);
  return id;
}

std::vector<uint64_t> TokenConstraint::ComputeMask(const std::vector<Grammar::Stack>& s) const {
  const VocabTrie& t = *trie_;
  std::vector<uint64_t> mask((static_cast<size_t>(t.vocab()) + 63) / 64, 0);
  auto allow = [&](int32_t id) { mask[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63); };
  if (Grammar::Complete(s)) {
    for (int32_t id : t.eog()) allow(id);
  }
  if (!Grammar::CanContinue(s)) return mask;
  absl::MutexLock lock(&dfa_mu_);
  if (dfa_states_.size() > kMaxDfaStates) {
    dfa_states_.clear();
    dfa_ids_.clear();
    dfa_next_.clear();
  }
  // Depth-first over the trie, each frame a node and the state after its bytes.
  std::vector<std::pair<uint32_t, int32_t>> todo = {{0, Intern(s)}};
  const std::vector<VocabTrie::Node>& nodes = t.nodes();
  while (!todo.empty()) {
    const auto [node, state] = todo.back();
    todo.pop_back();
    const VocabTrie::Node& n = nodes[node];
    for (uint32_t c = n.first_child; c < n.first_child + n.n_children; ++c) {
      const int32_t next = Next(state, nodes[c].byte);
      if (next < 0) continue;
      for (int32_t id : t.TokensAt(nodes[c])) allow(id);
      if (nodes[c].n_children > 0) todo.push_back({c, next});
    }
  }
  return mask;
}

std::shared_ptr<const std::vector<uint64_t>> TokenConstraint::Mask(
    const std::vector<Grammar::Stack>& s) const {
  const std::string key = StateKey(s);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      ++cached_;
      return it->second->second;
    }
  }
  // Computed outside the lock: two sequences may compute the same mask once each.
  auto mask = std::make_shared<const std::vector<uint64_t>>(ComputeMask(s));
  absl::MutexLock lock(&mu_);
  ++computed_;
  if (index_.contains(key)) return mask;
  lru_.emplace_front(key, mask);
  index_[key] = lru_.begin();
  if (lru_.size() > kMaxCached) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return mask;
}

int64_t TokenConstraint::masks_computed() const {
  absl::MutexLock lock(&mu_);
  return computed_;
}

int64_t TokenConstraint::masks_cached() const {
  absl::MutexLock lock(&mu_);
  return cached_;
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const TokenConstraint> c)
    : c_(std::move(c)), state_(c_->grammar().Start()) {}

bool GrammarMatcher::Allowed(int32_t token) const {
  if (finished_ || token < 0 || token >= c_->trie().vocab()) return false;
  if (c_->trie().is_eog(token)) return complete();
  const std::string& piece = c_->trie().piece(token);
  if (piece.empty()) return false;
  std::vector<Grammar::Stack> cur = state_, next;
  for (char ch : piece) {
    c_->grammar().Advance(cur, static_cast<uint8_t>(ch), &next);
    if (next.empty()) return false;
    cur.swap(next);
  }
  return true;
}

absl::Status GrammarMatcher::Accept(int32_t token) {
  if (!Allowed(token)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ", token, " is not allowed by the grammar here"));
  }
  if (c_->trie().is_eog(token)) {
    finished_ = true;
    return absl::OkStatus();
  }
  std::vector<Grammar::Stack> next;
  for (char ch : c_->trie().piece(token)) {
    c_->grammar().Advance(state_, static_cast<uint8_t>(ch), &next);
    state_.swap(next);
  }
  return absl::OkStatus();
}

void GrammarMatcher::Apply(std::span<float> logits) const {
  if (finished_) return;
  const std::shared_ptr<const std::vector<uint64_t>> mask = c_->Mask(state_);
  const size_t n = std::min(logits.size(), mask->size() * 64);
  for (size_t i = 0; i < n; ++i) {
    if (!(((*mask)[i >> 6] >> (i & 63)) & 1)) logits[i] = -std::numeric_limits<float>::infinity();
  }
  for (size_t i = n; i < logits.size(); ++i) logits[i] = -std::numeric_limits<float>::infinity();
}

}  // namespace tandem::engine
