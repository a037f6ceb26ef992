// `tandem config`: the questions that write a configuration file, each answer validated on the
// spot and asked again until it is valid.
#pragma once

#include <torch/arg.h>

#include <istream>
#include <ostream>

#include "tandem/config/config.h"

namespace tandem::config {

/// What the questionnaire needs to know about this machine.
///
/// Example:
///   auto cfg = tandem::config::ask_config(std::cin, std::cout,
///       tandem::config::QuestionnaireOptions().cuda_devices(0));
struct QuestionnaireOptions {
  /// CUDA devices on this machine: the default number of processes and the valid gpu_ids.
  TORCH_ARG(int, cuda_devices) = 0;
};

/// Asks for the compute environment, distributed type, machines, machine rank, main process
/// address and port, processes, CPU or GPU ids, mixed precision, sharding stage and offload,
/// gradient accumulation. Defaults are shown in brackets and taken on an empty answer; a wrong
/// answer prints why and asks again. Throws std::runtime_error when the input ends.
LaunchConfig ask_config(std::istream& in, std::ostream& out, const QuestionnaireOptions& options);

}  // namespace tandem::config
