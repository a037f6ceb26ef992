// The two executables of the command line (Note [A launcher without LibTorch]):
//   bin/tandem                the one users type; runs `launch` and `config` without loading
//                             LibTorch, and hands every other command to
//   libexec/tandem/tandem     the full command line (links libtandem and LibTorch).
#pragma once

#include <string>

namespace tandem::cli {

/// Where this process was started from (/proc/self/exe).
std::string self_executable();

/// The full command line beside bin/tandem (../libexec/tandem/tandem from its directory).
std::string full_cli_path(const std::string& front);

/// The command that starts jobs (`tandem launch`): bin/tandem beside the full command line when
/// it is there (../../bin/tandem from its directory), else the full command line itself.
std::string launcher_path(const std::string& full);

/// Called by a command before it needs LibTorch (CUDA devices to count, the machines'
/// rendezvous store), before it has printed or changed anything. In bin/tandem it runs the full
/// command line with the same arguments and does not return; in the full one it returns.
void needs_libtorch();

}  // namespace tandem::cli
