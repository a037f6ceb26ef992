// tandem's side of the tests against the Python tools (tests/oracle/*.py): it writes files with
// tandem for Python's safetensors and TensorBoard to read, reads files Python's safetensors and
// transformers wrote, and trains the DDP case that PyTorch's DistributedDataParallel also trains.
// Every command describes what it wrote (names, dtypes, shapes, values) in an expected.json, or
// checks what it read against the expected.json the Python side wrote; a difference exits 1
// naming it.
//
//   oracle_tool write-safetensors DIR   model/ (one file), sharded/ (shards + index),
//                                       state/ (Accelerator::save_state after an AdamW step)
//   oracle_tool read-safetensors DIR    DIR/plain.safetensors and the sharded DIR/hf/
//   oracle_tool write-tensorboard DIR   event file under DIR/run
//   oracle_tool train-ddp DIR STEPS [bn]  (under tandem launch) DIR/init.safetensors +
//                                       DIR/data.safetensors -> DIR/tandem/model.safetensors; bn:
//                                       the net with a BatchNorm1d (buffers broadcast by DDP)
//   oracle_tool llama DIR [ATTENTION [SAVE_DTYPE]]  the Llama-family folder DIR/model and the batch
//                                       DIR/batch.safetensors (ids, labels) -> DIR/tandem.safetensors
//                                       (logits, loss, "grad.<name>" per parameter; with the
//                                       key/value cache, "cached_logits" of the last position fed
//                                       one token at a time) and the folder saved back, DIR/saved
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "tandem/accelerator.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/safetensors_header.h"
#include "tandem/models/llama.h"
#include "tandem/track/trackers.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& what) {
  std::cerr << "oracle_tool: " << what << std::endl;
  std::exit(1);
}

// name -> {dtype, shape, values}: values as doubles (every F32/F16/BF16/int value is exact).
json describe(const at::Tensor& t) {
  auto flat = t.detach().to(at::kCPU).reshape({-1});
  json values = json::array();
  if (flat.scalar_type() == at::kBool) {
    auto b = flat.to(at::kByte);
    for (int64_t i = 0; i < b.numel(); ++i) values.push_back(b[i].item<int64_t>() != 0);
  } else if (at::isFloatingType(flat.scalar_type())) {
    auto d = flat.to(at::kDouble);
    for (int64_t i = 0; i < d.numel(); ++i) values.push_back(d[i].item<double>());
  } else {
    auto l = flat.to(at::kLong);
    for (int64_t i = 0; i < l.numel(); ++i) values.push_back(l[i].item<int64_t>());
  }
  return {{"dtype", std::string(tandem::checkpoint::dtype_name(
                        tandem::checkpoint::dtype_of(t.scalar_type())))},
          {"shape", t.sizes().vec()},
          {"values", values}};
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream(path) << j.dump(1);
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) fail("cannot read " + path.string());
  return json::parse(in);
}

// A module with parameters and buffers of every dtype a checkpoint commonly holds.
struct MixedImpl : torch::nn::Module {
  MixedImpl() {
    fc = register_module("fc", torch::nn::Linear(7, 5));
    emb = register_module("emb", torch::nn::Embedding(11, 3));
    half = register_parameter("half", torch::linspace(-3, 3, 12).reshape({3, 4}).to(at::kHalf));
    bf16 = register_parameter("bf16", torch::linspace(-1, 2, 6).to(at::kBFloat16));
    count = register_buffer("count", torch::arange(5, at::kLong) * static_cast<int64_t>(1000000007));
    mask = register_buffer("mask", torch::tensor({true, false, true}));
    bytes = register_buffer("bytes", torch::arange(4, at::kByte));
    wide = register_buffer("wide", torch::tensor({1.0 / 3.0, 1e-300}, at::kDouble));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::Embedding emb{nullptr};
  at::Tensor half, bf16, count, mask, bytes, wide;
};
TORCH_MODULE(Mixed);

int write_safetensors(const fs::path& dir) {
  torch::manual_seed(3);
  Mixed m;
  tandem::checkpoint::save_model(*m, (dir / "model").string());
  tandem::checkpoint::save_model(*m, (dir / "sharded").string(), "128B");
  json expected;
  json model = json::object();
  for (const auto& p : m->named_parameters()) model[p.key()] = describe(p.value());
  for (const auto& b : m->named_buffers()) model[b.key()] = describe(b.value());
  expected["model"] = model;
  // Accelerator::save_state after one AdamW step: the optimizer's tensors as the files hold them
  // (tandem's own reader describes them: the Python side checks that its reader agrees).
  tandem::Accelerator acc(tandem::AcceleratorOptions().cpu(true).project_dir((dir / "run").string()));
  auto net = torch::nn::Linear(4, 3);
  auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.1));
  acc.prepare(net, opt);
  auto loss = net(torch::ones({2, 4})).pow(2).sum();
  acc.backward(loss);
  opt->step();
  const fs::path state = acc.save_state((dir / "state").string());
  // What the files must hold, from the model and the optimizer themselves.
  json state_model = json::object();
  for (const auto& p : net->named_parameters()) state_model[p.key()] = describe(p.value());
  json state_opt = json::object();
  for (const auto& [name, t] : tandem::checkpoint::optimizer_state(*opt).tensors)
    state_opt[name] = describe(t);
  expected["state"] = {{"model.safetensors", state_model}, {"optimizer.safetensors", state_opt}};
  expected["state_dir"] = state.string();
  write_json(dir / "expected.json", expected);
  return 0;
}

void compare(const std::string& where, const at::Tensor& got, const json& want) {
  const json have = describe(got);
  if (have["dtype"] != want["dtype"])
    fail(where + ": dtype " + have["dtype"].dump() + ", expected " + want["dtype"].dump());
  if (have["shape"] != want["shape"])
    fail(where + ": shape " + have["shape"].dump() + ", expected " + want["shape"].dump());
  const auto& a = have["values"];
  const auto& b = want["values"];
  if (a.size() != b.size()) fail(where + ": value count differs");
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) fail(where + ": value " + std::to_string(i) + " is " + a[i].dump() + ", expected " + b[i].dump());
}

int read_safetensors(const fs::path& dir) {
  const json expected = read_json(dir / "expected.json");
  size_t checked = 0;
  {
    tandem::checkpoint::SafetensorsFile f((dir / "plain.safetensors").string());
    for (const auto& [name, want] : expected["plain"].items()) {
      compare("plain.safetensors " + name, f.tensor(name), want);
      ++checked;
    }
    if (f.size() != expected["plain"].size()) fail("plain.safetensors: tensor count differs");
    for (const auto& [k, v] : expected["plain_metadata"].items())
      if (f.metadata().count(k) == 0 || f.metadata().at(k) != v.get<std::string>())
        fail("plain.safetensors: metadata " + k + " lost");
  }
  // transformers' save_pretrained, sharded: the index names every tensor's shard.
  const auto index = tandem::checkpoint::read_safetensors_index((dir / "hf" / "model.safetensors.index.json").string());
  if (index.files.size() < 2) fail("hf: expected several shards, the index names " + std::to_string(index.files.size()));
  if (index.weight_map.size() != expected["hf"].size()) fail("hf: the index names " + std::to_string(index.weight_map.size()) + " tensors");
  for (const auto& file : index.files) {
    tandem::checkpoint::SafetensorsFile f((dir / "hf" / file).string());
    for (const auto& name : f.names()) {
      if (!expected["hf"].contains(name)) fail("hf: unexpected tensor " + name + " in " + file);
      if (index.weight_map.at(name) != file) fail("hf: " + name + " is in " + file + ", the index says " + index.weight_map.at(name));
      compare("hf " + name, f.tensor(name), expected["hf"][name]);
      ++checked;
    }
  }
  std::cout << "oracle_tool: " << checked << " tensors equal" << std::endl;
  return 0;
}

int write_tensorboard(const fs::path& dir) {
  tandem::track::TensorBoardTracker tb((dir / "run").string());
  json expected = json::object();
  for (int64_t step = 0; step < 25; ++step) {
    std::map<std::string, double> values = {{"loss", 10.0 / (step + 1)},
                                            {"train/lr", 1e-3 * (1 + step % 5)},
                                            {"eval/accuracy", step * 0.04}};
    if (step % 10 == 3) values["rare"] = -step;
    tb.log(values, step * 7);
    for (const auto& [k, v] : values) expected[k].push_back({step * 7, v});
  }
  tb.finish();
  write_json(dir / "expected.json", expected);
  return 0;
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool batchnorm) {
    fc1 = register_module("fc1", torch::nn::Linear(10, 16));
    if (batchnorm) bn = register_module("bn", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = fc1(x);
    if (bn) h = bn(h);
    return fc2(torch::tanh(h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

// The DDP case of tests/oracle/ddp_peer.py: the same weights, data, batches and steps.
int train_ddp(const fs::path& dir, int steps, bool batchnorm) {
  tandem::Accelerator acc(tandem::AcceleratorOptions().cpu(true));
  Net net(batchnorm);
  tandem::checkpoint::load_model(*net, (dir / "init.safetensors").string());
  tandem::checkpoint::SafetensorsFile data((dir / "data.safetensors").string());
  const auto x = data.tensor("x"), y = data.tensor("y");
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(),
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [prepared, opt] = acc.prepare(net, sgd);
  const int64_t global_batch = 8, n = acc.num_processes(), r = acc.process_index();
  for (int s = 0; s < steps; ++s) {
    // Global batch s, rows r, r + n, ...: what DistributedSampler(shuffle=False) gives rank r.
    auto rows = torch::arange(s * global_batch + r, (s + 1) * global_batch, n);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net(x.index_select(0, rows)), y.index_select(0, rows));
    acc.backward(loss);
    opt.step();
  }
  if (acc.is_main_process()) tandem::checkpoint::save_model(*net, (dir / "tandem").string());
  acc.wait_for_everyone();
  return 0;
}

}  // namespace

// The Llama family against transformers (tests/oracle/llama_oracle.py): logits, transformers'
// loss and every parameter's gradient for one batch, the logits of the key/value cache fed one
// token at a time, and the folder written back.
int llama(const fs::path& dir, const std::string& attention, const std::string& save_dtype) {
  namespace models = tandem::models;
  const auto cfg = models::LlamaConfig::from_file((dir / "model" / "config.json").string());
  models::LlamaForCausalLM model(cfg);
  model->set_attention(tandem::nn::parse_attention_kernel(attention));
  model->eval();  // no dropout: the same function transformers evaluates
  tandem::checkpoint::load_model(*model, (dir / "model").string(),
                                 tandem::checkpoint::LoadOptions().allow_dtype_cast(true));
  tandem::checkpoint::SafetensorsFile batch((dir / "batch.safetensors").string());
  const auto ids = batch.tensor("ids"), labels = batch.tensor("labels");
  auto logits = model(ids);
  auto loss = models::causal_lm_loss(logits, labels);
  tandem::checkpoint::NamedTensors out{{"logits", logits.detach()}, {"loss", loss.detach()}};
  if (cfg.num_experts > 0) {
    out.emplace_back("aux_loss", model->router_aux_loss().detach());
    loss = loss + cfg.router_aux_loss_coef * model->router_aux_loss();  // as transformers' loss
    out[1].second = loss.detach();
  }
  loss.backward();
  for (const auto& p : model->named_parameters())  // an expert no token chose: no gradient
    out.emplace_back("grad." + p.key(), p.value().grad().defined()
                                            ? p.value().grad()
                                            : torch::zeros_like(p.value()));
  {
    torch::NoGradGuard no_grad;
    model->use_cache(true);
    at::Tensor last;
    for (int64_t t = 0; t < ids.size(1); ++t) last = model(ids.narrow(1, t, 1));
    out.emplace_back("cached_logits", last.select(1, 0));
    model->use_cache(false);
  }
  tandem::checkpoint::save_safetensors((dir / "tandem.safetensors").string(), out);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  models::save_pretrained(cfg, tensors, (dir / "saved").string(), save_dtype);
  std::cout << cfg.model_type << ": " << cfg.parameter_count() << " parameters, loss "
            << loss.item<double>() << std::endl;
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) fail("usage: oracle_tool COMMAND DIR [ARGS]");
  const std::string cmd = argv[1];
  const fs::path dir = argv[2];
  fs::create_directories(dir);
  try {
    if (cmd == "write-safetensors") return write_safetensors(dir);
    if (cmd == "read-safetensors") return read_safetensors(dir);
    if (cmd == "write-tensorboard") return write_tensorboard(dir);
    if (cmd == "llama")
      return llama(dir, argc > 3 ? argv[3] : "auto", argc > 4 ? argv[4] : "");
    if (cmd == "train-ddp")
      return train_ddp(dir, argc > 3 ? std::atoi(argv[3]) : 10,
                       argc > 4 && std::string(argv[4]) == "bn");
  } catch (const std::exception& e) {
    fail(e.what());
  }
  fail("unknown command " + cmd);
}
