// JSON grammars for constrained decoding: any JSON object (OpenAI's response_format
// json_object), and the documents a JSON Schema accepts (json_schema), as engine::Grammar.
//
// Schema support (what OpenAI's strict structured outputs accept, and a little more):
// type (a name or a list of names: object, array, string, number, integer, boolean, null),
// properties with required (properties are written in the schema's order; a required one
// always, another optionally), additionalProperties false (an object with no properties and
// additionalProperties not false is any JSON object), items with minItems/maxItems, string
// minLength/maxLength, enum, const, anyOf/oneOf, and $ref to "#", "#/$defs/NAME" or
// "#/definitions/NAME" (recursion allowed). Annotations (title, description, default,
// examples, $schema, $id, strict) are ignored. Any other keyword (pattern, format, minimum,
// ...) is refused with INVALID_ARGUMENT naming it, rather than generating text that might not
// validate.
//
// Output shape: no whitespace except one optional space after ':' and ','; integers have at
// most 15 digits, fractions at most 15 and exponents at most 2 (a model cannot run on forever
// inside a number, and every number is a finite double);
// JSON objects without a schema nest at most kMaxJsonDepth levels. Strings are valid UTF-8 and
// escaped as JSON requires.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "engine/sampling/grammar.h"
#include "nlohmann/json.hpp"

namespace tandem::engine {

inline constexpr int kMaxJsonDepth = 8;
// Limits on what one schema may cost: its text and the grammar made from it.
inline constexpr size_t kMaxSchemaBytes = 64 << 10;
inline constexpr size_t kMaxSchemaRules = 20000;

// Any JSON object.
Grammar JsonObjectGrammar();
// The documents `schema` accepts; INVALID_ARGUMENT naming the unsupported or malformed part.
// An ordered_json keeps the schema's property order, which the output follows.
absl::StatusOr<Grammar> JsonSchemaGrammar(const nlohmann::ordered_json& schema);
absl::StatusOr<Grammar> JsonSchemaGrammarFromText(std::string_view schema_text);

}  // namespace tandem::engine
