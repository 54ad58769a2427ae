// Grammars written as text, for constrained decoding: GBNF (llama.cpp's grammar format) and
// regular expressions, compiled into engine::Grammar.
//
// GBNF: rules `name ::= alternatives`, the start rule named `root`. Names are letters, digits,
// '-' and '_'. Elements: "literals" and [character classes] ([^...] negated, ranges a-z),
// escapes \n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH, '.' (any character), rule names,
// ( groups ), and the postfix operators * + ? {m} {m,} {m,n} {,n}. '#' starts a comment. A
// rule's alternatives may span lines; the next `name ::=` starts the next rule. Left recursion
// is refused (the matcher follows rules top-down).
//
// Regular expressions: the whole output must match (as vLLM's and SGLang's regex outputs do),
// so ^ at the start and $ at the end are accepted and change nothing. Supported: literals,
// '.', classes with ranges and negation, \d \D \w \W \s \S (ASCII meanings, also inside
// classes), \n \r \t \f \v \0 \xHH \uHHHH \u{H...}, an escaped punctuation character, ( groups
// ), (?: ), (?<name> ) and (?P<name> ), '|', and the quantifiers * + ? {m} {m,} {m,n}, each
// optionally lazy (a trailing '?', which changes nothing when the whole output must match).
// Backreferences, lookaround, \b and possessive quantifiers are refused with
// INVALID_ARGUMENT, rather than generating text that might not match.
//
// Both count characters as UTF-8 code points, and bound what one text may cost: its size
// (kMaxSchemaBytes), its repetition counts (kMaxGrammarRepeat) and the grammar made from it
// (kMaxSchemaRules).
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "engine/sampling/grammar.h"

namespace tandem::engine {

inline constexpr int kMaxGrammarRepeat = 1000;

absl::StatusOr<Grammar> GbnfGrammar(std::string_view text);
absl::StatusOr<Grammar> RegexGrammar(std::string_view pattern);

}  // namespace tandem::engine
