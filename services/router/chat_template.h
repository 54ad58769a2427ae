// Chat templates: turns OpenAI chat messages into the prompt text a model was trained on.
//
// GGUF files carry their chat template as a Jinja program (tokenizer.chat_template). Rather than
// embed a Jinja interpreter, the router recognises the template's family from marker strings in
// its text (as llama.cpp does) and renders that family in C++:
//   - chatml  (Qwen, SmolLM, ...): <|im_start|>role\n...<|im_end|>\n, generation prompt
//     <|im_start|>assistant\n;
//   - llama-3: <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>, generation prompt
//     <|start_header_id|>assistant<|end_header_id|>\n\n;
//   - llama-2 (and Mistral's v1-style [INST] templates): [INST] <<SYS>>\n...\n<</SYS>>\n\n
//     user [/INST] assistant </s><s>[INST] ... ; the system block only when the template has
//     <<SYS>>, otherwise the system text leads the first user turn.
// A model without a template, or with one of another family, gets chatml-shaped plain text
// (is_fallback() is true, and the caller logs it); since such a model may lack the <|im_end|>
// token, extra_stop_strings() then asks the sampler to stop at that text.
//
// The rendered text never starts with the model's BOS: the router tokenises prompts with
// add_special, which adds it. BOS/EOS markers inside the history (llama-2's </s><s>) are written
// as text and become special tokens because prompts are tokenised with parse_special.
//
// Threading: immutable after creation; Render may be called from many threads.
// Errors: Render returns INVALID_ARGUMENT naming the message (messages[i].role) for an empty
// conversation, an unknown role, or a layout the family cannot express.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/gguf/gguf.h"

namespace tandem::router {

enum class ChatFormat { kChatml, kLlama2, kLlama3 };

const char* ChatFormatName(ChatFormat f);  // "chatml", "llama-2", "llama-3"

// The most messages one chat request may hold.
inline constexpr size_t kMaxChatMessages = 1024;

// A function call an assistant turn made (OpenAI's tool_calls).
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ChatMessage {
  std::string role;  // system, developer (treated as system), user, assistant, tool
  std::string content;
  std::vector<ToolCall> tool_calls;  // assistant turns
  std::string tool_call_id;          // tool turns: the call answered
};

class ChatTemplate {
 public:
  // The chatml fallback (no template).
  ChatTemplate() = default;

  // Detects the family from a template's text; empty or unrecognised text gives the fallback.
  static ChatTemplate FromTemplateText(std::string_view text);
  // Reads tokenizer.chat_template. An absent key gives the fallback; a key of the wrong type
  // is INVALID_ARGUMENT (the file is malformed).
  static absl::StatusOr<ChatTemplate> FromGguf(const gguf::GgufFile& file);

  ChatFormat format() const { return format_; }
  bool is_fallback() const { return fallback_; }
  // For logs: "llama-3", "llama-2 with <<SYS>>", "chatml fallback (no tokenizer.chat_template)".
  const std::string& description() const { return description_; }
  // Stop strings every chat request gets on top of its own (non-empty only for the fallback).
  std::vector<std::string> extra_stop_strings() const;

  // add_generation_prompt: end with the opening of an assistant turn, so the model answers.
  // tools: the functions the model may call, each the JSON text of an OpenAI tool
  // ({"type": "function", "function": {...}}). They are listed in the system turn (first, or
  // a new one), with how to call one: a JSON object {"name", "arguments"} inside
  // <tool_call></tool_call> (the convention of chatml models trained for tools). Earlier calls
  // are rendered that way in their assistant turns, and tool turns wrap their content in
  // <tool_response></tool_response>. The llama-2 family has no place for tools or tool turns:
  // INVALID_ARGUMENT.
  absl::StatusOr<std::string> Render(std::span<const ChatMessage> messages,
                                     bool add_generation_prompt,
                                     std::span<const std::string> tools = {}) const;

  // The tags of a tool call in generated text (see Render).
  static constexpr char kToolCallOpen[] = "<tool_call>";
  static constexpr char kToolCallClose[] = "</tool_call>";

 private:
  absl::StatusOr<std::string> RenderLlama2(std::span<const ChatMessage> messages) const;

  ChatFormat format_ = ChatFormat::kChatml;
  bool fallback_ = true;
  bool llama2_sys_block_ = true;  // llama-2 family: the template knows <<SYS>>
  std::string description_ = "chatml fallback (no tokenizer.chat_template)";
};

}  // namespace tandem::router
