// Must not compile: PipelineEngine's stages move their boundary tensors and the loss through host
// memory, so a device engine under it is refused.
#include <parallel/pipeline/pipeline_engine.hpp>
#include <zero/nn/gpt.hpp>
using Pipe = zero::parallel::pipeline::PipelineEngine<zero::nn::GPT<float>, zero::ZeroStage<1>,
                                                      zero::Compute<zero::Cuda>>;
int main() {
  return sizeof(Pipe) > 0 ? 0 : 1;
}
