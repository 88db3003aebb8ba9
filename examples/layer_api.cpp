// A program using moekit as a library, as a framework binding would: build one MoE layer from a MoeConfig
// through the public API (include/moekit/), own every buffer, run forward and backward on them, and check
// the input gradient against a finite difference of L(x) = <output(x), r>. With every expert routed (top-k =
// E) the layer is smooth, so the central difference along the gradient must match <dL/dx, dx>.
// Built by CMake as build/example_layer_api; run on the CPU by the test suite (ctest -R example).
#include <cmath>
#include <cstdio>
#include <vector>

#include "moekit/device_layer.h"
#include "moekit/error.h"
#include "moekit/weights.h"

int main() {
    using namespace moekit;
    MoeConfig config;
    config.hidden_size = 32;
    config.num_moe_experts = 4;
    config.moe_ffn_hidden_size = 16;
    config.moe_router_topk = 4;  // every expert: no routing decision to flip under a small perturbation
    config.gated_linear_unit = true;
    config.activation_func = "silu";
    config.moe_shared_expert_intermediate_size = 8;
    config.seq_length = 8;
    config.micro_batch_size = 2;
    config.validate();
    const int64_t T = config.seq_length * config.micro_batch_size, H = config.hidden_size, E = config.num_experts();
    const int64_t F = config.expert_ffn(), F1 = config.fc1_rows(), Fs = config.shared_ffn();

    try {
        std::unique_ptr<Layer> layer =
            Layer::create(config, LayerBounds{config.seq_length, config.micro_batch_size}, Backend::cpu);

        // Parameters in the API's layouts (experts stacked), initialised as Megatron does.
        const MoeWeights<float> w = init_weights<float>(config, 2024);
        std::vector<float> router = w.router_weight.data, fc1, fc2, sfc1 = w.shared_fc1.data, sfc2 = w.shared_fc2.data;
        for (int64_t e = 0; e < E; ++e) {
            fc1.insert(fc1.end(), w.fc1[size_t(e)].data.begin(), w.fc1[size_t(e)].data.end());
            fc2.insert(fc2.end(), w.fc2[size_t(e)].data.begin(), w.fc2[size_t(e)].data.end());
        }
        LayerParams params;
        params.router_weight = host_view(router.data(), {E, H});
        params.fc1 = host_view(fc1.data(), {E, F1, H});
        params.fc2 = host_view(fc2.data(), {E, H, F});
        params.shared_fc1 = host_view(sfc1.data(), {2 * Fs, H});
        params.shared_fc2 = host_view(sfc2.data(), {H, Fs});
        std::vector<float> g_router(router.size()), g_fc1(fc1.size()), g_fc2(fc2.size()), g_sfc1(sfc1.size()),
            g_sfc2(sfc2.size());
        LayerGrads grads{host_view(g_router.data(), {E, H}), host_view(g_fc1.data(), {E, F1, H}),
                         host_view(g_fc2.data(), {E, H, F}), host_view(g_sfc1.data(), {2 * Fs, H}),
                         host_view(g_sfc2.data(), {H, Fs}), TensorView()};

        std::vector<float> x(size_t(T * H)), r(size_t(T * H)), y(size_t(T * H)), gx(size_t(T * H));
        for (size_t i = 0; i < x.size(); ++i) {
            x[i] = float(std::sin(0.37 * double(i)) + 0.2 * std::cos(1.3 * double(i)));
            r[i] = float(std::cos(0.11 * double(i) + 0.5));
        }
        auto loss = [&](const std::vector<float>& input) {
            ForwardArgs a;
            a.input = host_view(const_cast<float*>(input.data()), {T, H});
            a.output = host_view(y.data(), {T, H});
            layer->forward(params, a, Stream{});
            double l = 0;
            for (size_t i = 0; i < y.size(); ++i) l += double(y[i]) * double(r[i]);
            return l;
        };

        loss(x);
        BackwardArgs b;
        b.grad_output = host_view(r.data(), {T, H});
        b.grad_input = host_view(gx.data(), {T, H});
        layer->backward(params, grads, b, Stream{});

        // Directional derivative along d = dL/dx / |dL/dx|: analytic |dL/dx| against a central difference.
        double norm = 0;
        for (float v : gx) norm += double(v) * double(v);
        norm = std::sqrt(norm);
        const double h = 1e-2;
        std::vector<float> plus = x, minus = x;
        for (size_t i = 0; i < x.size(); ++i) {
            plus[i] += float(h * gx[i] / norm);
            minus[i] -= float(h * gx[i] / norm);
        }
        const double numeric = (loss(plus) - loss(minus)) / (2 * h);
        const double rel = std::abs(numeric - norm) / norm;
        double grad_sum = 0;
        for (float v : g_fc1) grad_sum += std::abs(v);
        std::printf("moekit layer API example: |dL/dx| = %.6f, central difference %.6f, relative error %.2e; "
                    "sum |dL/dfc1| = %.4f\n",
                    norm, numeric, rel, grad_sum);
        if (!(rel < 1e-2) || !(grad_sum > 0)) {
            std::printf("FAILED: the input gradient does not match the finite difference (or fc1 got no gradient)\n");
            return 1;
        }
        std::printf("OK\n");
        return 0;
    } catch (const Error& e) {
        std::fprintf(stderr, "moekit: %s\n", e.what());
        return 1;
    }
}
