// The `tandem config` questionnaire driven through streams: defaults, every kind of job, and
// wrong answers that are explained and asked again.
#include <gtest/gtest.h>

#include <sstream>

#include "tandem/config/questionnaire.h"

using tandem::config::ask_config;
using tandem::config::QuestionnaireOptions;

namespace {

struct Session {
  tandem::config::LaunchConfig config;
  std::string transcript;
};

Session answer(const std::vector<std::string>& answers, int gpus = 0) {
  std::string text;
  for (const auto& a : answers) text += a + "\n";
  std::istringstream in(text);
  std::ostringstream out;
  Session s;
  s.config = ask_config(in, out, QuestionnaireOptions().cuda_devices(gpus));
  s.transcript = out.str();
  return s;
}

int count_of(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

}  // namespace

TEST(Questionnaire, EnterEverywhereGivesOneCpuProcess) {
  // compute env, type, CPU only, mixed precision, accumulation.
  auto s = answer({"", "", "", "", ""});
  EXPECT_EQ(s.config.distributed_type, "NO");
  EXPECT_EQ(s.config.num_processes, 1);
  EXPECT_TRUE(s.config.use_cpu);  // no GPU: the default answer is yes
  EXPECT_EQ(s.config.mixed_precision, "no");
  EXPECT_EQ(s.config.gradient_accumulation_steps, 1);
  EXPECT_NE(s.transcript.find("[0] No distributed training"), std::string::npos) << s.transcript;
  EXPECT_NE(s.transcript.find("(yes/no) [yes]"), std::string::npos) << s.transcript;
}

TEST(Questionnaire, MultiMachineFsdpWithWrongAnswersAskedAgain) {
  auto s = answer({
      "1",         // SageMaker: not supported, asked again
      "0",         // this machine
      "fsdp",      // by name
      "0",         // machines: invalid
      "2",         // machines
      "2",         // machine rank: not below 2
      "1",         // machine rank
      "",          // ip: required
      "10.0.0.1",  // ip
      "99999",     // port: out of range
      "",          // port: 29500
      "etcd",      // rdzv: not supported
      "c10d",      // rdzv
      "maybe",     // CPU only: not yes/no
      "yes",       // CPU only
      "3",         // processes: not a multiple of 2
      "4",         // processes
      "fp32",      // mixed precision: not a choice
      "bf16",      // mixed precision
      "6",         // sharding strategy: out of range
      "2",         // SHARD_GRAD_OP
      "yes",       // offload
      "0",         // accumulation: invalid
      "4",         // accumulation
  });
  const auto& c = s.config;
  EXPECT_EQ(c.distributed_type, "FSDP");
  EXPECT_EQ(c.num_machines, 2);
  EXPECT_EQ(c.machine_rank, 1);
  EXPECT_EQ(c.main_process_ip, "10.0.0.1");
  EXPECT_EQ(c.main_process_port, 29500);
  EXPECT_EQ(c.rdzv_backend, "c10d");
  EXPECT_TRUE(c.use_cpu);
  EXPECT_EQ(c.num_processes, 4);
  EXPECT_EQ(c.mixed_precision, "bf16");
  EXPECT_EQ(c.fsdp_config.at("fsdp_sharding_strategy"), "SHARD_GRAD_OP");
  EXPECT_EQ(c.fsdp_config.at("fsdp_offload_params"), "true");
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  const auto& t = s.transcript;
  EXPECT_EQ(count_of(t, "please answer again"), 11) << t;
  EXPECT_NE(t.find("Amazon SageMaker is not supported"), std::string::npos) << t;
  EXPECT_NE(t.find("num_machines: got '0', expected an integer of at least 1"), std::string::npos)
      << t;
  EXPECT_NE(t.find("machine_rank: got '2', expected 0 to 1"), std::string::npos) << t;
  EXPECT_NE(t.find("An answer is required"), std::string::npos) << t;
  EXPECT_NE(t.find("main_process_port: got '99999'"), std::string::npos) << t;
  EXPECT_NE(t.find("expected a multiple of num_machines 2"), std::string::npos) << t;
  EXPECT_NE(t.find("'fp32' is not one of the choices"), std::string::npos) << t;
}

TEST(Questionnaire, DeepSpeedOnGpus) {
  auto s = answer({"", "4", "", "no", "", "0,1", "bf16", "3", "cpu", "cpu", "2"}, 2);
  const auto& c = s.config;
  EXPECT_EQ(c.distributed_type, "DEEPSPEED");
  EXPECT_FALSE(c.use_cpu);
  EXPECT_EQ(c.num_processes, 2);  // the default: every GPU
  EXPECT_EQ(c.gpu_ids, "0,1");
  EXPECT_EQ(c.deepspeed_config.at("zero_stage"), "3");
  EXPECT_EQ(c.deepspeed_config.at("offload_optimizer_device"), "cpu");
  EXPECT_EQ(c.deepspeed_config.at("offload_param_device"), "cpu");
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
}

TEST(Questionnaire, GpuIdsAreCheckedAgainstTheMachine) {
  auto s = answer({"", "multi_gpu", "", "2", "0,7", "gpu0", "0", "1,0", "", ""}, 2);
  EXPECT_EQ(s.config.distributed_type, "MULTI_GPU");
  EXPECT_EQ(s.config.gpu_ids, "1,0");
  EXPECT_NE(s.transcript.find("device 7 does not exist"), std::string::npos) << s.transcript;
  EXPECT_NE(s.transcript.find("is not a device index"), std::string::npos) << s.transcript;
  EXPECT_NE(s.transcript.find("1 GPUs for 2 processes"), std::string::npos) << s.transcript;
}

TEST(Questionnaire, EndOfInputIsAnError) {
  EXPECT_THROW(answer({"", "1"}), std::runtime_error);
  // `tandem config` prefixes its own name: the message must not carry it a second time.
  try {
    answer({"", "1"});
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("the input ended before every question", 0), 0u)
        << e.what();
  }
}
