// bin/tandem, the command users type. Note [A launcher without LibTorch]: `tandem launch`,
// `tandem config` and `tandem estimate-memory` (arithmetic on a config or a safetensors header)
// run here, in a process that maps no LibTorch: loading it costs every launch
// 0.5-2 s of CPU and a few hundred MB of resident memory that the launcher, which only starts
// and watches the ranks, never uses (Debian's LibTorch 1.13 alone maps OpenCV and FFmpeg). Every
// other command, and a launch or config that needs LibTorch (CUDA devices to count with a CUDA
// build, --min_machines' rendezvous store), runs the full command line,
// libexec/tandem/tandem, with the same arguments (needs_libtorch). The launcher's code is the
// same object code in both (src/CMakeLists.txt: tandem_launch); what it asks of LibTorch lives
// in files of libtandem only (launch/devices.cpp, launch/machine_rendezvous.cpp,
// torch_runtime.cpp), with this executable's answers in front_seams.cpp. It links libc10
// (the thread count a program started by hand gets) and the BLAS LibTorch's CPU library links
// (which kernels it chose: Note [OpenBLAS kernels]), so a rank's environment is the same from
// either executable.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>

#include "estimate_memory_cmd.h"
#include "full_cli.h"
#include "launch_cmd.h"

namespace {

char** g_argv = nullptr;

}  // namespace

namespace tandem::cli {

void needs_libtorch() {
  std::string full;
  try {
    full = full_cli_path(self_executable());
  } catch (const std::exception& e) {
    std::cerr << "tandem: " << e.what() << "\n";
    std::_Exit(127);
  }
  std::cout.flush();
  std::cerr.flush();
  ::execv(full.c_str(), g_argv);
  std::cerr << "tandem: cannot run " << full << " (" << std::strerror(errno)
            << "), the part of tandem's command line that loads LibTorch; it is installed beside "
               "bin/tandem (reinstall tandem, or rebuild its tandem_tools target)\n";
  std::_Exit(127);
}

}  // namespace tandem::cli

int main(int argc, char** argv) {
  g_argv = argv;
  const std::string command = argc > 1 ? argv[1] : "";
  if (command != "launch" && command != "config" && command != "estimate-memory")
    tandem::cli::needs_libtorch();

  CLI::App app{"tandem: distributed training for LibTorch"};
  app.require_subcommand(1);
  tandem::cli::LaunchCommand launch(app);
  tandem::cli::ConfigCommand config(app);
  tandem::cli::EstimateMemoryCommand estimate_memory(app);
  const int parsed_argc = launch.split_program(argc, argv);  // PROGRAM [ARGS...] untouched
  CLI11_PARSE(app, parsed_argc, argv);
  if (launch.chosen()) return launch.run();
  if (config.chosen()) return config.run();
  if (estimate_memory.chosen()) return estimate_memory.run();
  return 0;
}
