// weightctl: the command-line client of weightd. See `weightctl --help`.
#include <iostream>

#include "client/cli/commands.h"

int main(int argc, char** argv) {
  return weightd::cli::RunWeightctl(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
