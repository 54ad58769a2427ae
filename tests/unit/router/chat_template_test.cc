// Chat templates: family detection from template text, and each family rendered against
// hand-written expected prompts.
#include "services/router/chat_template.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

// Template texts written for these tests: only the markers the detection looks at matter.
constexpr char kChatmlTemplate[] =
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
    "}}{% endif %}";
constexpr char kLlama3Template[] =
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}";
constexpr char kLlama2Template[] =
    "{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + messages[0]['content'] "
    "+ '\\n<</SYS>>\\n\\n' %}{% endif %}{% for m in messages %}{% if m['role'] == 'user' %}{{ "
    "bos_token + '[INST] ' + m['content'] | trim + ' [/INST]' }}{% else %}{{ ' ' + m['content'] "
    "| trim + ' ' + eos_token }}{% endif %}{% endfor %}";
constexpr char kMistralTemplate[] =
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' "
    "}}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}";

std::vector<ChatMessage> Conversation() {
  return {{"system", "You are terse."},
          {"user", "Hi there"},
          {"assistant", "Hello."},
          {"user", "  What is 2+2?\n"}};
}

TEST(ChatTemplateTest, DetectsTheFamilyFromTheTemplateText) {
  EXPECT_EQ(ChatTemplate::FromTemplateText(kChatmlTemplate).format(), ChatFormat::kChatml);
  EXPECT_FALSE(ChatTemplate::FromTemplateText(kChatmlTemplate).is_fallback());
  EXPECT_EQ(ChatTemplate::FromTemplateText(kLlama3Template).format(), ChatFormat::kLlama3);
  EXPECT_EQ(ChatTemplate::FromTemplateText(kLlama2Template).format(), ChatFormat::kLlama2);
  EXPECT_EQ(ChatTemplate::FromTemplateText(kMistralTemplate).format(), ChatFormat::kLlama2);
  EXPECT_EQ(ChatTemplate::FromTemplateText(kLlama2Template).description(), "llama-2 with <<SYS>>");
  EXPECT_EQ(ChatTemplate::FromTemplateText(kMistralTemplate).description(),
            "llama-2 without <<SYS>>");

  const ChatTemplate none = ChatTemplate::FromTemplateText("");
  EXPECT_TRUE(none.is_fallback());
  EXPECT_EQ(none.format(), ChatFormat::kChatml);
  EXPECT_NE(none.description().find("no tokenizer.chat_template"), std::string::npos);
  const ChatTemplate odd = ChatTemplate::FromTemplateText("{{ '### User: ' + content }}");
  EXPECT_TRUE(odd.is_fallback());
  EXPECT_NE(odd.description().find("unrecognised"), std::string::npos);
  EXPECT_EQ(odd.extra_stop_strings(), std::vector<std::string>{"<|im_end|>"});
  EXPECT_TRUE(ChatTemplate::FromTemplateText(kLlama3Template).extra_stop_strings().empty());
}

TEST(ChatTemplateTest, RendersChatml) {
  const ChatTemplate t = ChatTemplate::FromTemplateText(kChatmlTemplate);
  absl::StatusOr<std::string> s = t.Render(Conversation(), /*add_generation_prompt=*/true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s,
            "<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\n  What is 2+2?\n<|im_end|>\n"
            "<|im_start|>assistant\n");
  std::vector<ChatMessage> one = {{"user", "x"}};
  EXPECT_EQ(*t.Render(one, /*add_generation_prompt=*/false), "<|im_start|>user\nx<|im_end|>\n");
  // developer is OpenAI's newer name for system.
  std::vector<ChatMessage> dev = {{"developer", "d"}, {"user", "u"}};
  EXPECT_EQ(*t.Render(dev, false),
            "<|im_start|>system\nd<|im_end|>\n<|im_start|>user\nu<|im_end|>\n");
}

TEST(ChatTemplateTest, RendersLlama3) {
  const ChatTemplate t = ChatTemplate::FromTemplateText(kLlama3Template);
  absl::StatusOr<std::string> s = t.Render(Conversation(), true);
  ASSERT_TRUE(s.ok()) << s.status();
  // No <|begin_of_text|>: the tokenizer adds BOS. Contents are trimmed.
  EXPECT_EQ(*s,
            "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, RendersToolsCallsAndResponses) {
  const ChatTemplate t = ChatTemplate::FromTemplateText(kChatmlTemplate);
  const std::string tool =
      R"({"type":"function","function":{"name":"look","parameters":{"type":"object"}}})";
  std::vector<ChatMessage> m = {{"user", "Where am I?"}};
  ChatMessage call{"assistant", "", {{"call_1", "look", R"({"dir":"north"})"}}, ""};
  m.push_back(call);
  m.push_back({"tool", "a cave", {}, "call_1"});
  absl::StatusOr<std::string> s = t.Render(m, true, {&tool, 1});
  ASSERT_TRUE(s.ok()) << s.status();
  // A system turn lists the tool and how to call it; the call and the response are text.
  EXPECT_EQ(s->rfind("<|im_start|>system\n# Tools\n", 0), 0u) << *s;
  EXPECT_NE(s->find("<tools>\n" + tool + "\n</tools>"), std::string::npos) << *s;
  EXPECT_NE(s->find("<|im_start|>user\nWhere am I?<|im_end|>\n"
                    "<|im_start|>assistant\n<tool_call>\n"
                    "{\"name\": \"look\", \"arguments\": {\"dir\":\"north\"}}\n"
                    "</tool_call><|im_end|>\n"
                    "<|im_start|>tool\n<tool_response>\na cave\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n"),
            std::string::npos)
      << *s;
  // An existing system turn gets the list appended.
  std::vector<ChatMessage> sys = {{"system", "Be brief."}, {"user", "hi"}};
  absl::StatusOr<std::string> s2 = t.Render(sys, true, {&tool, 1});
  ASSERT_TRUE(s2.ok());
  EXPECT_EQ(s2->rfind("<|im_start|>system\nBe brief.\n\n# Tools\n", 0), 0u) << *s2;
  // Llama-2 has no place for them.
  const ChatTemplate l2 = ChatTemplate::FromTemplateText(kLlama2Template);
  absl::StatusOr<std::string> bad = l2.Render(sys, true, {&tool, 1});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l2.Render(m, true).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, RendersLlama2WithAndWithoutSysBlock) {
  const ChatTemplate t = ChatTemplate::FromTemplateText(kLlama2Template);
  absl::StatusOr<std::string> s = t.Render(Conversation(), true);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s,
            "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello. </s>"
            "<s>[INST] What is 2+2? [/INST]");
  const ChatTemplate m = ChatTemplate::FromTemplateText(kMistralTemplate);
  EXPECT_EQ(*m.Render(Conversation(), true),
            "[INST] You are terse.\n\nHi there [/INST] Hello. </s><s>[INST] What is 2+2? [/INST]");
  std::vector<ChatMessage> user_only = {{"user", "Hi"}};
  EXPECT_EQ(*t.Render(user_only, true), "[INST] Hi [/INST]");
}

TEST(ChatTemplateTest, RefusesWhatAFamilyCannotExpress) {
  const ChatTemplate chatml = ChatTemplate::FromTemplateText(kChatmlTemplate);
  const ChatTemplate llama2 = ChatTemplate::FromTemplateText(kLlama2Template);
  EXPECT_EQ(chatml.Render({}, true).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<ChatMessage> bad_role = {{"user", "a"}, {"wizard", "b"}};
  absl::Status st = chatml.Render(bad_role, true).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("messages[1].role"), std::string::npos) << st;
  std::vector<ChatMessage> two_users = {{"user", "a"}, {"user", "b"}};
  st = llama2.Render(two_users, true).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("messages[1].role"), std::string::npos) << st;
  std::vector<ChatMessage> system_only = {{"system", "s"}};
  EXPECT_EQ(llama2.Render(system_only, true).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<ChatMessage> tool = {{"user", "a"}, {"tool", "b"}};
  EXPECT_FALSE(llama2.Render(tool, true).ok());
  EXPECT_TRUE(chatml.Render(tool, true).ok());
}

// A GGUF v3 file with no tensors and at most one metadata key.
class GgufBytes {
 public:
  GgufBytes& Raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
    return *this;
  }
  GgufBytes& U32(uint32_t v) { return Raw(&v, 4); }
  GgufBytes& U64(uint64_t v) { return Raw(&v, 8); }
  GgufBytes& Str(const std::string& s) { return U64(s.size()).Raw(s.data(), s.size()); }
  std::vector<uint8_t> bytes_;
};

std::vector<uint8_t> FileWith(const std::string* chat_template, bool as_number = false) {
  GgufBytes g;
  g.Raw("GGUF", 4).U32(3).U64(0).U64(chat_template || as_number ? 1 : 0);
  if (as_number) {
    g.Str("tokenizer.chat_template").U32(4).U32(7);  // type 4: uint32
  } else if (chat_template) {
    g.Str("tokenizer.chat_template").U32(8).Str(*chat_template);  // type 8: string
  }
  return g.bytes_;
}

TEST(ChatTemplateTest, ReadsTheTemplateFromGgufMetadata) {
  const std::string llama3 = kLlama3Template;
  std::vector<uint8_t> with = FileWith(&llama3);
  auto f = gguf::GgufFile::FromBuffer(with);
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromGguf(**f);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->format(), ChatFormat::kLlama3);
  EXPECT_FALSE(t->is_fallback());

  std::vector<uint8_t> without = FileWith(nullptr);
  auto g = gguf::GgufFile::FromBuffer(without);
  ASSERT_TRUE(g.ok()) << g.status();
  t = ChatTemplate::FromGguf(**g);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->is_fallback());

  std::vector<uint8_t> wrong = FileWith(nullptr, /*as_number=*/true);
  auto h = gguf::GgufFile::FromBuffer(wrong);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(ChatTemplate::FromGguf(**h).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::router
