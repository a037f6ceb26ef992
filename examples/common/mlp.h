// The MLP of the examples and tests, and a learnable classification data set it makes itself.
#pragma once

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

namespace examples {

struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t in = 784, int64_t hidden = 512, int64_t classes = 10)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(torch::Tensor x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(MLP);

/// `size` points in `dim` dimensions labelled by a fixed random linear "teacher" (argmax of x W):
/// reproducible from the seed, and learnable by the MLP.
class TeacherClassification : public torch::data::datasets::Dataset<TeacherClassification> {
 public:
  /// The teacher comes from `teacher_seed`, the points from `data_seed`: two data sets with one
  /// teacher and different seeds are a train and a test set of the same task.
  TeacherClassification(int64_t size, int64_t dim = 784, int64_t classes = 10,
                        uint64_t data_seed = 1, uint64_t teacher_seed = 1000) {
    auto teacher = at::make_generator<at::CPUGeneratorImpl>(teacher_seed);
    auto w = at::randn({dim, classes}, teacher);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(data_seed);
    x_ = at::randn({size, dim}, gen);
    y_ = x_.matmul(w).argmax(1);
  }
  torch::data::Example<> get(size_t i) override {
    return {x_[static_cast<int64_t>(i)], y_[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x_.size(0)); }
  const torch::Tensor& inputs() const { return x_; }
  const torch::Tensor& labels() const { return y_; }

 private:
  torch::Tensor x_, y_;
};

}  // namespace examples
