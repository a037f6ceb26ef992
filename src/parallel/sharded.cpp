// Sharded modules and the auto-wrap of Sequential entries (see sharded.h).
#include "tandem/parallel/sharded.h"

#include <torch/nn/modules/container/sequential.h>

#include "detail/adopt.h"
#include "tandem/nn/module.h"

namespace tandem::parallel {

void ShardedImpl::adopt() {
  detail::adopt_members(*this, *inner_.ptr());
  // Under Accelerator::build, a Sharded wrapper is a unit as soon as it is made.
  if (auto* scope = tandem::nn::detail::BuildScope::current()) scope->report_unit(*this);
}

namespace detail {

std::vector<at::Tensor> run_unit(const std::shared_ptr<ShardedHooks>& hooks,
                                 const std::function<std::vector<at::Tensor>()>& forward) {
  hooks->before_forward();
  std::vector<at::Tensor> out;
  try {
    out = forward();
  } catch (...) {
    hooks->after_forward();
    throw;
  }
  for (auto& o : out)
    if (o.defined() && o.requires_grad())
      o.register_hook([hooks](at::Tensor grad) {
        hooks->before_backward();
        return grad;
      });
  hooks->after_forward();
  return out;
}

}  // namespace detail

void ShardedImpl::save(torch::serialize::OutputArchive& archive) const {
  tandem::nn::detail::refuse_released_parameters(*this, inner_.ptr()->name(), "torch::save");
  torch::nn::Module::save(archive);
}

void ShardedImpl::load(torch::serialize::InputArchive& archive) {
  tandem::nn::detail::refuse_released_parameters(*this, inner_.ptr()->name(), "torch::load");
  torch::nn::Module::load(archive);
}

torch::Tensor ShardedImpl::forward(torch::Tensor input) {
  if (!hooks_) return inner_.forward(std::move(input));
  return detail::run_unit(hooks_, [&] {
           return std::vector<at::Tensor>{inner_.forward(std::move(input))};
         }).front();
}

namespace {

int64_t parameter_count(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

void visit(torch::nn::Module& m, int64_t min_num_params, const UnitPredicate& predicate,
           std::vector<std::shared_ptr<ShardedImpl>>& made) {
  if (dynamic_cast<ShardedImpl*>(&m)) return;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    const auto children = seq->named_children();
    const bool named = children.size() == seq->size();
    size_t index = 0;
    for (auto& any : *seq) {
      auto ptr = any.ptr();
      const size_t i = index++;
      if (dynamic_cast<ShardedImpl*>(ptr.get())) continue;
      if (parameter_count(*ptr) >= std::max<int64_t>(1, min_num_params) &&
          (!predicate || predicate(*ptr))) {
        Sharded wrapper(any);
        made.push_back(wrapper.ptr());
        any = torch::nn::AnyModule(wrapper);
        // Registered in the entry's place too, so that named_modules() shows the unit (its
        // children and parameters keep their names: the wrapper registers the entry's own).
        if (named && children[i].value().get() == ptr.get())
          seq->replace_module(children[i].key(), wrapper.ptr());
      } else {
        visit(*ptr, min_num_params, predicate, made);
      }
    }
    return;
  }
  for (const auto& child : m.children()) visit(*child, min_num_params, predicate, made);
}

}  // namespace

std::vector<std::shared_ptr<ShardedImpl>> wrap_sequential_entries(torch::nn::Module& model,
                                                                  int64_t min_num_params,
                                                                  const UnitPredicate& predicate) {
  std::vector<std::shared_ptr<ShardedImpl>> made;
  visit(model, min_num_params, predicate, made);
  return made;
}

}  // namespace tandem::parallel
