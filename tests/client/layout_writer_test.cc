// Client::BeginLayout's LayoutWriter against a real daemon: how a publish
// ends (commit, abort, destruction, a refused commit), and what the client
// reports about published layouts.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/format/content_hash.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/status_matchers.h"
#include "weightd/client.h"

namespace weightd {
namespace {

using testing::DaemonProcess;

class LayoutWriterTest : public ::testing::Test {
 protected:
  LayoutWriterTest() : d_({"--device-backend", "emulated"}) {
    testing::WriteFile(d_.models_dir() + "/m.safetensors",
                       testing::SafetensorsBuilder().Add("w", "BF16", {2, 3}, "abcdefghijkl").Build());
    auto client = Client::Connect(d_.socket());
    EXPECT_TRUE(client.ok());
    client_ = std::move(*client);
  }
  void SetUp() override { WEIGHTD_ASSERT_OK(client_->Load("m", "m.safetensors", {}).status()); }

  // Two host tensors: "a" U8 [3] at 0, "b" F32 [2] at 256.
  static LayoutOptions Options() {
    LayoutOptions o;
    o.model = "m";
    o.key = "k";
    o.identity = {{"engine", "test"}};
    o.tensors = {{"a", "U8", {3}, {}, Location::kHost}, {"b", "F32", {2}, {}, Location::kHost}};
    return o;
  }
  static void Fill(LayoutWriter& w) {
    std::memcpy(w.Find("a")->data, "xyz", 3);
    std::memcpy(w.Find("b")->data, "01234567", 8);
  }
  std::vector<LayoutSummary> Layouts() {
    auto models = client_->List();
    return models.ok() && !models->empty() ? (*models)[0].layouts : std::vector<LayoutSummary>{};
  }

  DaemonProcess d_;
  std::unique_ptr<Client> client_;
};

TEST_F(LayoutWriterTest, ACommittedLayoutIsListedAndAttached) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(Options()));
  EXPECT_EQ(w.model(), "m");
  EXPECT_EQ(w.generation(), 1u);
  EXPECT_EQ(w.rank(), 0u);
  EXPECT_EQ(w.bytes_staged(), 512u);
  ASSERT_EQ(w.tensors().size(), 2u);
  EXPECT_EQ(w.tensors()[1].info.offset, 256u);
  EXPECT_EQ(w.Find("nope"), nullptr);
  EXPECT_EQ(std::string(w.Find("a")->data, 3), std::string(3, '\0'));  // staged zero-filled
  Fill(w);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutCommitInfo info, w.Commit());
  EXPECT_EQ(info.layout.key, "k");
  EXPECT_EQ(info.layout.tensor_count, 2u);
  EXPECT_EQ(info.layout.host_bytes, 512u);
  EXPECT_EQ(info.layout.identity, (std::map<std::string, std::string>{{"engine", "test"}}));
  EXPECT_EQ(w.Commit().status(), absl::FailedPreconditionError("this layout publish was already committed or aborted"));

  std::vector<LayoutSummary> layouts = Layouts();
  ASSERT_EQ(layouts.size(), 1u);
  EXPECT_EQ(layouts[0].fingerprint, info.layout.fingerprint);
  EXPECT_EQ(layouts[0].generation, 1u);
  EXPECT_EQ(layouts[0].leases, 0u);

  AttachOptions options;
  options.layout = "k";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel m, client_->Attach("m", 0, options));
  EXPECT_EQ(m.manifest().layout, "k");
  EXPECT_EQ(m.fingerprint(), info.layout.fingerprint);
  ASSERT_EQ(m.tensors().size(), 2u);
  EXPECT_EQ(std::string(static_cast<const char*>(m.Find("a")->data), 3), "xyz");
  EXPECT_EQ(std::string(static_cast<const char*>(m.Find("b")->data), 8), "01234567");
  EXPECT_EQ(m.Find("b")->info->dtype, "F32");
  EXPECT_EQ(m.Find("b")->info->content_hash.size(), 16u);
  EXPECT_EQ(Layouts()[0].leases, 1u);
}

TEST_F(LayoutWriterTest, AbortAndDestructionEndThePublish) {
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(Options()));
    WEIGHTD_EXPECT_OK(w.Abort());
    WEIGHTD_EXPECT_OK(w.Abort());  // once ended: OK
    EXPECT_EQ(w.tensors()[0].data, nullptr);
    EXPECT_EQ(w.Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(Options()));
    Fill(w);
  }  // destroyed uncommitted: its fd-socket connection closes, the daemon aborts
  LayoutOptions o = Options();
  o.wait_seconds = 60;  // the daemon sees the closed connection on its own thread
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(o));
  EXPECT_FALSE(w.published_by_other());
  EXPECT_EQ(std::string(w.Find("a")->data, 3), std::string(3, '\0'));  // fresh memory
  EXPECT_TRUE(Layouts().empty());
}

TEST_F(LayoutWriterTest, AMalformedExpectedHashLeavesThePublishOpen) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(Options()));
  Fill(w);
  EXPECT_EQ(w.Commit({{"a", "xyz"}}).status(),
            absl::InvalidArgumentError("the expected hash of tensor 'a' must be 16 hex digits, got 'xyz'"));
  EXPECT_EQ(w.Commit({{"c", "0000000000000000"}}).status(),
            absl::InvalidArgumentError("an expected hash names tensor 'c', which is not in this layout"));
  ASSERT_NE(w.Find("a")->data, nullptr);  // mapped again
  EXPECT_EQ(std::string(w.Find("a")->data, 3), "xyz");
  WEIGHTD_EXPECT_OK(w.Commit().status());
}

TEST_F(LayoutWriterTest, AHashThatDiffersEndsThePublishWithoutALayout) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(Options()));
  Fill(w);
  EXPECT_EQ(w.Commit({{"a", "0000000000000000"}}).status(),
            absl::FailedPreconditionError(absl::StrCat("the layout is not published: layout tensor 'a' has content hash ",
                                                       ContentHashHex(TensorContentHash("xyz", 3)),
                                                       " but the writer expected 0000000000000000")));
  EXPECT_EQ(w.Find("a")->data, nullptr);  // sealed: cannot be mapped writable again
  EXPECT_TRUE(Layouts().empty());
  EXPECT_EQ(w.Commit().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LayoutWriterTest, BytesOutsideEveryTensorAreRefused) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(Options()));
  Fill(w);
  w.Find("a")->data[100] = 1;  // padding between "a" (3 bytes at 0) and "b" (at 256)
  EXPECT_EQ(w.Commit().status(),
            absl::FailedPreconditionError(
                "the layout is not published: staged layout segment 0: byte 100 lies outside every tensor and is "
                "not zero (padding between tensors); a writer may write its tensors' bytes only"));
  EXPECT_TRUE(Layouts().empty());
}

TEST_F(LayoutWriterTest, DeviceTensorsNeedAGpuAndDropNamesWhatExists) {
  LayoutOptions o = Options();
  o.tensors[1].location = Location::kDevice;
  EXPECT_EQ(client_->BeginLayout(o).status(),
            absl::FailedPreconditionError("rank 0 of model 'm' has no GPU in its plan; name the GPU of the layout's "
                                          "DEVICE tensors (gpu_uuid)"));
  o.gpu_uuid = "GPU-emulated-0";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutWriter w, client_->BeginLayout(o));
  Fill(w);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LayoutCommitInfo info, w.Commit());
  EXPECT_EQ(info.layout.host_bytes, 256u);
  ASSERT_EQ(info.layout.device_bytes.count("GPU-emulated-0"), 1u);

  EXPECT_EQ(client_->DropLayout("m", "other").status(),
            absl::NotFoundError("model 'm' generation 1 has no layout 'other'; it has: 'k@rank0'"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(uint32_t dropped, client_->DropLayout("m", "k"));
  EXPECT_EQ(dropped, 1u);
  EXPECT_TRUE(Layouts().empty());
}

}  // namespace
}  // namespace weightd
