// The daemon and model of the pinning tests (attach_pin_test.cc,
// attach_pin_fake_driver_test.cc).
#ifndef WEIGHTD_TESTS_CLIENT_PIN_FIXTURE_H_
#define WEIGHTD_TESTS_CLIENT_PIN_FIXTURE_H_

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "weightd/client.h"

namespace weightd::testing {

inline constexpr uint64_t kPage = 4096;

// "table.a" (5000 B) and "table.b" (3 pages) on the host, "dev" on an emulated GPU.
class AttachPinTest : public ::testing::Test {
 protected:
  AttachPinTest() : d_({"--device-backend", "emulated"}) {
    testing::WriteFile(d_.models_dir() + "/m.safetensors",
                       testing::SafetensorsBuilder()
                           .Add("table.a", "U8", {5000}, std::string(5000, 'a'))
                           .Add("table.b", "U8", {3 * kPage}, std::string(3 * kPage, 'b'))
                           .Add("dev", "U8", {64}, std::string(64, 'd'))
                           .Build());
    auto client = Client::Connect(d_.socket());
    EXPECT_TRUE(client.ok());
    client_ = std::move(*client);
    LoadOptions options;
    options.host_resident_patterns = {"table"};
    options.devices = {"GPU-emulated-0"};
    load_ = client_->Load("m", "m.safetensors", options).status();
  }
  uint32_t Leases() {
    absl::StatusOr<std::vector<ModelSummary>> models = client_->List();
    return models.ok() && !models->empty() ? models->front().leases : 99;
  }
  DaemonProcess d_;
  std::unique_ptr<Client> client_;
  absl::Status load_;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_CLIENT_PIN_FIXTURE_H_
