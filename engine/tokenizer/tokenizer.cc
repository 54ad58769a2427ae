// Vocabulary loading shared by both tokenizer families, special-token partitioning, Decode and
// StreamingDecoder. The rules reproduce llama.cpp's llama_vocab (src/llama-vocab.cpp): which
// defaults apply when a key is absent, which tokens get extra attributes because of their text,
// and how detokenize strips and cleans spaces.
#include "engine/tokenizer/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "engine/tokenizer/tokenizer_impl.h"
#include "engine/tokenizer/unicode.h"

namespace tandem::engine {
namespace {

using internal::kAttrByte;
using internal::kAttrControl;
using internal::kAttrLstrip;
using internal::kAttrNormal;
using internal::kAttrRstrip;
using internal::kAttrUnknown;
using internal::kAttrUnused;
using internal::kAttrUserDefined;

constexpr char kKeyModel[] = "tokenizer.ggml.model";
constexpr char kKeyPre[] = "tokenizer.ggml.pre";
constexpr char kKeyTokens[] = "tokenizer.ggml.tokens";
constexpr char kKeyScores[] = "tokenizer.ggml.scores";
constexpr char kKeyTokenType[] = "tokenizer.ggml.token_type";
constexpr char kKeyAddBos[] = "tokenizer.ggml.add_bos_token";
constexpr char kKeyAddEos[] = "tokenizer.ggml.add_eos_token";
constexpr char kKeyAddSpacePrefix[] = "tokenizer.ggml.add_space_prefix";

// C isspace() in the "C" locale, which llama.cpp's lstrip/rstrip use.
bool IsCSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

uint16_t AttrFromTokenType(int64_t type) {
  switch (type) {
    case 1:
      return kAttrNormal;
    case 2:
      return kAttrUnknown;
    case 3:
      return kAttrControl;
    case 4:
      return kAttrUserDefined;
    case 5:
      return kAttrUnused;
    case 6:
      return kAttrByte;
    default:
      return 0;  // undefined
  }
}

TokenAttr PublicAttr(uint16_t flags) {
  if (flags & kAttrControl) return TokenAttr::kControl;
  if (flags & kAttrUserDefined) return TokenAttr::kUserDefined;
  if (flags & kAttrUnknown) return TokenAttr::kUnknown;
  if (flags & kAttrByte) return TokenAttr::kByte;
  if (flags & kAttrUnused) return TokenAttr::kUnused;
  if (flags & kAttrNormal) return TokenAttr::kNormal;
  return TokenAttr::kUndefined;
}

// Token texts llama.cpp treats as markers when the file does not name them by id.
constexpr std::string_view kEotTexts[] = {
    "<|eot_id|>",        "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>",   "<EOT>",      "_<EOT>",  "[EOT]",         "<｜end▁of▁sentence｜>",
    "<end_of_utterance>"};
constexpr std::string_view kEomTexts[] = {"<|eom_id|>"};
constexpr std::string_view kFimPreTexts[] = {"<|fim_prefix|>",  "<fim-prefix>", "<fim_prefix>",
                                             "<｜fim▁begin｜>", "<PRE>",        "▁<PRE>",
                                             "<|code_prefix|>", "<|prefix|>"};
constexpr std::string_view kFimSufTexts[] = {"<|fim_suffix|>",  "<fim-suffix>", "<fim_suffix>",
                                             "<｜fim▁hole｜>",  "<SUF>",        "▁<SUF>",
                                             "<|code_suffix|>", "<|suffix|>"};
constexpr std::string_view kFimMidTexts[] = {"<|fim_middle|>",  "<fim-middle>", "<fim_middle>",
                                             "<｜fim▁end｜>",   "<MID>",        "▁<MID>",
                                             "<|code_middle|>", "<|middle|>"};
constexpr std::string_view kFimPadTexts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                             "[PAD]"};
constexpr std::string_view kFimRepTexts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                             "<REPO>", "<reponame>"};
constexpr std::string_view kFimSepTexts[] = {"<|file_sep|>"};
constexpr std::string_view kEogTexts[] = {"<|eot_id|>",
                                          "<|im_end|>",
                                          "<|end|>",
                                          "<|return|>",
                                          "<|call|>",
                                          "<|flush|>",
                                          "<|calls|>",
                                          "<end_of_turn>",
                                          "<|endoftext|>",
                                          "</s>",
                                          "<|eom_id|>",
                                          "<EOT>",
                                          "_<EOT>",
                                          "[EOT]",
                                          "[EOS]",
                                          "<|end_of_text|>",
                                          "<end_of_utterance>",
                                          "<eos>",
                                          "<turn|>",
                                          "<|tool_response>",
                                          "<｜end▁of▁sentence｜>",
                                          "[e~["};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const gguf::GgufFile& file) {
  if (file.Find(kKeyModel) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("no tokenizer in ", file.path(), ": missing ", kKeyModel));
  }
  TANDEM_ASSIGN_OR_RETURN(std::string_view model, file.GetString(kKeyModel));
  TANDEM_ASSIGN_OR_RETURN(std::string_view pre, file.GetStringOr(kKeyPre, ""));
  if (model == "llama") {
    auto tok = std::make_unique<internal::SpmTokenizer>();
    TANDEM_RETURN_IF_ERROR(tok->Load(file));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }
  if (model == "gpt2") {
    std::optional<PreTokenizerInfo> info = LookupPreTokenizer(pre);
    if (!info) {
      return absl::UnimplementedError(absl::StrCat("tokenizer pre-tokenizer '",
                                                   internal::AbslView(pre), "' (", kKeyPre,
                                                   ") is not implemented in tandem"));
    }
    auto tok = std::make_unique<internal::BpeTokenizer>(*info);
    TANDEM_RETURN_IF_ERROR(tok->Load(file));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }
  if (model == "gemma4") {
    auto tok = std::make_unique<internal::BpeTokenizer>(Gemma4PreTokenizer());
    TANDEM_RETURN_IF_ERROR(tok->Load(file));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }
  return absl::UnimplementedError(absl::StrCat("tokenizer model '", internal::AbslView(model),
                                               "' (", kKeyModel, ") is not implemented in tandem"));
}

bool Tokenizer::IsEog(int32_t id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool special) const {
  std::string text;
  bool remove_space = add_space_prefix_;
  for (const int32_t id : ids) {
    std::string piece = TokenToPiece(id, special);
    size_t skip = (remove_space && !piece.empty() && piece[0] == ' ') ? 1 : 0;
    text.append(piece, skip);
    remove_space = false;
  }
  if (!clean_spaces_ || text.empty()) return text;

  // llama.cpp's three in-place clean-up passes, kept index for index (pass 2 even reads the
  // NUL it writes), since their interplay decides the exact output.
  const size_t total1 = text.size();
  size_t total = 1;
  for (size_t i = 1; i < total1; ++i) {  // " ?", " !", " .", " ," lose the space
    const char x = text[i];
    if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) --total;
    text[total++] = x;
  }
  const size_t total2 = total;
  total = 1;
  for (size_t i = 1; i < total2; ++i) {  // " ' " loses both spaces
    const char x = text[i];
    if (x == '\'' && i + 1 < total2 && text[i - 1] == ' ' && text[i + 1] == ' ') {
      --total;
      text[++i] = '\0';
    }
    text[total++] = x;
  }
  const size_t total3 = total;
  total = 1;
  for (size_t i = 1; i < total3; ++i) {  // " 's", " 'm", " 're", " 've" lose the space
    const char x = text[i];
    if (text[i - 1] == ' ' && x == '\'' && i + 1 < total3) {
      const char x1 = text[i + 1];
      if (x1 == 's' || x1 == 'm') {
        --total;
      } else if (x1 != 't' && x1 != 'd' && i + 2 < total3) {
        const char x2 = text[i + 2];
        if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) --total;
      }
    }
    text[total++] = x;
  }
  text.resize(total);
  return text;
}

namespace internal {

void AppendEscapedSpaces(std::string_view text, std::string* out) {
  for (const char c : text) {
    if (c == ' ') {
      out->append(kSpaceMarker);
    } else {
      out->push_back(c);
    }
  }
}

std::string UnescapeSpaces(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text.substr(i, kSpaceMarker.size()) == kSpaceMarker) {
      out.push_back(' ');
      i += kSpaceMarker.size();
    } else {
      out.push_back(text[i++]);
    }
  }
  return out;
}

std::string VocabTokenizer::TokenToPiece(int32_t id, bool special) const {
  if (id < 0 || static_cast<size_t>(id) >= piece_cache_.size()) return {};
  if (!special && (flags_[id] & (kAttrUnknown | kAttrControl))) return {};
  return piece_cache_[id];
}

uint8_t VocabTokenizer::ByteOfToken(int32_t id) const {
  const std::string& t = pieces_[id];
  uint8_t v = 0;
  for (size_t i = 3; i < t.size() && i < 5; ++i) {  // strtol(text.substr(3, 2), 16)
    const char c = t[i];
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else {
      break;
    }
    v = static_cast<uint8_t>(v * 16 + d);
  }
  return v;
}

absl::Status VocabTokenizer::LoadVocab(const gguf::GgufFile& file, const VocabDefaults& defaults) {
  add_space_prefix_ = defaults.add_space_prefix;
  clean_spaces_ = defaults.clean_spaces;
  TANDEM_ASSIGN_OR_RETURN(add_space_prefix_, file.GetBoolOr(kKeyAddSpacePrefix, add_space_prefix_));

  if (file.Find(kKeyTokens) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("missing ", kKeyTokens));
  }
  TANDEM_ASSIGN_OR_RETURN(std::span<const std::string_view> tokens,
                          file.GetStringArray(kKeyTokens));
  if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(kKeyTokens, " is empty"));
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(kKeyTokens, " is too large"));
  }
  const size_t n = tokens.size();

  scores_.assign(n, 0.0f);
  if (file.Find(kKeyScores) != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> scores, file.GetF32Array(kKeyScores));
    if (scores.size() < n) {
      return absl::InvalidArgumentError(
          absl::StrCat(kKeyScores, " has ", scores.size(), " entries for ", n, " tokens"));
    }
    std::copy_n(scores.begin(), n, scores_.begin());
  }
  flags_.assign(n, kAttrNormal);
  if (file.Find(kKeyTokenType) != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<int64_t> types, file.GetIntArray(kKeyTokenType));
    if (types.size() < n) {
      return absl::InvalidArgumentError(
          absl::StrCat(kKeyTokenType, " has ", types.size(), " entries for ", n, " tokens"));
    }
    for (size_t i = 0; i < n; ++i) flags_[i] = AttrFromTokenType(types[i]);
  }

  pieces_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    pieces_[i] = tokens[i].empty() ? absl::StrCat("[EMPTY_", i, "]") : std::string(tokens[i]);
  }
  // pieces_ is final from here on: the map views into its strings.
  token_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto [it, inserted] = token_to_id_.emplace(pieces_[i], static_cast<int32_t>(i));
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(kKeyTokens, " has token '", pieces_[i],
                                                     "' twice (ids ", it->second, " and ", i, ")"));
    }
  }

  // Special token ids: the family default unless the file names one inside the vocabulary (an
  // out-of-range id in the file is ignored, as llama.cpp does with a warning).
  const int32_t n_tokens = static_cast<int32_t>(n);
  auto in_vocab = [&](int32_t id) { return id >= 0 && id < n_tokens ? id : -1; };
  int32_t bos = in_vocab(defaults.bos), eos = in_vocab(defaults.eos), unk = in_vocab(defaults.unk);
  int32_t eot = -1, eom = -1, sep = -1, pad = -1, mask = -1;
  int32_t fim_pre = -1, fim_suf = -1, fim_mid = -1, fim_pad = -1, fim_rep = -1, fim_sep = -1;
  const std::pair<std::string_view, int32_t*> id_keys[] = {
      {"tokenizer.ggml.bos_token_id", &bos},         {"tokenizer.ggml.eos_token_id", &eos},
      {"tokenizer.ggml.eot_token_id", &eot},         {"tokenizer.ggml.eom_token_id", &eom},
      {"tokenizer.ggml.unknown_token_id", &unk},     {"tokenizer.ggml.seperator_token_id", &sep},
      {"tokenizer.ggml.padding_token_id", &pad},     {"tokenizer.ggml.mask_token_id", &mask},
      {"tokenizer.ggml.fim_pre_token_id", &fim_pre}, {"tokenizer.ggml.fim_suf_token_id", &fim_suf},
      {"tokenizer.ggml.fim_mid_token_id", &fim_mid}, {"tokenizer.ggml.fim_pad_token_id", &fim_pad},
      {"tokenizer.ggml.fim_rep_token_id", &fim_rep}, {"tokenizer.ggml.fim_sep_token_id", &fim_sep},
      {"tokenizer.ggml.prefix_token_id", &fim_pre},  // deprecated spellings
      {"tokenizer.ggml.suffix_token_id", &fim_suf},  {"tokenizer.ggml.middle_token_id", &fim_mid},
  };
  for (const auto& [key, id] : id_keys) {
    if (file.Find(key) == nullptr) continue;
    TANDEM_ASSIGN_OR_RETURN(int64_t v, file.GetInt(key));
    if (v >= 0 && v < n_tokens) *id = static_cast<int32_t>(v);
  }
  TANDEM_ASSIGN_OR_RETURN(add_bos_, file.GetBoolOr(kKeyAddBos, defaults.add_bos));
  TANDEM_ASSIGN_OR_RETURN(add_eos_, file.GetBoolOr(kKeyAddEos, defaults.add_eos));
  if (defaults.force_add_bos) add_bos_ = true;
  if (add_bos_ && bos < 0) {
    return absl::InvalidArgumentError("add_bos_token is set but the vocabulary has no BOS token");
  }
  if (add_eos_ && eos < 0) {
    return absl::InvalidArgumentError("add_eos_token is set but the vocabulary has no EOS token");
  }

  // Markers recognised by their text. llama.cpp takes the first candidate its hash map yields;
  // tandem takes the first of the list that exists (e.g. <|eot_id|> before <|end_of_text|>),
  // which is what llama.cpp reports for the common vocabularies.
  auto detect = [&](int32_t* id, std::span<const std::string_view> texts) {
    if (*id >= 0) return;
    for (std::string_view t : texts) {
      const int32_t found = Find(t);
      if (found >= 0) {
        *id = found;
        flags_[found] |= kAttrControl;
        return;
      }
    }
  };
  detect(&eot, kEotTexts);
  detect(&eom, kEomTexts);
  detect(&fim_pre, kFimPreTexts);
  detect(&fim_suf, kFimSufTexts);
  detect(&fim_mid, kFimMidTexts);
  detect(&fim_pad, kFimPadTexts);
  detect(&fim_rep, kFimRepTexts);
  detect(&fim_sep, kFimSepTexts);

  for (int32_t i = 0; i < n_tokens; ++i) {
    if ((flags_[i] & kAttrControl) && pieces_[i].find("unused") != std::string::npos) {
      flags_[i] |= kAttrUnused;
    }
  }

  std::vector<int32_t> eog;
  for (int32_t id : {fim_pad, fim_rep, fim_sep}) {
    if (id >= 0) eog.push_back(id);
  }
  for (std::string_view t : kEogTexts) {
    const int32_t id = Find(t);
    if (id >= 0) {
      eog.push_back(id);
      flags_[id] |= kAttrControl;
    }
  }
  for (std::string_view t : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}) {
    const int32_t id = Find(t);  // gpt-oss: always rendered
    if (id >= 0) flags_[id] = kAttrUserDefined;
  }
  for (int32_t id : {eos, eot, eom}) {
    if (id >= 0) eog.push_back(id);
  }
  std::sort(eog.begin(), eog.end());
  eog.erase(std::unique(eog.begin(), eog.end()), eog.end());
  auto erase_eog = [&](int32_t id) {
    eog.erase(std::remove(eog.begin(), eog.end(), id), eog.end());
  };
  {
    // Harmony-style vocabularies: <|end|> is not end-of-generation when <|return|>/<|call|>
    // (or <|calls|>/<|flush|>) exist.
    bool has_return = false, has_call = false, has_flush = false;
    int32_t end_id = -1;
    for (int32_t id : eog) {
      const std::string& t = pieces_[id];
      if (t == "<|return|>") has_return = true;
      if (t == "<|call|>" || t == "<|calls|>") has_call = true;
      if (t == "<|flush|>") has_flush = true;
      if (t == "<|end|>") end_id = id;
    }
    if (end_id >= 0 && ((has_return && has_call) || (has_call && has_flush))) {
      erase_eog(end_id);
      flags_[end_id] = kAttrUserDefined;
    }
    bool has_tool_response = false;
    int32_t s_id = -1;
    for (int32_t id : eog) {
      if (pieces_[id] == "<|tool_response>") has_tool_response = true;
      if (pieces_[id] == "</s>") s_id = id;
    }
    if (has_tool_response && s_id >= 0) {
      erase_eog(s_id);
      flags_[s_id] = kAttrNormal;
    }
  }

  for (int32_t i = 0; i < n_tokens; ++i) {
    if (flags_[i] & (kAttrControl | kAttrUserDefined | kAttrUnknown)) special_ids_.push_back(i);
  }
  // Longest first so that a special token containing another one wins; ties by id (llama.cpp's
  // unstable sort leaves them in an unspecified order).
  std::stable_sort(special_ids_.begin(), special_ids_.end(),
                   [&](int32_t a, int32_t b) { return pieces_[a].size() > pieces_[b].size(); });

  piece_cache_.resize(n);
  for (int32_t i = 0; i < n_tokens; ++i) piece_cache_[i] = ComputePiece(i);

  // Per-model attributes llama.cpp sets by name (after the piece cache, as there).
  TANDEM_ASSIGN_OR_RETURN(std::string_view general_name, file.GetStringOr("general.name", ""));
  const std::string name = absl::AsciiStrToLower(internal::AbslView(general_name));
  if (name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos) {
    for (int32_t id : special_ids_) flags_[id] |= kAttrRstrip;
    auto set_rstrip = [&](std::string_view text, bool on) {
      const int32_t id = Find(text);
      if (id < 0) return;
      flags_[id] = on ? (flags_[id] | kAttrRstrip) : (flags_[id] & ~kAttrRstrip);
    };
    set_rstrip("</s>", true);
    for (std::string_view t : {"<unk>", "<s>", "<|endoftext|>"}) set_rstrip(t, false);
  }

  attrs_.resize(n);
  for (size_t i = 0; i < n; ++i) attrs_[i] = PublicAttr(flags_[i]);
  eog_ids_ = std::move(eog);
  bos_id_ = bos;
  eos_id_ = eos;
  eot_id_ = eot;
  unk_id_ = unk;
  pad_id_ = pad;
  return absl::OkStatus();
}

void VocabTokenizer::Partition(std::string_view text, bool parse_special,
                               std::vector<Fragment>* out) const {
  out->clear();
  if (text.empty()) return;
  out->push_back(Fragment{-1, 0, text.size()});
  std::vector<Fragment> next;
  for (const int32_t id : special_ids_) {
    const uint16_t flags = flags_[id];
    // Control and unknown tokens only count with parse_special; user-defined ones always do.
    if (!parse_special && (flags & (kAttrControl | kAttrUnknown))) continue;
    const std::string& needle = pieces_[id];
    next.clear();
    for (const Fragment& frag : *out) {
      if (frag.token >= 0) {
        next.push_back(frag);
        continue;
      }
      size_t base = frag.offset;
      size_t len = frag.length;
      while (true) {
        const size_t match = text.substr(0, base + len).find(needle, base);
        if (match == std::string_view::npos) {
          if (len > 0) next.push_back(Fragment{-1, base, len});
          break;
        }
        if (match > base) {
          size_t left_len = match - base;
          if (flags & kAttrLstrip) {
            while (left_len > 0 && IsCSpace(text[base + left_len - 1])) --left_len;
          }
          if (left_len > 0) next.push_back(Fragment{-1, base, left_len});
        }
        next.push_back(Fragment{id, 0, 0});
        const size_t right = match + needle.size();
        if (right >= base + len) break;
        size_t right_len = base + len - right;
        size_t right_off = right;
        if (flags & kAttrRstrip) {
          while (right_len > 0 && IsCSpace(text[right_off])) {
            ++right_off;
            --right_len;
          }
        }
        base = right_off;
        len = right_len;
      }
    }
    out->swap(next);
  }
}

}  // namespace internal

std::string StreamingDecoder::Push(int32_t id) {
  std::string piece = tok_.TokenToPiece(id, special_);
  if (tok_.add_space_prefix()) {
    if ((first_ || after_bos_) && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
    after_bos_ = id >= 0 && id == tok_.bos_id();
  }
  first_ = false;
  pending_ += piece;

  // Emit every complete character; replace bytes that can no longer become one; keep a
  // possibly-incomplete tail.
  std::string out;
  const auto* s = reinterpret_cast<const uint8_t*>(pending_.data());
  const size_t n = pending_.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b = s[i];
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    }
    if (len == 0) {  // can never start a character
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    // Count how many of the following bytes fit the sequence (the maximal valid prefix).
    size_t ok = 1;
    while (ok < len && i + ok < n) {
      const uint8_t c = s[i + ok];
      const bool fits = ok == 1 ? (c >= lo && c <= hi) : (c & 0xC0) == 0x80;
      if (!fits) break;
      ++ok;
    }
    if (ok == len) {
      out.append(pending_, i, len);
      i += len;
    } else if (i + ok == n) {
      break;  // incomplete so far: wait for more bytes
    } else {
      out += "\xEF\xBF\xBD";  // a byte broke the sequence: the prefix is one bad character
      i += ok;
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamingDecoder::Flush() {
  // Whatever is held is an incomplete prefix of one character.
  std::string out = pending_.empty() ? "" : "\xEF\xBF\xBD";
  pending_.clear();
  return out;
}

}  // namespace tandem::engine
