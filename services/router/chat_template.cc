#include "services/router/chat_template.h"

#include "absl/strings/str_cat.h"

namespace tandem::router {
namespace {

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

// Leading and trailing ASCII whitespace removed, as the llama-2 and llama-3 templates do with
// Jinja's trim / strip.
std::string Trim(std::string_view s) {
  const char* kSpace = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return "";
  const size_t e = s.find_last_not_of(kSpace);
  return std::string(s.substr(b, e - b + 1));
}

// The role as rendered, or INVALID_ARGUMENT naming the message.
absl::StatusOr<std::string> NormalizedRole(const ChatMessage& m, size_t i) {
  if (m.role == "system" || m.role == "developer") return std::string("system");
  if (m.role == "user" || m.role == "assistant" || m.role == "tool") return m.role;
  return absl::InvalidArgumentError(absl::StrCat(
      "messages[", i, "].role must be system, developer, user, assistant or tool, got '", m.role,
      "'"));
}

}  // namespace

const char* ChatFormatName(ChatFormat f) {
  switch (f) {
    case ChatFormat::kChatml:
      return "chatml";
    case ChatFormat::kLlama2:
      return "llama-2";
    case ChatFormat::kLlama3:
      return "llama-3";
  }
  return "unknown";
}

ChatTemplate ChatTemplate::FromTemplateText(std::string_view text) {
  ChatTemplate t;
  if (text.empty()) return t;
  t.fallback_ = false;
  if (Contains(text, "<|im_start|>")) {
    t.format_ = ChatFormat::kChatml;
    t.description_ = "chatml";
  } else if (Contains(text, "<|start_header_id|>") && Contains(text, "<|end_header_id|>")) {
    t.format_ = ChatFormat::kLlama3;
    t.description_ = "llama-3";
  } else if (Contains(text, "[INST]")) {
    t.format_ = ChatFormat::kLlama2;
    t.llama2_sys_block_ = Contains(text, "<<SYS>>");
    t.description_ = t.llama2_sys_block_ ? "llama-2 with <<SYS>>" : "llama-2 without <<SYS>>";
  } else {
    t.fallback_ = true;
    t.format_ = ChatFormat::kChatml;
    t.description_ = "chatml fallback (tokenizer.chat_template of an unrecognised family)";
  }
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromGguf(const gguf::GgufFile& file) {
  constexpr std::string_view kKey = "tokenizer.chat_template";
  if (file.Find(kKey) == nullptr) return ChatTemplate();
  absl::StatusOr<std::string_view> text = file.GetString(kKey);
  if (!text.ok()) return text.status();
  return FromTemplateText(*text);
}

std::vector<std::string> ChatTemplate::extra_stop_strings() const {
  if (fallback_) return {"<|im_end|>"};
  return {};
}

absl::StatusOr<std::string> ChatTemplate::Render(std::span<const ChatMessage> in,
                                                 bool add_generation_prompt,
                                                 std::span<const std::string> tools) const {
  if (in.empty()) return absl::InvalidArgumentError("messages must not be empty");
  bool tool_turns = !tools.empty();
  for (size_t i = 0; i < in.size(); ++i) {
    absl::StatusOr<std::string> role = NormalizedRole(in[i], i);
    if (!role.ok()) return role.status();
    tool_turns = tool_turns || *role == "tool" || !in[i].tool_calls.empty();
  }
  if (format_ == ChatFormat::kLlama2) {
    if (tool_turns) {
      return absl::InvalidArgumentError(
          "tools: the llama-2 chat format has no place for tools, tool calls or tool messages");
    }
    return RenderLlama2(in);
  }
  // Tools, calls and responses become text of the turns they belong to.
  std::vector<ChatMessage> messages(in.begin(), in.end());
  for (ChatMessage& m : messages) {
    for (const ToolCall& c : m.tool_calls) {
      if (!m.content.empty()) m.content += "\n";
      absl::StrAppend(&m.content, kToolCallOpen, "\n{\"name\": \"", c.name,
                      "\", \"arguments\": ", c.arguments.empty() ? "{}" : c.arguments, "}\n",
                      kToolCallClose);
    }
    if (m.role == "tool") {
      m.content = absl::StrCat("<tool_response>\n", m.content, "\n</tool_response>");
    }
  }
  if (!tools.empty()) {
    std::string block =
        "# Tools\n\nThese functions are available, one JSON signature per line inside "
        "<tools></tools>:\n<tools>\n";
    for (const std::string& t : tools) absl::StrAppend(&block, t, "\n");
    absl::StrAppend(&block,
                    "</tools>\n\nTo call one, answer with its name and arguments as a JSON "
                    "object inside <tool_call></tool_call>:\n",
                    kToolCallOpen, "\n{\"name\": <function name>, \"arguments\": <arguments "
                    "object>}\n",
                    kToolCallClose);
    const std::string first = *NormalizedRole(messages[0], 0);
    if (first == "system") {
      messages[0].content = absl::StrCat(messages[0].content, "\n\n", block);
    } else {
      messages.insert(messages.begin(), ChatMessage{"system", block, {}, {}});
    }
  }
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string role = *NormalizedRole(messages[i], i);
    if (format_ == ChatFormat::kLlama3) {
      absl::StrAppend(&out, "<|start_header_id|>", role, "<|end_header_id|>\n\n",
                      Trim(messages[i].content), "<|eot_id|>");
    } else {
      absl::StrAppend(&out, "<|im_start|>", role, "\n", messages[i].content, "<|im_end|>\n");
    }
  }
  if (add_generation_prompt) {
    out += format_ == ChatFormat::kLlama3 ? "<|start_header_id|>assistant<|end_header_id|>\n\n"
                                          : "<|im_start|>assistant\n";
  }
  return out;
}

// Llama-2 has no generation prompt: a prompt ending in [/INST] already asks for the answer.
absl::StatusOr<std::string> ChatTemplate::RenderLlama2(
    std::span<const ChatMessage> messages) const {
  size_t i = 0;
  std::string system;
  bool has_system = false;
  if (*NormalizedRole(messages[0], 0) == "system") {
    system = Trim(messages[0].content);
    has_system = true;
    i = 1;
  }
  if (i == messages.size()) {
    return absl::InvalidArgumentError(
        "messages: the llama-2 chat format needs a user message after the system message");
  }
  std::string out;
  int turns = 0;
  bool expect_user = true;
  for (; i < messages.size(); ++i) {
    const std::string role = *NormalizedRole(messages[i], i);
    const std::string expected = expect_user ? "user" : "assistant";
    if (role != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "].role: the llama-2 chat format needs ",
          "an optional first system message, then user and assistant turns alternating ",
          "from user; got '", messages[i].role, "' where '", expected, "' belongs"));
    }
    if (role == "user") {
      if (turns > 0) out += "<s>";  // the first BOS comes from the tokenizer
      out += "[INST] ";
      if (turns == 0 && has_system) {
        if (llama2_sys_block_) {
          absl::StrAppend(&out, "<<SYS>>\n", system, "\n<</SYS>>\n\n");
        } else {
          absl::StrAppend(&out, system, "\n\n");
        }
      }
      absl::StrAppend(&out, Trim(messages[i].content), " [/INST]");
      turns++;
    } else {
      absl::StrAppend(&out, " ", Trim(messages[i].content), " </s>");
    }
    expect_user = !expect_user;
  }
  return out;
}

}  // namespace tandem::router
