// Uses the installed tandem: state, a process group of one, a collective. Includes every header
// of <tandem/tandem.h>, so that the installed API compiles with the consumer's compiler (CMake's
// default), whichever compiler built the library.
#include <iostream>

#include <ATen/ATen.h>
#include <tandem/tandem.h>

int main() {
  auto state = tandem::ProcessState::from_environment();
  auto pg = tandem::ProcessGroup::create(state);
  auto t = tandem::comm::reduce(*pg, at::ones({3}), tandem::ReduceOp::kSum);
  std::cout << "consumer: tandem " << tandem::kVersion << " world " << pg->size() << " sum "
            << t.sum().item<float>() << std::endl;
  return t.sum().item<float>() == 3.0f * pg->size() ? 0 : 1;
}
