// Multi-turn sessions through a real cluster (router, one prefill and two decode workers as
// separate processes, KV over UCX, the real model): every turn of a conversation carries the
// whole conversation so far, as chat clients send it, and the same session id.
// - Every turn goes to the same decode worker (the router's session affinity), whose prefix
//   cache still holds the earlier turns' KV.
// - From turn 2 on, prefill sends only the KV of the positions past what decode holds: the new
//   tokens' blocks plus the partial last block of what came before (the prefill worker's own
//   transport counter, and the usage the router reports).
// - The text is the same as each full conversation sent cold, to a cluster without prefix
//   caches.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fault/fault_cluster.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
namespace v1 = tandem::v1;

constexpr int kTurns = 6;
constexpr int kReplyTokens = 24;
constexpr int kBlockSize = 16;  // the workers' default --block-size

const char* const kUserTurns[kTurns] = {
    "Once upon a time, there was a little girl named Lily.",
    " She went to the park with her mom.",
    " Then a big dog came to play.",
    " Lily was happy and laughed.",
    " At night, she went home to sleep.",
    " The next day, the sun was bright.",
};

std::vector<int32_t> Tokenize(FaultCluster& cluster, const std::string& text, bool bos) {
  v1::TokenizeRequest req;
  req.set_text(text);
  req.set_add_special(bos);
  v1::TokenizeResponse resp;
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  const grpc::Status st = cluster.inference().Tokenize(&cc, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return {resp.token_ids().begin(), resp.token_ids().end()};
}

v1::GenerateRequest TurnRequest(const std::vector<int32_t>& prompt, const std::string& session) {
  v1::GenerateRequest req;
  req.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  req.mutable_sampling()->set_temperature(0);
  req.mutable_sampling()->set_max_tokens(kReplyTokens);
  req.mutable_sampling()->set_ignore_eos(true);
  req.set_session_id(session);
  return req;
}

uint64_t BytesWritten(FaultCluster& cluster, const std::string& worker) {
  absl::StatusOr<v1::WorkerStats> s = cluster.Stats(worker);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? s->transport_bytes_written() : 0;
}

TEST(SessionTest, LaterTurnsSendOnlyNewKvToTheSameDecodeWorkerAndMatchColdRuns) {
  if (!fs::exists(FaultModelPath())) GTEST_SKIP() << "no real model at " << FaultModelPath();
  std::vector<std::vector<int32_t>> prompts;  // each turn's whole conversation
  std::vector<Completion> replies;
  {
    FaultClusterOptions o;
    o.name = "session";
    o.decode = 2;
    FaultCluster cluster(o);
    absl::Status up = cluster.Start();
    ASSERT_TRUE(up.ok()) << up;
    std::vector<int32_t> conversation;
    uint64_t kv_bytes_per_token = 0;
    std::string decode_worker;
    for (int t = 0; t < kTurns; ++t) {
      SCOPED_TRACE(absl::StrCat("turn ", t + 1));
      const std::vector<int32_t> before = conversation;  // what decode computed K/V for last turn
      if (t > 0) {
        const std::vector<int32_t>& last = replies.back().tokens;
        conversation.insert(conversation.end(), last.begin(), last.end());
      }
      const std::vector<int32_t> user = Tokenize(cluster, kUserTurns[t], /*bos=*/t == 0);
      ASSERT_FALSE(user.empty());
      conversation.insert(conversation.end(), user.begin(), user.end());
      prompts.push_back(conversation);

      const uint64_t sent_before = BytesWritten(cluster, "prefill-0");
      Completion c = cluster.Generate(TurnRequest(conversation, "npc-7"));
      ASSERT_TRUE(c.status.ok()) << c.status.error_message();
      ASSERT_EQ(static_cast<int>(c.tokens.size()), kReplyTokens);
      const uint64_t sent = BytesWritten(cluster, "prefill-0") - sent_before;
      EXPECT_EQ(sent, c.usage.kv_transfer_bytes());
      const int64_t n = static_cast<int64_t>(conversation.size());
      if (t == 0) {
        // Nothing held: the whole prompt's KV crosses; that fixes the bytes per position.
        EXPECT_EQ(c.usage.decode_held_tokens(), 0);
        ASSERT_GT(sent, 0u);
        ASSERT_EQ(sent % static_cast<uint64_t>(n), 0u);
        kv_bytes_per_token = sent / static_cast<uint64_t>(n);
        decode_worker = c.decode_worker;
      } else {
        EXPECT_EQ(c.decode_worker, decode_worker) << "the session moved to another worker";
        // Decode holds K/V for the last turn's prompt and all but the last generated token
        // (never fed back), in full blocks; the rest of the conversation is new to it.
        const int64_t computed =
            static_cast<int64_t>(before.size() + replies.back().tokens.size()) - 1;
        const int64_t held = computed / kBlockSize * kBlockSize;
        EXPECT_EQ(c.usage.decode_held_tokens(), held);
        EXPECT_EQ(sent, static_cast<uint64_t>(n - held) * kv_bytes_per_token);
        // The new part: this turn's user tokens, the last reply, and the tail of the last
        // block before them; never a whole block more.
        const int64_t fresh = static_cast<int64_t>(user.size() + replies.back().tokens.size());
        EXPECT_LT(n - held, fresh + kBlockSize);
        std::fprintf(stderr, "turn %d: %lld prompt tokens, %lld held by %s, %llu KV bytes sent "
                             "(whole prompt: %llu)\n",
                     t + 1, static_cast<long long>(n), static_cast<long long>(held),
                     c.decode_worker.c_str(), static_cast<unsigned long long>(sent),
                     static_cast<unsigned long long>(n * kv_bytes_per_token));
      }
      replies.push_back(std::move(c));
    }
    absl::StatusOr<v1::WorkerStats> ds = cluster.Stats(decode_worker);
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_GT(ds->prefix_cache_hit_blocks(), 0u);
    std::string why;
    EXPECT_TRUE(cluster.WaitIdle(absl::Seconds(10), &why)) << why;
  }

  // Cold: each whole conversation on a cluster that caches nothing, no session.
  FaultClusterOptions o;
  o.name = "session-cold";
  o.prefill_args = {"--no-prefix-cache"};
  o.decode_args = {"--no-prefix-cache"};
  FaultCluster cold(o);
  absl::Status up = cold.Start();
  ASSERT_TRUE(up.ok()) << up;
  for (int t = 0; t < kTurns; ++t) {
    SCOPED_TRACE(absl::StrCat("turn ", t + 1));
    Completion c = cold.Generate(TurnRequest(prompts[t], ""));
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    EXPECT_EQ(c.usage.decode_held_tokens(), 0);
    EXPECT_EQ(c.tokens, replies[t].tokens);
    EXPECT_EQ(c.text, replies[t].text);
  }
}

}  // namespace
}  // namespace tandem::testing
