// The tables the registry composes (server/registry/lease_table.h,
// server/registry/update_table.h) on their own, and the commit decision
// (DecideCommit, server/update/update.h) for every case it distinguishes.
#include <chrono>
#include <memory>
#include <string>

#include "common/memory/host_segment.h"
#include "gtest/gtest.h"
#include "server/registry/lease_table.h"
#include "server/registry/update_table.h"
#include "server/update/update.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using Code = absl::StatusCode;
using Clock = std::chrono::steady_clock;

std::shared_ptr<ModelGeneration> Generation(const std::string& name, uint64_t generation) {
  auto m = std::make_shared<ModelGeneration>();
  m->request.name = name;
  m->generation = generation;
  return m;
}

bool IsHex(const std::string& s) { return s.find_first_not_of("0123456789abcdef") == std::string::npos; }

TEST(LeaseTable, AddClaimRemoveCountsTheGenerationsLeases) {
  LeaseTable table;
  auto m = Generation("m", 1);
  Clock::time_point t0{};
  LeaseTable::Lease a = table.Add(m, 0, t0, t0 + std::chrono::seconds(10));
  LeaseTable::Lease b = table.Add(m, 1, t0, t0 + std::chrono::seconds(10));
  EXPECT_EQ(a.id.size(), 32u);
  EXPECT_TRUE(IsHex(a.id));
  EXPECT_NE(a.id, b.id);
  EXPECT_EQ(m->leases.load(), 2);
  EXPECT_EQ(table.size(), 2u);

  absl::StatusOr<LeaseTable::Lease> claimed = table.Claim(a.id);
  ASSERT_TRUE(claimed.ok());
  EXPECT_TRUE(claimed->claimed);
  EXPECT_EQ(claimed->rank, 0u);
  EXPECT_THAT(table.Claim(a.id), StatusIs(Code::kFailedPrecondition, "lease already claimed on another connection"));
  EXPECT_THAT(table.Claim("0123"), StatusIs(Code::kNotFound, "unknown or expired lease id"));

  LeaseTable::Removed removed = table.Remove(a.id);
  EXPECT_EQ(removed.model, m);
  EXPECT_EQ(removed.leases_left, 1);
  EXPECT_EQ(m->leases.load(), 1);
  EXPECT_FALSE(table.Contains(a.id));
  EXPECT_TRUE(table.Contains(b.id));
  EXPECT_EQ(table.Remove(a.id).model, nullptr);  // unknown: nothing
  EXPECT_EQ(m->leases.load(), 1);
}

TEST(LeaseTable, OnlyUnclaimedLeasesPastTheirDeadlineExpire) {
  LeaseTable table;
  auto m = Generation("m", 1);
  Clock::time_point t0{};
  LeaseTable::Lease early = table.Add(m, 0, t0, t0 + std::chrono::seconds(1));
  LeaseTable::Lease late = table.Add(m, 0, t0, t0 + std::chrono::seconds(5));
  LeaseTable::Lease claimed = table.Add(m, 0, t0, t0 + std::chrono::seconds(1));
  ASSERT_TRUE(table.Claim(claimed.id).ok());
  std::vector<LeaseTable::Removed> expired = table.RemoveExpired(t0 + std::chrono::seconds(2));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].leases_left, 2);
  EXPECT_FALSE(table.Contains(early.id));
  EXPECT_TRUE(table.Contains(late.id));
  EXPECT_TRUE(table.Contains(claimed.id));
}

TEST(LeaseTable, RemoveOfTakesTheNamesLeasesExceptThoseKept) {
  LeaseTable table;
  auto m1 = Generation("m", 1), m2 = Generation("m", 2), other = Generation("other", 3);
  Clock::time_point t0{};
  LeaseTable::Lease keep = table.Add(m1, 0, t0, t0);
  table.Add(m1, 0, t0, t0);
  table.Add(m2, 0, t0, t0);
  LeaseTable::Lease not_m = table.Add(other, 0, t0, t0);
  std::vector<LeaseTable::Removed> removed =
      table.RemoveOf("m", [&](const LeaseTable::Lease& lease) { return lease.id == keep.id; });
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_EQ(m1->leases.load(), 1);
  EXPECT_EQ(m2->leases.load(), 0);
  EXPECT_EQ(other->leases.load(), 1);
  EXPECT_TRUE(table.Contains(keep.id));
  EXPECT_TRUE(table.Contains(not_m.id));
  EXPECT_EQ(table.size(), 2u);
}

std::shared_ptr<StagedUpdate> Staged(uint64_t bytes) {
  auto staged = std::make_shared<StagedUpdate>();
  absl::StatusOr<std::unique_ptr<HostSegment>> memory = HostSegment::Create("update-test", bytes);
  EXPECT_TRUE(memory.ok()) << memory.status();
  staged->segments.push_back({0, std::move(*memory)});
  return staged;
}

TEST(UpdateTable, OneOpenUpdatePerNameWithAnIdNoLeaseHas) {
  UpdateTable table;
  Clock::time_point t0{};
  absl::StatusOr<std::string> id = table.Open("m", t0);
  ASSERT_TRUE(id.ok());
  ASSERT_EQ(id->size(), 7u + 32u);
  EXPECT_EQ(id->substr(0, 7), "update-");
  EXPECT_TRUE(IsHex(id->substr(7)));
  EXPECT_THAT(table.Open("m", t0),
              StatusIs(Code::kAlreadyExists, "model 'm' already has an open update (one writer per model at a time)"));
  EXPECT_TRUE(table.Open("n", t0).ok());
  EXPECT_EQ(table.NameOf(*id), "m");
  EXPECT_TRUE(table.IsOpen(*id));
}

TEST(UpdateTable, AnUpdateIsClaimedOnceAndOnlyOnceStaged) {
  UpdateTable table;
  Clock::time_point t0{};
  std::string id = table.Open("m", t0).value();
  EXPECT_THAT(table.Claim(id), StatusIs(Code::kNotFound, "unknown or ended update id"));  // still staging
  ASSERT_TRUE(table.SetStaged(id, Staged(4096), t0).ok());
  EXPECT_EQ(table.StagedBytes(), 4096u);
  EXPECT_TRUE(table.Claim(id).ok());
  EXPECT_THAT(table.Claim(id), StatusIs(Code::kFailedPrecondition, "update already claimed on another connection"));
  EXPECT_THAT(table.Claim("update-0"), StatusIs(Code::kNotFound, "unknown or ended update id"));
}

TEST(UpdateTable, ACommittingUpdateIsNotEndedByAnUnloadOrAnAbortOrExpiryButRemembersTheFirstReason) {
  UpdateTable table;
  Clock::time_point t0{};
  std::string id = table.Open("m", t0).value();
  ASSERT_TRUE(table.SetStaged(id, Staged(4096), t0).ok());
  ASSERT_TRUE(table.BeginCommit(id).ok());
  EXPECT_THAT(table.BeginCommit(id), StatusIs(Code::kFailedPrecondition, "this update is already being committed"));
  EXPECT_EQ(table.AbortRequested(id), std::nullopt);
  EXPECT_THAT(table.Abort(id, "writer_disconnected"),
              StatusIs(Code::kFailedPrecondition, "this update is being committed"));
  EXPECT_FALSE(table.EndOf("m", "unloaded").has_value());
  EXPECT_EQ(table.AbortRequested(id), "writer_disconnected");  // the first reason stays
  EXPECT_TRUE(table.Expire(t0 + std::chrono::hours(1)).empty());
  EXPECT_TRUE(table.IsOpen(id));
  absl::StatusOr<UpdateTable::Ended> ended = table.End(id);  // the commit ends it
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->name, "m");
  EXPECT_NE(ended->staged, nullptr);
  EXPECT_FALSE(table.IsOpen(id));
  EXPECT_EQ(table.StagedBytes(), 0u);
  EXPECT_TRUE(table.Open("m", t0).ok());  // the name is free again
}

TEST(UpdateTable, AnUpdateNotCommittingIsAbortedAtOnce) {
  UpdateTable table;
  Clock::time_point t0{};
  std::string id = table.Open("m", t0).value();
  ASSERT_TRUE(table.SetStaged(id, Staged(4096), t0).ok());
  ASSERT_TRUE(table.BeginCommit(id).ok());
  table.Reopen(id);  // that commit failed; the writer may retry, or abort
  absl::StatusOr<UpdateTable::Ended> ended = table.Abort(id, "aborted_by_writer");
  ASSERT_TRUE(ended.ok());
  EXPECT_EQ(ended->name, "m");
  EXPECT_FALSE(table.IsOpen(id));
  EXPECT_THAT(table.Abort(id, "aborted_by_writer"), StatusIs(Code::kNotFound, "unknown or ended update id"));
}

TEST(UpdateTable, AnUpdateEndedWhileStagingRefusesItsStagedBytes) {
  UpdateTable table;
  Clock::time_point t0{};
  std::string id = table.Open("m", t0).value();
  std::optional<UpdateTable::Ended> ended = table.EndOf("m", "unloaded");  // an unload while staging
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->staged, nullptr);
  EXPECT_THAT(table.SetStaged(id, Staged(4096), t0),
              StatusIs(Code::kFailedPrecondition, "the update ended while it was being staged"));
  EXPECT_EQ(table.StagedBytes(), 0u);
}

TEST(UpdateTable, OnlyStagedUnclaimedUpdatesPastTheirDeadlineExpire) {
  UpdateTable table;
  Clock::time_point t0{};
  std::string staging = table.Open("a", t0).value();
  std::string unclaimed = table.Open("b", t0).value();
  std::string claimed = table.Open("c", t0).value();
  std::string later = table.Open("d", t0).value();
  ASSERT_TRUE(table.SetStaged(unclaimed, Staged(4096), t0 + std::chrono::seconds(1)).ok());
  ASSERT_TRUE(table.SetStaged(claimed, Staged(4096), t0 + std::chrono::seconds(1)).ok());
  ASSERT_TRUE(table.SetStaged(later, Staged(4096), t0 + std::chrono::seconds(9)).ok());
  ASSERT_TRUE(table.Claim(claimed).ok());
  std::vector<UpdateTable::Ended> expired = table.Expire(t0 + std::chrono::seconds(5));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].name, "b");
  EXPECT_TRUE(table.IsOpen(staging));
  EXPECT_TRUE(table.IsOpen(claimed));
  EXPECT_TRUE(table.IsOpen(later));
}

CommitAttempt Attempt(absl::Status error, bool sealed) {
  CommitAttempt attempt;
  attempt.outcome = error;
  attempt.sealed = sealed;
  return attempt;
}

TEST(DecideCommit, EveryCaseHasOneFate) {
  using Fate = CommitDecision::Fate;
  CommitAttempt ok;
  ok.outcome = CommitOutcome{std::make_unique<ModelGeneration>(), 1};
  ok.sealed = true;
  struct Case {
    const char* what;
    const CommitAttempt& attempt;
    bool served;
    Fate fate;
    std::string reason;
  };
  CommitAttempt label = Attempt(absl::InvalidArgumentError("version label"), false);
  CommitAttempt mapped = Attempt(absl::FailedPreconditionError("still mapped writable"), false);
  CommitAttempt oom = Attempt(absl::ResourceExhaustedError("mlock"), false);
  CommitAttempt mismatch = Attempt(absl::FailedPreconditionError("expected hash"), true);
  const Case cases[] = {
      {"verified, base still served", ok, true, Fate::kPublish, ""},
      {"verified, another generation published meanwhile", ok, false, Fate::kAbort, "superseded"},
      {"a bad label before sealing", label, true, Fate::kRetry, ""},
      {"still mapped writable", mapped, true, Fate::kRetry, ""},
      {"fixable, but the base was replaced", mapped, false, Fate::kAbort, "superseded"},
      {"an error the writer cannot fix", oom, true, Fate::kAbort, "aborted_by_writer"},
      {"a mismatch after sealing", mismatch, true, Fate::kAbort, "verification_failed"},
      {"a mismatch after sealing, base replaced", mismatch, false, Fate::kAbort, "verification_failed"},
  };
  for (const Case& c : cases) {
    CommitDecision d = DecideCommit(c.attempt, c.served);
    EXPECT_EQ(d.fate, c.fate) << c.what;
    EXPECT_EQ(d.abort_reason, c.reason) << c.what;
  }
  // An abort asked for while the commit ran ends the update unless it publishes.
  CommitDecision d = DecideCommit(mapped, true, "writer_disconnected");
  EXPECT_EQ(d.fate, Fate::kAbort);
  EXPECT_EQ(d.abort_reason, "writer_disconnected");
  d = DecideCommit(ok, false, "unloaded");
  EXPECT_EQ(d.fate, Fate::kAbort);
  EXPECT_EQ(d.abort_reason, "unloaded");
  d = DecideCommit(mismatch, true, "aborted_by_writer");
  EXPECT_EQ(d.abort_reason, "aborted_by_writer");
  d = DecideCommit(ok, true, "writer_disconnected");
  EXPECT_EQ(d.fate, Fate::kPublish);
  EXPECT_EQ(d.abort_reason, "");
}

}  // namespace
}  // namespace weightd
