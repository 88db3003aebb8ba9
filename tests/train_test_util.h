// Helpers of the training tests (tests/cpu/test_train*.cpp, tests/gpu/test_cuda_train.cu): a small SwiGLU
// teacher-student run of any size, and a file's bytes (checkpoints are compared as files).
#pragma once
#include <fstream>
#include <sstream>
#include <string>

#include "train/trainer.h"

namespace moekit::train {

// hidden H, E experts, FFN F, top-k, S x B tokens, 2 layers, aux loss 1e-2; steps and the rest left at defaults.
inline TrainOptions small_training(int64_t H, int64_t E, int64_t F, int64_t k, int64_t S, int64_t B,
                                   const std::string& device = "cpu") {
    TrainOptions o;
    o.config.hidden_size = H, o.config.num_moe_experts = E, o.config.moe_ffn_hidden_size = F;
    o.config.moe_router_topk = k;
    o.config.gated_linear_unit = true, o.config.activation_func = "silu";
    o.config.num_layers = 2;
    o.config.seq_length = S, o.config.micro_batch_size = B;
    o.config.moe_aux_loss_coeff = {1e-2};
    o.device = device;
    return o;
}

inline std::string file_bytes(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    return s.str();
}

}  // namespace moekit::train
