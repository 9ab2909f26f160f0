// End-to-end: errors survive the RPC boundary. A real weightd and real
// weightctl processes: a message that quotes a long user string arrives as
// the same one line `weightctl inspect` prints, and huge user strings in any
// request are refused or elided, never lost as RESOURCE_EXHAUSTED.
#include <grpcpp/grpcpp.h>

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using testing::CommandResult;
using testing::DaemonProcess;

std::shared_ptr<grpc::Channel> Channel(const DaemonProcess& d) {
  return grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials());
}

grpc::Status Load(v1::Weightd::Stub& stub, const v1::LoadModelRequest& request) {
  grpc::ClientContext context;
  auto reader = stub.LoadModel(&context, request);
  v1::LoadModelProgress progress;
  while (reader->Read(&progress)) {
  }
  return reader->Finish();
}

// Regression (issue 11): `weightctl load` printed "received initial metadata
// size exceeds limit" (and exited 1) where `weightctl inspect` named the
// duplicate tensor.
TEST(ErrorsE2E, ALongDuplicateTensorNameGivesTheSameLineThroughLoadAsInspect) {
  DaemonProcess d({"--mlock", "false", "--device-backend", "none"});
  std::string name = std::string(96, 'a') + std::string(19'808, 'm') + std::string(96, 'z');
  std::string header = "{\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"" + name +
                       "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}";
  testing::WriteFile(d.models_dir() + "/dup.safetensors", testing::FileImage(header, "ab"));
  std::string expected = "weightctl: dup.safetensors: tensor name '" + std::string(96, 'a') + "…(20000 bytes)…" +
                         std::string(96, 'z') + "' appears twice\n";
  CommandResult inspect = testing::RunCommand({testing::WeightctlBinary(), "inspect", d.models_dir() + "/dup.safetensors"});
  EXPECT_EQ(inspect.code, 2);
  EXPECT_EQ(inspect.err, expected);
  CommandResult load = d.Ctl({"load", "dup", "dup.safetensors"});
  EXPECT_EQ(load.code, 2);
  EXPECT_EQ(load.err, expected);
  EXPECT_EQ(nlohmann::json::parse(d.Ctl({"ls", "--json"}).out)["models"], nlohmann::json::array());  // nothing half-loaded
}

// A 1 MiB model name is refused by its length on LoadModel too (GetManifest,
// Attach and UnloadModel: tests/e2e/limits_e2e_test.cc), and a 1 MiB lease
// id is not found without being echoed.
TEST(ErrorsE2E, AHugeModelNameOrLeaseIdIsRefusedNotEchoed) {
  DaemonProcess d({"--mlock", "false", "--device-backend", "none"});
  auto stub = v1::Weightd::NewStub(Channel(d));
  std::string huge(1 << 20, 'x');
  v1::LoadModelRequest load;
  load.set_name(huge);
  load.set_checkpoint_path("m.safetensors");
  grpc::Status loaded = Load(*stub, load);
  EXPECT_EQ(loaded.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(loaded.error_message(), "model name must be 1 to 128 characters, got 1048576");

  grpc::ClientContext context;
  v1::DetachRequest detach;
  detach.set_lease_id(huge);
  v1::DetachResponse detached;
  grpc::Status s = stub->Detach(&context, detach, &detached);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "unknown or expired lease id");

  grpc::ClientContext health_context;
  grpc::health::v1::HealthCheckRequest check;
  check.set_service(huge);
  grpc::health::v1::HealthCheckResponse health;
  grpc::Status h = grpc::health::v1::Health::NewStub(Channel(d))->Check(&health_context, check, &health);
  EXPECT_EQ(h.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << h.error_message();  // gRPC's health service
}

// The checkpoint path (up to 4096 bytes) and device names are elided where
// the message quotes them.
TEST(ErrorsE2E, ALongCheckpointPathOrDeviceNameIsElided) {
  DaemonProcess d({"--mlock", "false", "--device-backend", "emulated"});
  testing::SafetensorsBuilder builder;
  testing::WriteFile(d.models_dir() + "/m.safetensors", builder.Add("a", "U8", {2}, "ab").Build());
  auto stub = v1::Weightd::NewStub(Channel(d));

  std::string path;
  while (path.size() < 4000) path += "abcdefghi/";  // components of 9 bytes: the missing folder, not its name length
  v1::LoadModelRequest far;
  far.set_name("m");
  far.set_checkpoint_path(path);
  grpc::Status missing = Load(*stub, far);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(missing.error_message(), path.substr(0, 96) + "…(4000 bytes)…" + path.substr(4000 - 96) +
                                         ": no such checkpoint file or folder");

  v1::LoadModelRequest device;
  device.set_name("m");
  device.set_checkpoint_path("m.safetensors");
  device.add_devices(std::string(1 << 20, 'g'));
  grpc::Status no_device = Load(*stub, device);
  EXPECT_EQ(no_device.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(no_device.error_message(), "no device '" + std::string(96, 'g') + "…(1048576 bytes)…" +
                                           std::string(96, 'g') +
                                           "' on the emulated backend (available: 0=GPU-emulated-0, 1=GPU-emulated-1, "
                                           "2=GPU-emulated-2, 3=GPU-emulated-3, 4=GPU-emulated-4, 5=GPU-emulated-5, "
                                           "6=GPU-emulated-6, 7=GPU-emulated-7)");
}

}  // namespace
}  // namespace weightd
