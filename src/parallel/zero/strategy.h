// The ZeRO strategy, stages 1, 2 and 3 (zero.h, Note [ZeRO units]): its units, the optimizer
// stepping their shards, and its checkpoints. Its members are defined by concern: units and
// construction (strategy.cpp), the optimizer (optimizer.cpp), checkpoints (checkpoint.cpp).
#pragma once

#include "reducer.h"
#include "tandem/error.h"

namespace tandem::parallel::detail::zero {

using json = nlohmann::json;

class ZeroStrategy : public Strategy, public ParameterSharding {
 public:
  ZeroStrategy(ShardingOptions options, StrategyContext ctx)
      : options_(std::move(options)), ctx_(std::move(ctx)) {
    prefetch_.forward = options_.forward_prefetch();
    prefetch_.backward = options_.backward_prefetch();
    prefetch_.reshard_after_forward = options_.reshard_after_forward();
    if ((options_.offload_optimizer() || options_.offload_params()) && ctx_.device.is_cpu() &&
        ctx_.pg->rank() == 0)
      std::cerr << ctx_.pg->prefix() << " " << options_.origin()
                << ": optimizer offload to the CPU: this run is on the CPU already, so the "
                   "shards and their step stay where they are" << std::endl;
  }
  std::string name() const override { return "zero-" + std::to_string(options_.stage()); }

  void prepare_model(const std::shared_ptr<torch::nn::Module>& model) override {
    models_.push_back(model);
    // Note [Expert parallel]: the experts a rank holds stay whole on it, outside every unit.
    experts_ = held_experts(models_);
    if (options_.stage() != 3) return;
    const size_t before = units_.size();
    find_units(model);
    // FSDP's root wrap: a model declared with TANDEM_MODULE whose forward reaches no other unit
    // is one unit itself, gathered for its forward and backward, released in between.
    if (units_.size() == before && tandem::nn::hookable(*model) && !is_unit(*model))
      add_hooked(model, "");
    report_units(*model, before);
  }
  // Note [A model ZeRO-3 cannot reach]: a model whose modules are all held by typed torch::nn
  // members (`torch::nn::Linear fc1;` called as `fc1(x)`) has no module a wrapper or a hook
  // reaches, so no parameter could be released between uses: stage 3 would keep every weight
  // whole on every rank while saying "zero-3". LibTorch has no forward hooks on its own
  // modules, so instead of pretending, such a model is refused with the fixes; a model with
  // some units says how much of it is sharded.
  void report_units(const torch::nn::Module& model, size_t before) {
    // Parameters under several names (tied) stay in the root, resident, whatever module holds
    // them.
    std::map<const void*, int> names;
    std::set<const void*> all;
    int64_t elements = 0;
    for (const auto& p : model.named_parameters()) {
      ++names[p.value().unsafeGetTensorImpl()];
      if (experts_.contains(p.value())) continue;
      if (p.value().requires_grad() && all.insert(p.value().unsafeGetTensorImpl()).second)
        elements += p.value().numel();
    }
    std::set<const void*> in_units;
    int64_t unit_elements = 0;
    for (size_t k = before; k < units_.size(); ++k)
      for (const auto& p : units_[k]->parameters()) {
        const void* key = p.unsafeGetTensorImpl();
        if (experts_.contains(p)) continue;
        if (p.requires_grad() && names[key] == 1 && in_units.insert(key).second)
          unit_elements += p.numel();
      }
    const std::string label = model_label(model, static_cast<int>(models_.size()));
    if (all.empty()) return;
    if (in_units.empty())
      throw ::tandem::Refused(
          ctx_.pg->prefix() + " " + options_.origin() + ": ZeRO-3 finds no module of " + label +
          " that it can gather and release (its " + std::to_string(all.size()) +
          " parameters would stay whole on every rank, which is ZeRO-2's memory under "
          "ZeRO-3's name): its layers are typed torch::nn members called directly, which no "
          "wrapper or hook reaches. Declare the model with TANDEM_MODULE(" +
          tandem::nn::module_type_name(model) +
          ") instead of TORCH_MODULE, which makes the whole model one unit (FSDP's root "
          "wrap), or its blocks with TANDEM_MODULE(Block) and its layers as tandem::nn::Linear "
          "(tandem/nn/module.h: one change per holder), or hold them in a torch::nn::Sequential "
          "or tandem::parallel::Sharded; or ask for ZeRO stage 2 (--zero_stage 2), which "
          "shards this model's gradients and optimizer state");
    if (ctx_.pg->rank() == 0) {
      std::ostringstream os;
      os << ctx_.pg->prefix() << " zero-3 on " << label << ": " << (units_.size() - before)
         << " unit" << (units_.size() - before == 1 ? "" : "s") << ", " << in_units.size()
         << " of " << all.size() << " parameters sharded (" << std::fixed
         << std::setprecision(1) << 100.0 * static_cast<double>(unit_elements) /
                static_cast<double>(std::max<int64_t>(1, elements))
         << "% of the elements)";
      if (in_units.size() < all.size())
        os << "; the rest (tied parameters and those outside every unit) stay whole on every "
              "rank";
      if (experts_) os << "; the experts stay whole on their expert-parallel ranks";
      std::cerr << os.str() << std::endl;
    }
  }
  void find_units(const std::shared_ptr<torch::nn::Module>& model) {
    // Note [ZeRO-3 units on hooks]: the units are the modules the user wrapped in Sharded, the
    // Sequential entries the auto-wrap policy picks (wrapped in Sharded in place), and hookable
    // modules (TANDEM_MODULE types, tandem::nn layers) anywhere in the model, which get a
    // "zero-3 unit" forward hook instead of a wrapper: a model that calls its blocks through
    // typed members (`for (auto& b : blocks) x = b(x);`) has per-block units too.
    for (const auto& m : model->modules(/*include_self=*/true))
      if (auto w = std::dynamic_pointer_cast<ShardedImpl>(m)) add_wrapper(w);
    if (options_.auto_wrap_policy() == "NO_WRAP") return;
    const auto& classes = options_.transformer_layer_cls_to_wrap();
    if (!classes.empty() && options_.auto_wrap_policy() == "TRANSFORMER_BASED_WRAP") {
      wrap_classes(*model, classes);
      return;
    }
    for (auto& w : wrap_sequential_entries(*model, options_.min_num_params())) add_wrapper(w);
    // Hookable modules outside every unit: the outermost ones with at least min_num_params
    // parameters (under TRANSFORMER_BASED_WRAP, modules a user declared, not tandem::nn's
    // standard layers).
    const bool any_layer = options_.auto_wrap_policy() == "SIZE_BASED_WRAP";
    std::function<void(torch::nn::Module&)> visit = [&](torch::nn::Module& m) {
      for (const auto& child : m.children()) {
        if (is_unit(*child)) continue;
        auto* h = tandem::nn::hookable(*child);
        if (h && (any_layer || !h->standard_layer()) &&
            parameter_count(*child) >= std::max<int64_t>(1, options_.min_num_params())) {
          add_hooked(child, "");
          continue;
        }
        visit(*child);
      }
    };
    visit(*model);
  }

  bool prepare_optimizer(torch::optim::Optimizer& optimizer) override;

  void set_sync(bool sync) override {
    sync_ = sync;
    for (auto& s : sharded_) s->reducer->set_sync(sync);
    for (auto& r : expert_reducers_) r->set_sync(sync);
  }
  void after_backward() override {
    for (auto& s : sharded_) s->reducer->after_backward();
    for (auto& r : expert_reducers_) r->after_backward();
    // Stage 3 without synchronisation (accumulation micro-steps): no reduction freed the units
    // that backward gathered; free them here.
    if (!sync_)
      for (auto& s : sharded_)
        for (auto& u : s->units) release_unit(u);
  }
  std::optional<std::array<double, 2>> grad_norm_parts(
      const std::function<bool(const at::Tensor&)>& split, double norm_type) override;
  void scale_gradients(double coef) override {
    at::NoGradGuard no_grad;
    for (auto& s : sharded_)
      for (auto& u : s->units)
        if (u.shard_param.grad().defined()) u.shard_param.mutable_grad().mul_(coef);
  }
  bool clip_grad_value(double clip_value) override {
    at::NoGradGuard no_grad;
    for (auto& s : sharded_)
      for (auto& u : s->units)
        if (u.shard_param.grad().defined())
          u.shard_param.mutable_grad().clamp_(-clip_value, clip_value);
    for (const auto& r : expert_reducers_)  // Note [Expert parallel]: whole on this rank
      for (const auto& p : r->parameters())
        if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().clamp_(-clip_value, clip_value);
    return true;
  }
  void after_step(torch::optim::Optimizer& optimizer) override;
  void step(torch::optim::Optimizer& optimizer) override;
  void zero_grad(torch::optim::Optimizer& optimizer) override {
    auto* s = find(optimizer);
    if (!s) return;
    for (const auto& p : s->reducer->parameters()) {
      auto& g = const_cast<at::Tensor&>(p).mutable_grad();
      if (!g.defined()) continue;
      if (options_.stage() == 1) {
        g.detach_();
        g.zero_();  // stays the view into its bucket
      } else {
        g.reset();  // micro-steps of no_sync leave local gradients; the step consumed them
      }
    }
  }
  bool shards_optimizer(const torch::optim::Optimizer& optimizer) const override {
    return find(optimizer) != nullptr;
  }
  checkpoint::OptimizerState optimizer_shard_state(
      const torch::optim::Optimizer& optimizer) const override;
  void load_optimizer_shards(
      torch::optim::Optimizer& optimizer,
      const std::function<std::string(int)>& json_of,
      const std::function<at::Tensor(int, const std::string&)>& tensor_of) override;
  void load_optimizer_resharded(torch::optim::Optimizer& optimizer,
                                const ResavedOptimizer& saved) override;
  void load_model_tensors(torch::nn::Module& model,
                          const std::function<at::Tensor(const std::string&)>& local) override;
  std::map<const void*, std::vector<checkpoint::TensorSlice>> released_slices(
      torch::nn::Module& model, std::vector<Unit*>& resident_copies);
  void gather_units() override {
    for (auto& s : sharded_)
      for (auto& u : s->units) gather_unit(u, *ctx_.pg);
  }
  void release_units() override {
    for (auto& s : sharded_)
      for (auto& u : s->units) release_unit(u);
  }
  std::vector<const GradientReducer*> reducers() const override {
    std::vector<const GradientReducer*> out;
    for (const auto& s : sharded_) out.push_back(s->reducer.get());
    for (const auto& r : expert_reducers_) out.push_back(r.get());
    return out;
  }
  ParameterSharding* parameter_sharding() override {
    return options_.stage() == 3 ? this : nullptr;
  }
  std::vector<CommSpan> take_comm_spans() override {
    std::vector<CommSpan> out;
    out.swap(comm_log_.spans);
    return out;
  }
  void record_comm_spans(bool record) override { comm_log_.record = record; }
  // The auto-wrap policy of prepare_model, seen from one module at a time: Sharded wrappers,
  // the named classes, or (the BuildScope already chose the outermost hookable modules) those
  // with enough parameters, tandem::nn's standard layers only under SIZE_BASED_WRAP.
  bool unit_at_construction(torch::nn::Module& m, bool explicit_unit) override {
    if (explicit_unit) return true;
    const auto& policy = options_.auto_wrap_policy();
    if (policy == "NO_WRAP") return false;
    auto* h = tandem::nn::hookable(m);
    if (!h) return false;
    const auto& classes = options_.transformer_layer_cls_to_wrap();
    if (!classes.empty() && policy == "TRANSFORMER_BASED_WRAP")
      return std::find(classes.begin(), classes.end(), h->type_name()) != classes.end();
    return (policy == "SIZE_BASED_WRAP" || !h->standard_layer()) &&
           parameter_count(m) >= std::max<int64_t>(1, options_.min_num_params());
  }
  void shard_built(torch::nn::Module& m) override;

 private:
  ShardedOptimizer* find(const torch::optim::Optimizer& o) const {
    for (const auto& s : sharded_)
      if (s->optimizer == &o) return s.get();
    return nullptr;
  }
  void check_same_layout(const ShardedOptimizer& s);

  static int64_t parameter_count(const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
  }
  bool is_unit(const torch::nn::Module& m) const {
    for (const auto& u : units_)
      if (u.get() == &m) return true;
    for (const auto& u : units_)
      if (auto* w = dynamic_cast<const ShardedImpl*>(u.get()); w && w->inner().get() == &m)
        return true;
    return false;
  }
  std::shared_ptr<UnitHooks> make_hooks() {
    auto hooks = std::make_shared<UnitHooks>();
    hooks->pg = ctx_.pg.get();
    hooks->prefetch = &prefetch_;
    hooks->log = &comm_log_;
    return hooks;
  }
  void add_wrapper(const std::shared_ptr<ShardedImpl>& w) {
    for (const auto& known : units_)
      if (known.get() == w.get()) return;
    auto hooks = make_hooks();
    w->set_hooks(hooks);
    units_.push_back(w);
    hooks_.push_back(hooks);
  }
  // A hookable module becomes a unit through a forward hook (what Sharded does around its
  // forward, sharded.cpp).
  void add_hooked(const std::shared_ptr<torch::nn::Module>& m, const std::string& path) {
    for (const auto& known : units_)
      if (known.get() == m.get()) return;
    auto* h = tandem::nn::hookable(*m);
    auto hooks = make_hooks();
    h->hooks().add("zero-3 unit", tandem::nn::order::kShard,
                   [hooks](const std::vector<at::Tensor>& in, const tandem::nn::TensorFunction& next) {
                     return detail::run_unit(hooks, [&] { return next(in); });
                   });
    (void)path;
    units_.push_back(m);
    hooks_.push_back(hooks);
  }
  // fsdp_transformer_layer_cls_to_wrap: every module of those classes is a unit, hookable ones
  // by a hook, Sequential entries by a Sharded wrapper; a class that names no module, or a
  // module that can be neither, is refused.
  void wrap_classes(torch::nn::Module& model, const std::vector<std::string>& classes) {
    auto wanted = [&](const torch::nn::Module& m) {
      return std::find(classes.begin(), classes.end(), tandem::nn::module_type_name(m)) !=
             classes.end();
    };
    std::set<std::string> found, present;
    for (auto& w : wrap_sequential_entries(model, 1, [&](torch::nn::Module& m) { return wanted(m); })) {
      found.insert(tandem::nn::module_type_name(*w->inner()));
      add_wrapper(w);
    }
    std::function<void(torch::nn::Module&, const std::string&)> visit =
        [&](torch::nn::Module& m, const std::string& prefix) {
          for (const auto& item : m.named_children()) {
            const auto& child = item.value();
            const std::string path = prefix.empty() ? item.key() : prefix + "." + item.key();
            if (is_unit(*child)) continue;
            present.insert(tandem::nn::module_type_name(*child));
            if (wanted(*child)) {
              if (!tandem::nn::hookable(*child))
                throw ::tandem::Refused(
                    ctx_.pg->prefix() + " " + options_.origin() + ": " + path + " is a " +
                    tandem::nn::module_type_name(*child) +
                    " (fsdp_transformer_layer_cls_to_wrap), but its parent calls it directly, "
                    "where no wrapper reaches it; declare it with TANDEM_MODULE(" +
                    tandem::nn::module_type_name(*child) +
                    ") instead of TORCH_MODULE (tandem/nn/module.h), or put it in a Sequential");
              found.insert(tandem::nn::module_type_name(*child));
              add_hooked(child, path);
              continue;
            }
            visit(*child, path);
          }
        };
    visit(model, "");
    std::string missing;
    for (const auto& c : classes)
      if (!found.count(c)) missing += (missing.empty() ? "" : ", ") + c;
    if (!missing.empty()) {
      std::string have;
      for (const auto& t : present) have += (have.empty() ? "" : ", ") + t;
      throw ::tandem::Refused(ctx_.pg->prefix() + " " + options_.origin() +
                                  ": fsdp_transformer_layer_cls_to_wrap names " + missing +
                                  ", which is no module of the model (its module types: " + have +
                                  "); name the class of the model's blocks, as declared "
                                  "(TANDEM_MODULE(Block) is \"Block\")");
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> model_state(torch::nn::Module& model) override;
  checkpoint::LoadReport load_model_state(torch::nn::Module& model, const std::string& path,
                                          const checkpoint::LoadOptions& options) override;

  ShardingOptions options_;
  StrategyContext ctx_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<std::shared_ptr<torch::nn::Module>> units_;  // stage 3: Sharded or hooked modules
  std::vector<std::shared_ptr<UnitHooks>> hooks_;          // of units_, in the same order
  std::vector<std::unique_ptr<ShardedOptimizer>> sharded_;
  HeldExperts experts_;  // Note [Expert parallel]
  std::vector<std::unique_ptr<GradientReducer>> expert_reducers_;  // one per optimizer with experts
  bool sync_ = true;
  // Note [Sharded construction]: units built under Accelerator::build, until prepare_optimizer
  // places their parameters.
  std::vector<std::unique_ptr<BuiltUnit>> built_;
  std::map<const void*, BuiltUnit*> built_of_;
  Prefetch prefetch_;  // Note [Prefetching units]
  CommLog comm_log_;
  BuiltUnit* built_of(const at::Tensor& p) const {
    auto it = built_of_.find(p.unsafeGetTensorImpl());
    return it == built_of_.end() ? nullptr : it->second;
  }
  // A built unit whose parameters all moved (or that is kept whole) is forgotten; its
  // parameters keep whatever storage they now have.
  void forget_built(BuiltUnit* b) {
    for (const auto& p : b->params) built_of_.erase(p.unsafeGetTensorImpl());
    built_.erase(std::remove_if(built_.begin(), built_.end(),
                                [b](const std::unique_ptr<BuiltUnit>& x) { return x.get() == b; }),
                 built_.end());
  }
};

}  // namespace tandem::parallel::detail::zero
