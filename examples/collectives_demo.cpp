// Every collective of tandem on N processes, with its result printed by each rank.
//   tandem launch --num_processes 2 --cpu build/examples/collectives_demo
#include <torch/torch.h>

#include <iostream>

#include "tandem/comm/collectives.h"

int main() {
  try {
    auto state = tandem::ProcessState::from_environment();
    auto pg = tandem::ProcessGroup::create(state);
    namespace comm = tandem::comm;
    const int r = pg->rank();
    auto show = [&](const std::string& what, const torch::Tensor& t) {
      auto v = t.flatten().to(torch::kDouble);
      std::string s = "[";
      for (int64_t i = 0; i < v.numel(); ++i)
        s += (i ? ", " : "") + std::to_string(v[i].item<double>()).substr(0, 5);
      std::cout << what << ": " << s << "]" << std::endl;
    };
    auto mine = torch::full({r + 1}, static_cast<float>(r));
    show("gather of rank-sized tensors", comm::gather(*pg, mine));
    show("reduce sum of [r, 1]", comm::reduce(*pg, torch::tensor({1.0f * r, 1.0f}), tandem::ReduceOp::kSum));
    show("reduce mean of [r, 1]", comm::reduce(*pg, torch::tensor({1.0f * r, 1.0f}), tandem::ReduceOp::kMean));
    auto b = r == 0 ? torch::arange(4.0) : torch::zeros({4});
    comm::broadcast(*pg, b, 0);
    show("broadcast from rank 0", b);
    show("pad_across_processes", comm::pad_across_processes(*pg, mine, 0, -1.0));
    auto objs = comm::gather_object(*pg, "hello from rank " + std::to_string(r));
    for (const auto& o : objs) std::cout << "gather_object: " << o << std::endl;
    std::cout << "broadcast_object: " << comm::broadcast_object(*pg, r == 0 ? "rank 0 says hi" : "")
              << std::endl;
    comm::wait_for_everyone(*pg);
    std::cout << "done on rank " << r << " of " << pg->size() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
