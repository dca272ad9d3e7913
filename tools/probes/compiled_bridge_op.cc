#include "paddle/extension.h"
#include <vector>

// Forward: returns a copy of x (stands in for "replay the forward graph, hand out the static output").
std::vector<paddle::Tensor> BridgeForward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& params) {
  return {x.copy_to(x.place(), false)};
}

// Backward: x's grad is a copy of out's grad; each parameter's grad is a copy of the parameter
// (stands in for "replay the backward graph, hand out the static grads").
std::vector<paddle::Tensor> BridgeBackward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& params,
                                           const paddle::Tensor& grad_out) {
  std::vector<paddle::Tensor> outs;
  outs.push_back(grad_out.copy_to(grad_out.place(), false));
  for (auto& p : params) outs.push_back(p.copy_to(p.place(), false));
  return outs;
}

PD_BUILD_OP(graph_bridge)
    .Inputs({"X", paddle::Vec("Params")})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(BridgeForward));

PD_BUILD_GRAD_OP(graph_bridge)
    .Inputs({"X", paddle::Vec("Params"), paddle::Grad("Out")})
    .Outputs({paddle::Grad("X"), paddle::Grad(paddle::Vec("Params"))})
    .SetKernelFn(PD_KERNEL(BridgeBackward));
