// Weight-only quantization (tandem/inference/quantize.h).
#include "tandem/inference/quantize.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "../compat/inference_kernels.h"
#include "nn/detail/replace_child.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/inference/dispatch.h"
#include "tandem/nn/layers.h"

namespace tandem::inference {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kMetadataKey = "tandem_quantization";

bool is_int4(const QuantizeOptions& o) { return o.method() == "int4"; }

uint64_t stored_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<uint64_t>(t.numel()) * t.element_size() : 0;
}

// int4 values [out, in] (0..15, any integer dtype) -> bytes [out, in / 2], the high nibble first.
at::Tensor pack_nibbles(const at::Tensor& q) {
  auto v = q.to(at::kInt);
  return (v.slice(1, 0, c10::nullopt, 2).bitwise_left_shift(4) | v.slice(1, 1, c10::nullopt, 2))
      .to(at::kByte);
}

// bytes [out, in / 2] -> int32 values [out, in].
at::Tensor unpack_nibbles(const at::Tensor& packed) {
  auto b = packed.to(at::kInt);
  auto hi = b.bitwise_right_shift(4), lo = b.bitwise_and(15);
  return at::stack({hi, lo}, 2).reshape({packed.size(0), packed.size(1) * 2});
}

}  // namespace

void check_quantize_options(const QuantizeOptions& o) {
  if (o.method() != "int8" && o.method() != "int4")
    throw ::tandem::Refused("quantize: method '" + o.method() + "': expected int8 or int4");
  if (is_int4(o) && o.group_size() != 32 && o.group_size() != 64 && o.group_size() != 128 &&
      o.group_size() != 256)
    throw ::tandem::Refused("quantize: int4 group size " + std::to_string(o.group_size()) +
                                ": expected 32, 64, 128 or 256");
}

QuantizedWeight quantize_int8(const at::Tensor& weight) {
  TANDEM_CHECK(weight.dim() == 2, "quantize_int8: expected a 2-D [out, in] weight, got ",
              weight.sizes());
  at::NoGradGuard no_grad;
  auto w = weight.detach().to(at::kFloat);
  auto scale = w.abs().amax(1).clamp_min(1e-12) / 127.0;
  auto q = at::round(w / scale.unsqueeze(1)).clamp(-127, 127).to(at::kChar);
  return {q.contiguous(), scale.contiguous(), {}};
}

QuantizedWeight quantize_int4(const at::Tensor& weight, int64_t group) {
  TANDEM_CHECK(weight.dim() == 2, "quantize_int4: expected a 2-D [out, in] weight, got ",
              weight.sizes());
  const int64_t out = weight.size(0), in = weight.size(1);
  TANDEM_CHECK(in % group == 0, "quantize_int4: ", in, " input features are not a multiple of the "
              "group size ", group);
  at::NoGradGuard no_grad;
  auto w = weight.detach().to(at::kFloat).reshape({out, in / group, group});
  auto lo = std::get<0>(w.min(2)), hi = std::get<0>(w.max(2));
  auto scale = ((hi - lo) / 15.0).clamp_min(1e-12);
  auto zero = lo + scale * 8.0;
  auto q = at::round((w - lo.unsqueeze(2)) / scale.unsqueeze(2)).clamp(0, 15).reshape({out, in});
  return {pack_nibbles(q).contiguous(), scale.contiguous(), zero.contiguous()};
}

at::Tensor dequantize(const QuantizedWeight& q, const std::string& method, int64_t group) {
  if (method == "int8") return q.values.to(at::kFloat) * q.scale.to(at::kFloat).unsqueeze(1);
  auto v = unpack_nibbles(q.values).to(at::kFloat);
  const int64_t out = v.size(0), in = v.size(1);
  auto g = v.reshape({out, in / group, group});
  return ((g - 8.0) * q.scale.to(at::kFloat).unsqueeze(2) + q.zero.to(at::kFloat).unsqueeze(2))
      .reshape({out, in});
}

// --- QuantizedLinear ------------------------------------------------------------------------

QuantizedLinearImpl::QuantizedLinearImpl(int64_t in, int64_t out, bool with_bias,
                                         const QuantizeOptions& o)
    : in_features(in), out_features(out), has_bias(with_bias), options(o) {
  check_quantize_options(o);
  if (is_int4(o) && in % o.group_size() != 0)
    throw ::tandem::Refused("QuantizedLinear: " + std::to_string(in) +
                                " input features are not a multiple of the int4 group size " +
                                std::to_string(o.group_size()));
  reset();
}

void QuantizedLinearImpl::reset() {
  if (is_int4(options)) {
    weight = register_buffer("weight", at::zeros({out_features, in_features / 2}, at::kByte));
    weight_scale = register_buffer(
        "weight_scale", at::ones({out_features, in_features / options.group_size()}));
    weight_zero = register_buffer("weight_zero",
                                  at::zeros({out_features, in_features / options.group_size()}));
  } else {
    weight = register_buffer("weight", at::zeros({out_features, in_features}, at::kChar));
    weight_scale = register_buffer("weight_scale", at::ones({out_features}));
  }
  if (has_bias) bias = register_buffer("bias", at::zeros({out_features}));
}

std::string QuantizedLinearImpl::kernel(const at::Device& device, c10::ScalarType dtype) const {
  const bool floating = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!options.use_kernels() || !floating) return "dequantize + matmul";
  if (!is_int4(options))
    return TANDEM_HAS_INT8PACK_MM && (device.is_cpu() || device.is_cuda()) ? "_weight_int8pack_mm"
                                                                         : "dequantize + matmul";
  if (device.is_cpu() && TANDEM_HAS_INT4PACK_MM_CPU && dtype == at::kFloat)
    return "_weight_int4pack_mm_for_cpu";
  if (device.is_cuda() && TANDEM_HAS_INT4PACK_MM_CUDA) return "_weight_int4pack_mm";
  return "dequantize + matmul";
}

void QuantizedLinearImpl::drop_cache() {
  packed_ = at::Tensor();
  scales_zeros_ = at::Tensor();
  packed_for_ = nullptr;
}

at::Tensor QuantizedLinearImpl::forward(const at::Tensor& x) {
  at::NoGradGuard no_grad;
  TANDEM_CHECK(!is_empty_weight(weight), "QuantizedLinear: the weight has no values (built with "
              "init_empty_weights and not loaded); load the quantized checkpoint first");
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  auto x2 = x.reshape({-1, in_features}).contiguous();
  const auto k = kernel(x.device(), x.scalar_type());
  at::Tensor y;
  if (k == "_weight_int8pack_mm") {
    y = compat::int8pack_mm(x2, weight, weight_scale.to(x.scalar_type()));
  } else if (k == "_weight_int4pack_mm_for_cpu" || k == "_weight_int4pack_mm") {
    if (packed_for_ != weight.data_ptr() || !packed_.defined()) {
      auto sz = at::stack({weight_scale, weight_zero}, 2).transpose(0, 1).contiguous();
      if (k == "_weight_int4pack_mm_for_cpu") {
        packed_ = compat::int4pack_cpu(unpack_nibbles(weight).contiguous());
        scales_zeros_ = sz.to(at::kFloat);
      } else {
        packed_ = compat::int4pack_cuda(weight.contiguous());
        scales_zeros_ = sz.to(at::kBFloat16);
      }
      packed_for_ = weight.data_ptr();
    }
    if (k == "_weight_int4pack_mm_for_cpu")
      y = compat::int4pack_mm_cpu(x2, packed_, options.group_size(), scales_zeros_);
    else
      y = compat::int4pack_mm_cuda(x2.to(at::kBFloat16), packed_, options.group_size(),
                                   scales_zeros_)
              .to(x.scalar_type());
  } else {
    QuantizedWeight q{weight, weight_scale, weight_zero};
    y = at::matmul(x2, dequantize(q, options.method(), options.group_size())
                           .to(x.scalar_type())
                           .t());
  }
  if (has_bias) y = y + bias.to(y.scalar_type());
  return y.view(shape);
}

// --- Models ---------------------------------------------------------------------------------

std::string QuantizeReport::to_string() const {
  std::ostringstream o;
  o << layers << " layers quantized: " << std::fixed << std::setprecision(1)
    << static_cast<double>(float_bytes) / 1e6 << " MB of weights -> "
    << static_cast<double>(quantized_bytes) / 1e6 << " MB";
  if (!kept.empty()) {
    o << "; kept in floating point: ";
    for (size_t i = 0; i < kept.size(); ++i) o << (i ? ", " : "") << kept[i];
  }
  return o.str();
}

namespace {

// A linear layer: its [out, in] weight (transposed for Conv1D), bias, and sizes.
struct LinearView {
  at::Tensor weight_out_in;  // undefined for an empty layer
  at::Tensor bias;
  int64_t in = 0, out = 0;
  bool transposed = false;
};

std::optional<LinearView> as_linear(torch::nn::Module& m) {
  LinearView v;
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    v.in = l->weight.size(1);
    v.out = l->weight.size(0);
    if (!is_empty_weight(l->weight)) v.weight_out_in = l->weight;
    v.bias = l->bias;
    return v;
  }
  if (auto* c = dynamic_cast<tandem::nn::Conv1DImpl*>(&m)) {
    v.in = c->in_features;
    v.out = c->out_features;
    if (!is_empty_weight(c->weight)) v.weight_out_in = c->weight.t();
    v.bias = c->bias;
    v.transposed = true;
    return v;
  }
  return std::nullopt;
}

bool skipped(const std::string& name, const std::vector<std::string>& skip) {
  for (const auto& s : skip)
    if (!s.empty() && name.find(s) != std::string::npos) return true;
  return false;
}

}  // namespace

QuantizeReport quantize_model(torch::nn::Module& model, const QuantizeOptions& options) {
  check_quantize_options(options);
  QuantizeReport report;
  const std::set<std::string> only(options.layers().begin(), options.layers().end());
  std::set<std::string> found;
  // Collect first: replacing changes the module tree being walked.
  struct Target {
    std::string name;
    std::shared_ptr<torch::nn::Module> parent;
    std::string child;
    std::shared_ptr<torch::nn::Module> module;
  };
  std::vector<Target> targets;
  for (const auto& item : model.named_modules()) {
    const std::string& parent_name = item.key();
    for (const auto& c : item.value()->named_children()) {
      const std::string name = parent_name.empty() ? c.key() : parent_name + "." + c.key();
      if (!as_linear(*c.value())) continue;
      if (!only.empty()) {
        if (!only.count(name)) {
          report.kept.push_back(name + " (not quantized in the checkpoint)");
          continue;
        }
      } else if (skipped(name, options.skip())) {
        report.kept.push_back(name + " (skip)");
        continue;
      }
      const bool in_list = dynamic_cast<torch::nn::SequentialImpl*>(item.value().get()) ||
                           dynamic_cast<torch::nn::ModuleListImpl*>(item.value().get());
      if (!tandem::nn::hookable(*c.value()) && !in_list && only.empty())
        throw ::tandem::Refused(
            "quantize: '" + name + "' is a torch::nn::" + tandem::nn::module_type_name(*c.value()) +
            " held by its parent, which may call it directly, past the quantized layer; declare "
            "it tandem::nn::Linear (tandem/nn/module.h), or skip it (QuantizeOptions::skip)");
      targets.push_back({name, item.value(), c.key(), c.value()});
    }
  }
  for (const auto& n : only) {
    bool have = false;
    for (const auto& t : targets) have = have || t.name == n;
    if (!have)
      throw ::tandem::Refused("quantize: layer '" + n + "' is listed as quantized, but the "
                                  "model has no linear layer of that name (was the checkpoint "
                                  "quantized from another model?)");
  }
  at::NoGradGuard no_grad;
  for (auto& t : targets) {
    auto view = *as_linear(*t.module);
    if (is_int4(options) && view.in % options.group_size() != 0) {
      if (!only.empty())
        throw ::tandem::Refused("quantize: layer '" + t.name + "' has " +
                                    std::to_string(view.in) + " inputs, not a multiple of the "
                                    "int4 group size " + std::to_string(options.group_size()));
      report.kept.push_back(t.name + " (" + std::to_string(view.in) +
                            " inputs: not a multiple of the group size)");
      continue;
    }
    QuantizedLinear holder(view.in, view.out, view.bias.defined(), options);
    auto layer = holder.ptr();
    const bool empty = !view.weight_out_in.defined();
    report.float_bytes += static_cast<uint64_t>(view.in) * view.out * 4;
    if (empty) {
      release_weights(*layer);
    } else {
      auto q = is_int4(options) ? quantize_int4(view.weight_out_in, options.group_size())
                                : quantize_int8(view.weight_out_in);
      const auto device = view.weight_out_in.device();
      layer->weight.set_data(q.values.to(device));
      layer->weight_scale.set_data(q.scale.to(device));
      if (q.zero.defined()) layer->weight_zero.set_data(q.zero.to(device));
      if (view.bias.defined()) layer->bias.set_data(view.bias.detach().to(at::kFloat).clone());
    }
    for (const auto& b : layer->buffers()) report.quantized_bytes += stored_bytes(b);
    ++report.layers;
    tandem::nn::detail::replace_child(*t.parent, t.child, layer, torch::nn::AnyModule(holder));
    // A typed member (`c_attn(x)`) still holds the float layer: its calls go to the quantized one.
    if (auto* h = tandem::nn::hookable(*t.module)) {
      h->hooks().redirect(
          layer,
          [layer](const std::vector<at::Tensor>& in) {
            return std::vector<at::Tensor>{layer->forward(in.at(0))};
          },
          options.method() + " weight-only");
    }
    release_weights(*t.module);
  }
  return report;
}

// --- Checkpoints ----------------------------------------------------------------------------

std::optional<QuantizeOptions> checkpoint_quantization(const std::string& path) {
  const auto files = checkpoint::checkpoint_tensor_files(path);
  std::set<std::string> seen;
  for (const auto& [name, file] : files) {
    if (!seen.insert(file).second) continue;
    checkpoint::SafetensorsFile f(file);
    auto it = f.metadata().find(kMetadataKey);
    if (it == f.metadata().end()) continue;
    json j;
    try {
      j = json::parse(it->second);
    } catch (const json::exception& e) {
      throw std::runtime_error("checkpoint '" + file + "': its " + kMetadataKey +
                               " metadata is not JSON (" + e.what() +
                               "); quantize the checkpoint again with `tandem quantize`");
    }
    QuantizeOptions o;
    try {
      o.method(j.at("method").get<std::string>());
      o.group_size(j.value("group_size", int64_t{128}));
      o.layers(j.at("layers").get<std::vector<std::string>>());
    } catch (const json::exception& e) {
      throw std::runtime_error("checkpoint '" + file + "': its " + kMetadataKey +
                               " metadata lacks a field (" + e.what() +
                               "); quantize the checkpoint again with `tandem quantize`");
    }
    check_quantize_options(o);
    return o;
  }
  return std::nullopt;
}

QuantizeReport quantize_checkpoint(const std::string& in, const std::string& out,
                                   const QuantizeOptions& options,
                                   const std::string& weight_layout) {
  check_quantize_options(options);
  if (weight_layout != "auto" && weight_layout != "out_in" && weight_layout != "in_out")
    throw ::tandem::Refused("quantize: weight layout '" + weight_layout +
                                "': expected auto, out_in or in_out");
  const fs::path in_dir = fs::is_directory(in) ? fs::path(in) : fs::path(in).parent_path();
  bool transposed = weight_layout == "in_out";
  if (weight_layout == "auto" && fs::exists(in_dir / "config.json")) {
    std::ifstream f(in_dir / "config.json");
    json config = json::parse(f, nullptr, false);
    transposed = config.is_object() && config.value("model_type", "") == "gpt2";
  }
  if (fs::exists(fs::path(out) / checkpoint::kModelFileName) ||
      fs::exists(fs::path(out) / checkpoint::kModelIndexFileName))
    throw ::tandem::Refused("quantize: '" + out + "' already holds a checkpoint; give an "
                                "empty or new directory");
  const auto files = checkpoint::checkpoint_tensor_files(in);
  if (checkpoint_quantization(in))
    throw ::tandem::Refused("quantize: '" + in + "' is already quantized");
  std::map<std::string, std::unique_ptr<checkpoint::SafetensorsFile>> open;
  for (const auto& [name, file] : files)
    if (!open.count(file)) open[file] = std::make_unique<checkpoint::SafetensorsFile>(file);

  QuantizeReport report;
  checkpoint::NamedTensors tensors;
  std::vector<std::string> layers;
  const std::vector<std::string> not_linear = {"embed", "wte", "wpe", "norm", "ln_"};
  for (const auto& [name, file] : files) {
    auto t = open.at(file)->tensor(name);
    const std::string suffix = ".weight";
    const bool weight_name = name.size() > suffix.size() &&
                             name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    const std::string layer = weight_name ? name.substr(0, name.size() - suffix.size()) : "";
    const bool candidate = weight_name && t.dim() == 2 && c10::isFloatingType(t.scalar_type());
    if (!candidate) {
      tensors.emplace_back(name, t);
      continue;
    }
    if (skipped(layer, options.skip()) || skipped(layer, not_linear)) {
      if (!skipped(layer, not_linear)) report.kept.push_back(layer + " (skip)");
      tensors.emplace_back(name, t);
      continue;
    }
    auto w = transposed ? t.t().contiguous() : t;
    if (is_int4(options) && w.size(1) % options.group_size() != 0) {
      report.kept.push_back(layer + " (" + std::to_string(w.size(1)) +
                            " inputs: not a multiple of the group size)");
      tensors.emplace_back(name, t);
      continue;
    }
    auto q = is_int4(options) ? quantize_int4(w, options.group_size()) : quantize_int8(w);
    report.float_bytes += stored_bytes(t);
    tensors.emplace_back(name, q.values);
    tensors.emplace_back(layer + ".weight_scale", q.scale);
    if (q.zero.defined()) tensors.emplace_back(layer + ".weight_zero", q.zero);
    report.quantized_bytes += stored_bytes(q.values) + stored_bytes(q.scale) + stored_bytes(q.zero);
    ++report.layers;
    layers.push_back(layer);
  }
  // Biases of quantized layers become float32 buffers of QuantizedLinear.
  std::set<std::string> quantized(layers.begin(), layers.end());
  for (auto& [name, t] : tensors) {
    const std::string suffix = ".bias";
    if (name.size() > suffix.size() &&
        quantized.count(name.substr(0, name.size() - suffix.size())))
      t = t.to(at::kFloat);
  }
  json meta = {{"method", options.method()},
               {"group_size", options.group_size()},
               {"layers", layers},
               {"source_layout", transposed ? "in_out" : "out_in"}};
  fs::create_directories(out);
  checkpoint::save_safetensors((fs::path(out) / checkpoint::kModelFileName).string(), tensors,
                               {{"format", "pt"}, {kMetadataKey, meta.dump()}});
  for (const auto& e : fs::directory_iterator(in_dir)) {
    const auto fname = e.path().filename().string();
    if (e.path().extension() == ".json" && fname != checkpoint::kModelIndexFileName)
      fs::copy_file(e.path(), fs::path(out) / fname, fs::copy_options::overwrite_existing);
  }
  return report;
}

}  // namespace tandem::inference
