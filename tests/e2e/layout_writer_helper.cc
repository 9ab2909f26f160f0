// A layout writer in its own process, for tests/e2e/layouts_e2e_test.cc:
//   layout_writer_helper SOCKET MODEL KEY RANK publish|hold [host|device]
// publishes LayoutE2ETensors (qkv on the host or on the rank's GPU) filled
// with LayoutE2EBytes for RANK, identity {engine=e2e}. `publish` commits
// and prints "committed FINGERPRINT"; `hold` writes every byte, prints
// "staged", and waits to be killed without committing. Errors: "error
// CODE: message" on stdout, exit 2.
#include <unistd.h>

#include <cstring>
#include <iostream>

#include "absl/strings/numbers.h"
#include "tests/e2e/layout_e2e_data.h"
#include "weightd/client.h"

namespace {

int Fail(const absl::Status& s) {
  std::cout << "error " << absl::StatusCodeToString(s.code()) << ": " << s.message() << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using weightd::Location;
  if (argc != 6 && argc != 7) {
    std::cerr << "usage: layout_writer_helper SOCKET MODEL KEY RANK publish|hold [host|device]\n";
    return 2;
  }
  uint32_t rank = 0;
  if (!absl::SimpleAtoi(argv[4], &rank)) return Fail(absl::InvalidArgumentError("RANK must be an integer"));
  const std::string mode = argv[5];
  const bool device = argc == 7 && std::string(argv[6]) == "device";
  absl::StatusOr<std::unique_ptr<weightd::Client>> client = weightd::Client::Connect(argv[1]);
  if (!client.ok()) return Fail(client.status());
  weightd::LayoutOptions options;
  options.model = argv[2];
  options.key = argv[3];
  options.rank = rank;
  options.identity = {{"engine", "e2e"}};
  options.tensors = weightd::testing::LayoutE2ETensors(device ? Location::kDevice : Location::kHost);
  absl::StatusOr<weightd::LayoutWriter> writer = (*client)->BeginLayout(options);
  if (!writer.ok()) return Fail(writer.status());
  for (const weightd::WritableTensor& t : writer->tensors()) {
    std::string bytes = weightd::testing::LayoutE2EBytes(t.info.name, rank, t.info.nbytes);
    std::memcpy(t.data, bytes.data(), bytes.size());
  }
  if (mode == "hold") {
    std::cout << "staged" << std::endl;
    while (true) pause();
  }
  absl::StatusOr<weightd::LayoutCommitInfo> committed = writer->Commit();
  if (!committed.ok()) return Fail(committed.status());
  std::cout << "committed " << committed->layout.fingerprint << std::endl;
  return 0;
}
