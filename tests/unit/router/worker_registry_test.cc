// WorkerRegistry: registration checks, leases (expiry without a restart), draining,
// deregistration and the selection policies, on a fake clock.
#include "services/router/worker_registry.h"

#include <atomic>
#include <map>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1'000'000);
};

class RegistryTest : public ::testing::Test {
 protected:
  std::unique_ptr<WorkerRegistry> Make(Policy policy = Policy::kLeastLoad,
                                       absl::Duration stall_after = absl::InfiniteDuration()) {
    RegistryOptions o;
    o.lease = absl::Seconds(3);
    o.stall_after = stall_after;
    o.policy = policy;
    o.model_names = {"stories260K", "/models/stories260K.gguf"};
    o.clock = [this] { return clock_.Now(); };
    return std::make_unique<WorkerRegistry>(o);
  }
  static v1::RegisterRequest Reg(const std::string& id, v1::WorkerRole role, int blocks = 100) {
    v1::RegisterRequest r;
    r.set_worker_id(id);
    r.set_role(role);
    r.set_address(id + ":1");
    r.set_model("stories260K");
    r.set_kv_blocks_total(blocks);
    return r;
  }
  static v1::HeartbeatRequest Beat(const std::string& id, int free_blocks, int running = 0,
                                   bool draining = false) {
    v1::HeartbeatRequest h;
    h.set_worker_id(id);
    h.mutable_stats()->set_kv_blocks_free(free_blocks);
    h.mutable_stats()->set_running(running);
    h.set_draining(draining);
    return h;
  }
  FakeClock clock_;
};

TEST_F(RegistryTest, RegisterRejectsIncompleteOrForeignWorkers) {
  auto r = Make();
  v1::RegisterRequest bad = Reg("", v1::WORKER_ROLE_DECODE);
  EXPECT_EQ(r->Register(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = Reg("d0", v1::WORKER_ROLE_DECODE);
  bad.clear_address();
  EXPECT_EQ(r->Register(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = Reg("d0", v1::WORKER_ROLE_UNSPECIFIED);
  absl::Status st = r->Register(bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("role"), absl::string_view::npos) << st;
  bad = Reg("d0", v1::WORKER_ROLE_DECODE);
  bad.set_model("/elsewhere/llama-7b.gguf");
  EXPECT_EQ(r->Register(bad).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r->size(), 0u);
  // The same model by path, and no model at all, are accepted.
  v1::RegisterRequest ok = Reg("d0", v1::WORKER_ROLE_DECODE);
  ok.set_model("/other/dir/stories260K.gguf");
  EXPECT_TRUE(r->Register(ok).ok());
  ok = Reg("d1", v1::WORKER_ROLE_DECODE);
  ok.clear_model();
  EXPECT_TRUE(r->Register(ok).ok());
  EXPECT_EQ(r->size(), 2u);
}

TEST_F(RegistryTest, LeaseExpiryRemovesWorkerAndHeartbeatsRenewIt) {
  auto r = Make();
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  ASSERT_TRUE(r->Register(Reg("d1", v1::WORKER_ROLE_DECODE)).ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_TRUE(r->Heartbeat(Beat("d0", 100)));  // d0 renewed until t=5, d1 expires at t=3
  clock_.Advance(absl::Milliseconds(1500));    // t = 3.5
  // d1 is invisible to Pick at once, even before a sweep.
  absl::flat_hash_set<std::string> none;
  for (int i = 0; i < 3; ++i) {
    Assignment a = r->Pick(Pool::kDecode, 1, none);
    ASSERT_TRUE(a);
    EXPECT_EQ(a.worker_id(), "d0");
  }
  EXPECT_EQ(r->ExpireLeases(), std::vector<std::string>{"d1"});
  EXPECT_EQ(r->size(), 1u);
  // A late heartbeat is refused: the worker must register again.
  EXPECT_FALSE(r->Heartbeat(Beat("d1", 100)));
  clock_.Advance(absl::Seconds(2));  // t = 5.5: d0's lease is gone too
  EXPECT_FALSE(r->Pick(Pool::kDecode, 1));
  EXPECT_EQ(r->Plan(), PlanKind::kNone);
  EXPECT_FALSE(r->Heartbeat(Beat("d0", 100)));
  EXPECT_EQ(r->size(), 0u);
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  EXPECT_TRUE(r->Pick(Pool::kDecode, 1));
}

TEST_F(RegistryTest, TheRoutersOwnStallExpiresNoLease) {
  auto r = Make(Policy::kLeastLoad, /*stall_after=*/absl::Milliseconds(1500));
  ASSERT_TRUE(r->Register(Reg("p0", v1::WORKER_ROLE_PREFILL)).ok());
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  // Ticks every 750 ms, heartbeats from both: no stall, nothing expires.
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Milliseconds(750));
    EXPECT_EQ(r->Tick(), absl::ZeroDuration());
    ASSERT_TRUE(r->Heartbeat(Beat("p0", 100)));
    ASSERT_TRUE(r->Heartbeat(Beat("d0", 100)));
  }
  // Only d0 keeps beating from here; p0 has gone quiet (it died), 1 s into its lease.
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(r->Tick(), absl::ZeroDuration());
  ASSERT_TRUE(r->Heartbeat(Beat("d0", 100)));
  // The router stops for 5 s (both leases would have run out). Before its sweeper ticks again,
  // the request threads still see both workers, and a queued heartbeat from d0 is accepted.
  clock_.Advance(absl::Seconds(5));
  EXPECT_EQ(r->Plan(), PlanKind::kDisaggregated);
  EXPECT_TRUE(r->Pick(Pool::kPrefill, 0));
  ASSERT_TRUE(r->Heartbeat(Beat("d0", 100)));
  // The tick reports the stall and renews the leases; nothing is expired.
  EXPECT_EQ(r->Tick(), absl::Seconds(5));
  EXPECT_TRUE(r->ExpireLeases().empty());
  EXPECT_EQ(r->size(), 2u);
  // Time runs again (ticks every <= 1 s): p0, still silent, expires one lease after the stall,
  // and d0, which beats, does not.
  for (absl::Duration step : {absl::Seconds(1), absl::Seconds(1), absl::Milliseconds(900)}) {
    clock_.Advance(step);
    EXPECT_EQ(r->Tick(), absl::ZeroDuration());
    EXPECT_TRUE(r->ExpireLeases().empty());
    ASSERT_TRUE(r->Heartbeat(Beat("d0", 100)));
  }
  clock_.Advance(absl::Milliseconds(200));
  EXPECT_EQ(r->Tick(), absl::ZeroDuration());
  EXPECT_EQ(r->ExpireLeases(), std::vector<std::string>{"p0"});
  EXPECT_EQ(r->Plan(), PlanKind::kNone);
  EXPECT_TRUE(r->Pick(Pool::kDecode, 1));
}

TEST_F(RegistryTest, AStallDoesNotReviveALeaseThatHadRunOut) {
  auto r = Make(Policy::kLeastLoad, /*stall_after=*/absl::Milliseconds(1500));
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  // d0's lease runs out between two ticks (the sweeper has not removed it yet) ...
  clock_.Advance(absl::Milliseconds(1000));
  r->Tick();
  clock_.Advance(absl::Milliseconds(1000));
  r->Tick();
  clock_.Advance(absl::Milliseconds(1000));  // t = 3 s: expired
  r->Tick();
  EXPECT_FALSE(r->Pick(Pool::kDecode, 1));
  // ... then the router stalls: d0 had no lease when the stall began, so it gets none.
  clock_.Advance(absl::Seconds(4));
  EXPECT_FALSE(r->Pick(Pool::kDecode, 1));
  EXPECT_EQ(r->Tick(), absl::Seconds(4));
  EXPECT_EQ(r->ExpireLeases(), std::vector<std::string>{"d0"});
}

TEST_F(RegistryTest, WithoutStallDetectionAGapIsNotAStall) {
  auto r = Make();  // stall_after infinite: no ticks needed, leases run on the clock alone
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(r->Tick(), absl::ZeroDuration());
  EXPECT_EQ(r->ExpireLeases(), std::vector<std::string>{"d0"});
}

TEST_F(RegistryTest, DrainingWorkerGetsNoNewWorkButKeepsItsCount) {
  auto r = Make();
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE, 1000)).ok());
  ASSERT_TRUE(r->Register(Reg("d1", v1::WORKER_ROLE_DECODE, 10)).ok());
  Assignment held = r->Pick(Pool::kDecode, 1);
  ASSERT_EQ(held.worker_id(), "d0");  // most free blocks
  ASSERT_TRUE(r->Heartbeat(Beat("d0", 999, 1, /*draining=*/true)));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r->Pick(Pool::kDecode, 1).worker_id(), "d1");
  // A later heartbeat without the flag does not undo draining.
  ASSERT_TRUE(r->Heartbeat(Beat("d0", 999, 1, false)));
  EXPECT_EQ(r->Pick(Pool::kDecode, 1).worker_id(), "d1");
  std::vector<v1::WorkerInfo> list = r->List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_TRUE(list[0].draining());
  EXPECT_EQ(list[0].router_inflight(), 1);
  held.Release();
  EXPECT_EQ(r->List()[0].router_inflight(), 0);
  // The only worker draining: nobody can serve.
  ASSERT_TRUE(r->Deregister("d1"));
  EXPECT_FALSE(r->Deregister("d1"));
  EXPECT_FALSE(r->Pick(Pool::kDecode, 1));
  EXPECT_EQ(r->Plan(), PlanKind::kNone);
}

TEST_F(RegistryTest, PlanPrefersDisaggregatedAndFallsBackToColocated) {
  auto r = Make();
  EXPECT_EQ(r->Plan(), PlanKind::kNone);
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  EXPECT_EQ(r->Plan(), PlanKind::kNone);  // decode alone cannot prefill
  ASSERT_TRUE(r->Register(Reg("c0", v1::WORKER_ROLE_BOTH)).ok());
  EXPECT_EQ(r->Plan(), PlanKind::kColocated);
  ASSERT_TRUE(r->Register(Reg("p0", v1::WORKER_ROLE_PREFILL)).ok());
  EXPECT_EQ(r->Plan(), PlanKind::kDisaggregated);
  // Pools hold their exact role only.
  EXPECT_EQ(r->Pick(Pool::kPrefill, 0).worker_id(), "p0");
  EXPECT_EQ(r->Pick(Pool::kColocated, 1).worker_id(), "c0");
  ASSERT_TRUE(r->Heartbeat(Beat("p0", 0, 0, /*draining=*/true)));
  EXPECT_EQ(r->Plan(), PlanKind::kColocated);
}

TEST_F(RegistryTest, LeastLoadDecodeFollowsFreeBlocksIncludingUnreportedPicks) {
  auto r = Make();
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE, 100)).ok());
  ASSERT_TRUE(r->Register(Reg("d1", v1::WORKER_ROLE_DECODE, 100)).ok());
  ASSERT_TRUE(r->Heartbeat(Beat("d0", 100)));
  ASSERT_TRUE(r->Heartbeat(Beat("d1", 70)));
  Assignment a = r->Pick(Pool::kDecode, 40);
  EXPECT_EQ(a.worker_id(), "d0");  // 100 free vs 70
  Assignment b = r->Pick(Pool::kDecode, 40);
  EXPECT_EQ(b.worker_id(), "d1");  // d0 is now estimated at 60 free
  Assignment c = r->Pick(Pool::kDecode, 10);
  EXPECT_EQ(c.worker_id(), "d0");  // 60 vs 30
  // A heartbeat replaces the estimate with the worker's report.
  ASSERT_TRUE(r->Heartbeat(Beat("d1", 95)));
  EXPECT_EQ(r->Pick(Pool::kDecode, 1).worker_id(), "d1");
}

TEST_F(RegistryTest, LeastLoadTiesGoToFewestInFlightThenRotate) {
  auto r = Make();
  for (const char* id : {"d0", "d1", "d2"}) {
    ASSERT_TRUE(r->Register(Reg(id, v1::WORKER_ROLE_DECODE, 100)).ok());
  }
  // Zero-block picks leave the free estimate equal, so in-flight counts decide.
  std::vector<Assignment> held;
  for (int i = 0; i < 3; ++i) held.push_back(r->Pick(Pool::kDecode, 0));
  EXPECT_EQ(held[0].worker_id(), "d0");
  EXPECT_EQ(held[1].worker_id(), "d1");
  EXPECT_EQ(held[2].worker_id(), "d2");
  held[1].Release();
  EXPECT_EQ(r->Pick(Pool::kDecode, 0).worker_id(), "d1");  // the one with nothing in flight
  held.clear();
  // All idle: the least recently picked goes first.
  EXPECT_EQ(r->Pick(Pool::kDecode, 0).worker_id(), "d0");
}

TEST_F(RegistryTest, LeastLoadPrefillCountsInFlightThenReportedQueue) {
  auto r = Make();
  ASSERT_TRUE(r->Register(Reg("p0", v1::WORKER_ROLE_PREFILL)).ok());
  ASSERT_TRUE(r->Register(Reg("p1", v1::WORKER_ROLE_PREFILL)).ok());
  v1::HeartbeatRequest busy = Beat("p0", 0, /*running=*/3);
  busy.mutable_stats()->set_waiting(2);
  ASSERT_TRUE(r->Heartbeat(busy));
  Assignment a = r->Pick(Pool::kPrefill, 0);
  EXPECT_EQ(a.worker_id(), "p1");  // p0 reports 5 queued
  Assignment b = r->Pick(Pool::kPrefill, 0);
  EXPECT_EQ(b.worker_id(), "p0");  // p1 has one in flight from this router
  absl::flat_hash_set<std::string> exclude = {"p0"};
  EXPECT_EQ(r->Pick(Pool::kPrefill, 0, exclude).worker_id(), "p1");
  exclude.insert("p1");
  EXPECT_FALSE(r->Pick(Pool::kPrefill, 0, exclude));
}

TEST_F(RegistryTest, RoundRobinRotatesWhateverTheLoad) {
  auto r = Make(Policy::kRoundRobin);
  for (const char* id : {"p0", "p1", "p2"}) {
    ASSERT_TRUE(r->Register(Reg(id, v1::WORKER_ROLE_PREFILL)).ok());
  }
  v1::HeartbeatRequest busy = Beat("p1", 0, 50);
  ASSERT_TRUE(r->Heartbeat(busy));
  std::vector<std::string> order;
  std::vector<Assignment> held;
  for (int i = 0; i < 7; ++i) {
    held.push_back(r->Pick(Pool::kPrefill, 0));
    order.push_back(held.back().worker_id());
  }
  EXPECT_EQ(order, (std::vector<std::string>{"p0", "p1", "p2", "p0", "p1", "p2", "p0"}));
}

TEST_F(RegistryTest, ReRegistrationStartsFreshCounts) {
  auto r = Make();
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  Assignment old = r->Pick(Pool::kDecode, 1);
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());  // restarted
  Assignment fresh = r->Pick(Pool::kDecode, 1);
  old.Release();  // counts against the old registration: must not touch the new one
  EXPECT_EQ(r->List()[0].router_inflight(), 1);
  fresh.Release();
  EXPECT_EQ(r->List()[0].router_inflight(), 0);
}

// The prefill backlog the TTFT prediction reads: counted from StartBacklog to EndBacklog (or
// the assignment's end, or a move), on the registration it was started on, with the worker's
// fitted cost from its last heartbeat.
TEST_F(RegistryTest, BacklogCountsPrefillsInFlightWithTheWorkersCost) {
  auto r = Make();
  ASSERT_TRUE(r->Register(Reg("p0", v1::WORKER_ROLE_PREFILL)).ok());
  ASSERT_TRUE(r->Register(Reg("p1", v1::WORKER_ROLE_PREFILL)).ok());
  ASSERT_TRUE(r->Register(Reg("d0", v1::WORKER_ROLE_DECODE)).ok());
  v1::HeartbeatRequest hb = Beat("p0", 100);
  hb.mutable_stats()->mutable_step_cost()->set_prefill_token_s(2e-5);
  hb.mutable_stats()->mutable_step_cost()->set_intercept_s(3e-4);
  ASSERT_TRUE(r->Heartbeat(hb));
  Assignment a = r->Pick(Pool::kPrefill, 0, {"p1"});
  Assignment b = r->Pick(Pool::kPrefill, 0, {"p1"});
  ASSERT_EQ(a.worker_id(), "p0");
  a.StartBacklog(100);
  b.StartBacklog(40);
  b.StartBacklog(50);  // replaces its first
  std::vector<WorkerRegistry::Load> loads = r->Loads(Pool::kPrefill);
  ASSERT_EQ(loads.size(), 2u);  // prefill workers only
  EXPECT_EQ(loads[0].worker_id, "p0");
  EXPECT_EQ(loads[0].backlog_tokens, 150);
  EXPECT_EQ(loads[0].backlog_requests, 2);
  EXPECT_DOUBLE_EQ(loads[0].cost.prefill_token_s(), 2e-5);
  EXPECT_EQ(loads[1].backlog_tokens, 0);
  a.EndBacklog();
  a.EndBacklog();  // once only
  EXPECT_EQ(r->Loads(Pool::kPrefill)[0].backlog_tokens, 50);
  Assignment moved = std::move(b);
  EXPECT_EQ(r->Loads(Pool::kPrefill)[0].backlog_tokens, 50);
  moved.Release();
  EXPECT_EQ(r->Loads(Pool::kPrefill)[0].backlog_tokens, 0);
  EXPECT_EQ(r->Loads(Pool::kPrefill)[0].backlog_requests, 0);
  // A restarted worker starts from nothing; the old registration's end does not touch it.
  Assignment old = r->Pick(Pool::kPrefill, 0, {"p1"});
  old.StartBacklog(70);
  ASSERT_TRUE(r->Register(Reg("p0", v1::WORKER_ROLE_PREFILL)).ok());
  EXPECT_EQ(r->Loads(Pool::kPrefill)[0].backlog_tokens, 0);
  old.Release();
  EXPECT_EQ(r->Loads(Pool::kPrefill)[0].backlog_tokens, 0);
}

TEST_F(RegistryTest, ConcurrentPicksAndReleasesBalanceOut) {
  auto r = Make();
  for (const char* id : {"d0", "d1", "d2", "d3"}) {
    ASSERT_TRUE(r->Register(Reg(id, v1::WORKER_ROLE_DECODE, 1000)).ok());
  }
  std::vector<std::thread> threads;
  std::atomic<int> picked{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        Assignment a = r->Pick(Pool::kDecode, 0);
        if (a) picked++;
        if (i % 50 == 0) r->Heartbeat(Beat(a.worker_id(), 1000));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(picked.load(), 2000);
  uint64_t routed = 0;
  for (const v1::WorkerInfo& w : r->List()) {
    EXPECT_EQ(w.router_inflight(), 0) << w.worker_id();
    routed += w.requests_routed();
    EXPECT_GT(w.requests_routed(), 100u) << "selection should spread the load";
  }
  EXPECT_EQ(routed, 2000u);
}

// The pick order is kept incrementally (an index per pool); a scan over the test's own record
// of every worker must agree with it at every pick, through random registrations, heartbeats,
// releases, drains, deregistrations and lease expiries.
TEST_F(RegistryTest, IndexedPickAgreesWithAScanThroughRandomChanges) {
  for (Policy policy : {Policy::kLeastLoad, Policy::kRoundRobin}) {
    auto r = Make(policy);
    struct Ref {
      v1::WorkerRole role;
      int64_t total = 0, free = 0, running = 0, waiting = 0, pending = 0;
      bool stats = false, draining = false;
      int inflight = 0;
      uint64_t last_pick = 0;
      absl::Time expiry;
      int gen = 0;  // a release counts only against the registration it was picked from
    };
    std::map<std::string, Ref> ref;
    struct Held {
      Assignment a;
      std::string id;
      int gen;
    };
    std::vector<Held> held;
    std::mt19937 rng(7);
    uint64_t seq = 0;
    int gens = 0;
    auto pick_ref = [&](Pool pool, const absl::flat_hash_set<std::string>& exclude) {
      std::string best;
      std::tuple<int64_t, int64_t, int64_t, uint64_t> best_key;
      for (const auto& [id, w] : ref) {
        const bool in = pool == Pool::kPrefill   ? w.role == v1::WORKER_ROLE_PREFILL
                        : pool == Pool::kDecode ? w.role == v1::WORKER_ROLE_DECODE
                                                : w.role == v1::WORKER_ROLE_BOTH;
        if (!in || w.draining || clock_.Now() >= w.expiry || exclude.contains(id)) continue;
        std::tuple<int64_t, int64_t, int64_t, uint64_t> key;
        if (policy == Policy::kRoundRobin) {
          key = {0, 0, 0, w.last_pick};
        } else if (pool != Pool::kPrefill) {
          key = {-((w.stats ? w.free : w.total) - w.pending), w.inflight,
                 w.stats ? w.running : 0, w.last_pick};
        } else {
          key = {w.inflight, w.stats ? w.running + w.waiting : 0, 0, w.last_pick};
        }
        if (best.empty() || key < best_key) {
          best = id;
          best_key = key;
        }
      }
      return best;
    };
    const v1::WorkerRole roles[] = {v1::WORKER_ROLE_PREFILL, v1::WORKER_ROLE_DECODE,
                                    v1::WORKER_ROLE_BOTH};
    int picks = 0;
    for (int step = 0; step < 4000; ++step) {
      const int op = static_cast<int>(rng() % 100);
      const std::string id = "w" + std::to_string(rng() % 12);
      if (op < 8) {  // (re-)register
        const v1::WorkerRole role = roles[rng() % 3];
        const int blocks = static_cast<int>(rng() % 50);
        ASSERT_TRUE(r->Register(Reg(id, role, blocks)).ok());
        ref[id] = Ref{role, blocks};
        ref[id].expiry = clock_.Now() + absl::Seconds(3);
        ref[id].gen = ++gens;
      } else if (op < 25) {  // heartbeat, sometimes without stats or draining
        v1::HeartbeatRequest h = Beat(id, static_cast<int>(rng() % 50),
                                      static_cast<int>(rng() % 4), rng() % 20 == 0);
        h.mutable_stats()->set_waiting(static_cast<int>(rng() % 3));
        if (rng() % 4 == 0) h.clear_stats();
        const bool known = r->Heartbeat(h);
        auto it = ref.find(id);
        const bool live = it != ref.end() && clock_.Now() < it->second.expiry;
        ASSERT_EQ(known, live) << id;
        if (it != ref.end() && !live) ref.erase(it);
        if (live) {
          Ref& w = it->second;
          w.expiry = clock_.Now() + absl::Seconds(3);
          if (h.has_stats()) {
            w.stats = true;
            w.free = h.stats().kv_blocks_free();
            w.running = h.stats().running();
            w.waiting = h.stats().waiting();
            w.pending = 0;
          }
          w.draining = w.draining || h.draining();
        }
      } else if (op < 30) {
        EXPECT_EQ(r->Deregister(id), ref.erase(id) > 0);
      } else if (op < 33) {
        clock_.Advance(absl::Milliseconds(rng() % 1500));
      } else if (op < 60 && !held.empty()) {  // release one
        const size_t i = rng() % held.size();
        auto it = ref.find(held[i].id);
        if (it != ref.end() && it->second.gen == held[i].gen) it->second.inflight--;
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        const Pool pool = static_cast<Pool>(rng() % 3);
        absl::flat_hash_set<std::string> exclude;
        if (rng() % 3 == 0) exclude.insert("w" + std::to_string(rng() % 12));
        const int64_t blocks = static_cast<int64_t>(rng() % 5);
        const std::string want = pick_ref(pool, exclude);
        Assignment a = r->Pick(pool, blocks, exclude);
        ASSERT_EQ(a ? a.worker_id() : "", want) << "step " << step;
        if (!a) continue;
        ++picks;
        Ref& w = ref[want];
        w.inflight++;
        w.last_pick = ++seq;
        if (pool != Pool::kPrefill) w.pending += blocks;
        held.push_back(Held{std::move(a), want, w.gen});
      }
    }
    EXPECT_GT(picks, 500);
  }
}

}  // namespace
}  // namespace tandem::router
