#include <string>
#include <vector>

#include "engine/sampling/sampler.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

SamplingParams WithStops(std::vector<std::string> stops, int32_t max_tokens = 100) {
  SamplingParams p;
  p.stop_strings = std::move(stops);
  p.max_tokens = max_tokens;
  return p;
}

struct Fed {
  std::vector<std::string> chunks;  // what each Push returned
  std::string text;                 // all emitted text, Flush included
};

Fed Feed(StopChecker& sc, const std::vector<std::string>& pieces) {
  Fed r;
  int32_t id = 10;
  for (const std::string& piece : pieces) {
    if (sc.reason() != FinishReason::kNone) break;
    r.chunks.push_back(sc.Push(id++, piece, false));
    r.text += r.chunks.back();
  }
  r.text += sc.Flush();
  return r;
}

TEST(StopChecker, StopStringSplitAcrossTokensIsNeverEmitted) {
  StopChecker sc(WithStops({"###"}));
  Fed r = Feed(sc, {"Hello a#", "#", "#b tail", "never"});
  EXPECT_EQ(sc.reason(), FinishReason::kStop);
  EXPECT_EQ(r.text, "Hello a");
  // "#" and "##" were held back, not emitted and taken back.
  EXPECT_EQ(r.chunks, (std::vector<std::string>{"Hello a", "", ""}));
  EXPECT_EQ(sc.generated(), 3);
}

TEST(StopChecker, HeldPrefixIsReleasedWhenItDoesNotComplete) {
  StopChecker sc(WithStops({"END"}));
  EXPECT_EQ(sc.Push(1, "the E", false), "the ");
  EXPECT_EQ(sc.Push(2, "N", false), "");
  EXPECT_EQ(sc.Push(3, "D?", false), "");  // completes "END"
  EXPECT_EQ(sc.reason(), FinishReason::kStop);

  StopChecker sc2(WithStops({"END"}));
  EXPECT_EQ(sc2.Push(1, "the E", false), "the ");
  EXPECT_EQ(sc2.Push(2, "N", false), "");
  EXPECT_EQ(sc2.Push(3, "O", false), "ENO");
  EXPECT_EQ(sc2.reason(), FinishReason::kNone);
}

TEST(StopChecker, OverlappingPrefixHoldsOnlyWhatCanStillMatch) {
  StopChecker sc(WithStops({"aab"}));
  Fed r = Feed(sc, {"a", "a", "a", "b"});
  EXPECT_EQ(sc.reason(), FinishReason::kStop);
  EXPECT_EQ(r.chunks, (std::vector<std::string>{"", "", "a", ""}));
  EXPECT_EQ(r.text, "a");
}

TEST(StopChecker, EarliestOfSeveralStopStringsWins) {
  StopChecker sc(WithStops({"world", "lo"}));
  Fed r = Feed(sc, {"hel", "lo world"});
  EXPECT_EQ(r.text, "hel");
  EXPECT_EQ(sc.reason(), FinishReason::kStop);
}

TEST(StopChecker, HeldTextIsFlushedAtTheEnd) {
  StopChecker sc(WithStops({"abc"}));
  EXPECT_EQ(sc.Push(1, "xa", false), "x");
  EXPECT_EQ(sc.Push(2, "b", false), "");
  EXPECT_EQ(sc.reason(), FinishReason::kNone);
  EXPECT_EQ(sc.Flush(), "ab");
  EXPECT_EQ(sc.Flush(), "");
}

TEST(StopChecker, MaxTokensFinishesWithLengthAndReleasesHeldText) {
  StopChecker sc(WithStops({"abc"}, 2));
  EXPECT_EQ(sc.Push(1, "x", false), "x");
  EXPECT_EQ(sc.reason(), FinishReason::kNone);
  EXPECT_EQ(sc.Push(2, "ab", false), "ab");
  EXPECT_EQ(sc.reason(), FinishReason::kLength);
  EXPECT_EQ(sc.generated(), 2);
  EXPECT_EQ(sc.Flush(), "");
  EXPECT_EQ(sc.Push(3, "more", false), "");  // finished: nothing more is accepted
  EXPECT_EQ(sc.generated(), 2);
}

TEST(StopChecker, StopStringOnTheLastAllowedTokenIsAStop) {
  StopChecker sc(WithStops({"!"}, 1));
  EXPECT_EQ(sc.Push(1, "hi!", false), "hi");
  EXPECT_EQ(sc.reason(), FinishReason::kStop);
}

TEST(StopChecker, EndOfGenerationStopsUnlessIgnored) {
  StopChecker sc(WithStops({"zz"}));
  EXPECT_EQ(sc.Push(1, "az", false), "a");
  EXPECT_EQ(sc.Push(2, "</s>", true), "z");  // EOG text dropped, held text released
  EXPECT_EQ(sc.reason(), FinishReason::kStop);

  SamplingParams p;
  p.ignore_eos = true;
  StopChecker ignoring(p);
  EXPECT_EQ(ignoring.Push(2, "</s>", true), "</s>");
  EXPECT_EQ(ignoring.reason(), FinishReason::kNone);
}

TEST(StopChecker, StopTokenIdsStopEvenWithIgnoreEos) {
  SamplingParams p;
  p.stop_token_ids = {7};
  p.ignore_eos = true;
  StopChecker sc(p);
  EXPECT_EQ(sc.Push(3, "a", false), "a");
  EXPECT_EQ(sc.Push(7, "<|im_end|>", false), "");
  EXPECT_EQ(sc.reason(), FinishReason::kStop);
  EXPECT_EQ(sc.generated(), 2);
}

TEST(StopChecker, NoStopStringsStreamsEverythingImmediately) {
  StopChecker sc(SamplingParams{});
  EXPECT_EQ(sc.Push(1, "abc", false), "abc");
  EXPECT_EQ(sc.Push(2, "", false), "");
  EXPECT_EQ(sc.Flush(), "");
}

}  // namespace
}  // namespace tandem::engine
