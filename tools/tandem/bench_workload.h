// What `tandem bench` sends and when: request prompts (token ids) for the random, shared-prefix
// and multi-turn workloads, and open-loop arrival times (poisson, constant, burst).
//
// Prompts are token ids drawn uniformly from [kFirstOrdinaryToken, vocab_size), so their length
// is exact whatever the tokenizer. Workloads:
//   random        every request: input_len fresh tokens;
//   shared-prefix every request: one common prefix_len-token prefix, then input_len fresh tokens;
//   multi-turn    sessions of `turns` requests; turn k's prompt is turn k-1's prompt, a stand-in
//                 reply of output_len tokens, then input_len fresh tokens (a chat history). A
//                 session's turns are sent in order, each after the previous one ended.
//                 With first_turn_len, each conversation opens with that many tokens of its
//                 own (a character card) before its first input_len.
// Arrivals (open loop, mean rate r requests/s): poisson = exponential gaps of mean 1/r;
// constant = i/r; burst = groups of burst_size sent together every burst_size/r seconds.
//
// A class mix (--mix) gives each request a class: a priority name, a weight and the class's
// own targets, "interactive:1:ttft=400,batch:3" (weights relative; targets in ms, ttft and
// tpot, optional). Classes are drawn per request from the weights with the seed.
//
// Threading: pure functions, deterministic for a given seed. Errors: INVALID_ARGUMENT naming
// the option.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::tools::bench {

inline constexpr int32_t kFirstOrdinaryToken = 3;  // past <unk>, <s>, </s> of Llama vocabularies

enum class Workload { kRandom, kSharedPrefix, kMultiTurn };
enum class Arrival { kPoisson, kConstant, kBurst };

absl::StatusOr<Workload> ParseWorkload(const std::string& name);
absl::StatusOr<Arrival> ParseArrival(const std::string& name);

struct WorkloadOptions {
  Workload workload = Workload::kRandom;
  int num_requests = 0;
  int input_len = 32;
  int output_len = 16;
  int prefix_len = 64;  // shared-prefix
  int turns = 3;        // multi-turn
  int first_turn_len = 0;  // multi-turn: extra tokens opening each conversation's first turn
  int32_t vocab_size = 0;
  uint64_t seed = 0;
};

struct PlannedRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 0;
  int session = 0;  // multi-turn: which conversation; otherwise the request index
  int turn = 0;     // multi-turn: 0-based turn within the session; otherwise 0
  int cls = -1;     // index into the class mix; -1 without one
};

struct RequestClass {
  std::string name;  // a priority class name, as the router knows them
  double weight = 0;
  double ttft_ms = 0;  // 0: no target
  double tpot_ms = 0;
};

// "" -> no classes. Names must be distinct; weights > 0.
absl::StatusOr<std::vector<RequestClass>> ParseMix(const std::string& spec);

// Gives each request a class index drawn from the weights (leaves them -1 for no classes).
void AssignClasses(const std::vector<RequestClass>& classes, uint64_t seed,
                   std::vector<PlannedRequest>* requests);

absl::StatusOr<std::vector<PlannedRequest>> MakeRequests(const WorkloadOptions& o);

// Send times in seconds from the start, non-decreasing, one per request.
absl::StatusOr<std::vector<double>> ArrivalTimes(int n, double rate, Arrival kind, uint64_t seed,
                                                 int burst_size = 8);

}  // namespace tandem::tools::bench
