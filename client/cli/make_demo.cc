#include <ostream>

#include "absl/strings/str_format.h"
#include "client/cli/commands.h"
#include "client/cli/output.h"
#include "common/format/demo_checkpoint.h"

namespace weightd::cli {

int RunMakeDemo(const Args& args, Context& ctx) {
  absl::StatusOr<DemoPreset> preset = FindDemoPreset(args.Text("--preset").value_or("tiny"));
  if (!preset.ok()) return ReportError(absl::InvalidArgumentError(preset.status().message()), ctx.err);
  const std::string& dir = args.positional[0];
  ProgressBar bar("make-demo", true);
  absl::Status written = WriteDemoCheckpoint(dir, *preset, [&](uint64_t done, uint64_t total) { bar.Update(done, total); });
  bar.Finish();
  if (!written.ok()) return ReportError(written, ctx.err);
  uint64_t total = 0;
  std::vector<DemoTensor> tensors = DemoTensors(*preset);
  for (const DemoTensor& t : tensors) total += t.nbytes();
  ctx.out << absl::StrFormat("wrote demo checkpoint '%s' to %s: %d tensors, %d bytes (%s)\n", preset->name, dir,
                             tensors.size(), total, HumanBytes(total));
  return kExitOk;
}

}  // namespace weightd::cli
