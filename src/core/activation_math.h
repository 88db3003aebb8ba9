// Expert activations and their derivatives on scalars, shared by the CPU reference
// (src/cpu/experts.cpp) and the CUDA activation kernels: gelu (exact erf form, Megatron's default
// F.gelu), silu, relu, squared_relu, and the GLU combine act(gate) * up with its backward.
// Tests: tests/cpu/test_experts.cpp (values, derivatives by finite differences).
#pragma once
#include <math.h>

#include <type_traits>

#include "core/hd.h"

namespace moekit {

enum class Activation : int { gelu = 0, silu = 1, relu = 2, squared_relu = 3 };

// The --activation-func spellings; returns false for an unknown name.
inline bool activation_from_name(const char* name, Activation* out) {
    struct Entry {
        const char* name;
        Activation act;
    };
    constexpr Entry kEntries[] = {{"gelu", Activation::gelu},
                                  {"silu", Activation::silu},
                                  {"relu", Activation::relu},
                                  {"squared_relu", Activation::squared_relu}};
    for (const Entry& e : kEntries) {
        const char* a = e.name;
        const char* b = name;
        while (*a && *a == *b) ++a, ++b;
        if (*a == 0 && *b == 0) {
            *out = e.act;
            return true;
        }
    }
    return false;
}

inline const char* activation_name(Activation act) {
    switch (act) {
        case Activation::gelu:
            return "gelu";
        case Activation::silu:
            return "silu";
        case Activation::relu:
            return "relu";
        case Activation::squared_relu:
            return "squared_relu";
    }
    return "?";
}

// gelu(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); torch's F.gelu(approximate='none').
template <typename T>
MOEKIT_HD T gelu(T x) {
    return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752440)));
}
// d/dx = Phi(x) + x * phi(x), phi the standard normal density.
template <typename T>
MOEKIT_HD T gelu_grad(T x) {
    const T cdf = T(0.5) * (T(1) + erf(x * T(0.70710678118654752440)));
    const T pdf = T(0.39894228040143267794) * exp(T(-0.5) * x * x);
    return cdf + x * pdf;
}

template <typename T>
MOEKIT_HD T sigmoid(T x) {
    return T(1) / (T(1) + exp(-x));
}

// silu's sigmoid. On the GPU in fp32 its exp and division take the hardware approximations (ex2.approx,
// rcp.approx: ~1e-6 relative, far below the bf16 rounding of every value they feed): with the accurate expf and
// division the activation passes were bound by instructions, not memory (qwen3-30b SwiGLU forward 240 us at 51 % of
// DRAM bandwidth and 74 % of SM issue, ncu, H200, 2026-11-27). Elsewhere (the CPU, fp64) sigmoid itself.
template <typename T>
MOEKIT_HD T silu_sigmoid(T x) {
#ifdef __CUDA_ARCH__
    if constexpr (std::is_same_v<T, float>) return __fdividef(1.0f, 1.0f + __expf(-x));
#endif
    return sigmoid(x);
}

// silu(x) = x * sigmoid(x); d/dx = s (1 + x (1 - s)).
template <typename T>
MOEKIT_HD T silu(T x) {
    return x * silu_sigmoid(x);
}
template <typename T>
MOEKIT_HD T silu_grad(T x) {
    const T s = silu_sigmoid(x);
    return s * (T(1) + x * (T(1) - s));
}

// relu'(0) = 0, as torch.
template <typename T>
MOEKIT_HD T relu(T x) {
    return x > T(0) ? x : T(0);
}
template <typename T>
MOEKIT_HD T relu_grad(T x) {
    return x > T(0) ? T(1) : T(0);
}

// squared_relu(x) = relu(x)^2 (Primer); d/dx = 2 relu(x).
template <typename T>
MOEKIT_HD T squared_relu(T x) {
    const T r = relu(x);
    return r * r;
}
template <typename T>
MOEKIT_HD T squared_relu_grad(T x) {
    return T(2) * relu(x);
}

template <typename T>
MOEKIT_HD T activation_forward(Activation act, T x) {
    switch (act) {
        case Activation::gelu:
            return gelu(x);
        case Activation::silu:
            return silu(x);
        case Activation::relu:
            return relu(x);
        case Activation::squared_relu:
            return squared_relu(x);
    }
    return T(0);
}

template <typename T>
MOEKIT_HD T activation_grad(Activation act, T x) {
    switch (act) {
        case Activation::gelu:
            return gelu_grad(x);
        case Activation::silu:
            return silu_grad(x);
        case Activation::relu:
            return relu_grad(x);
        case Activation::squared_relu:
            return squared_relu_grad(x);
    }
    return T(0);
}

// GLU (Megatron gated_linear_unit, glu_linear_offset 0): fc1 rows are [gate | up], a = act(gate) * up.
template <typename T>
MOEKIT_HD T glu_forward(Activation act, T gate, T up) {
    return activation_forward(act, gate) * up;
}
// Given da = d loss / d a: d gate = da * up * act'(gate), d up = da * act(gate).
template <typename T>
MOEKIT_HD void glu_backward(Activation act, T gate, T up, T da, T* d_gate, T* d_up) {
    *d_gate = da * up * activation_grad(act, gate);
    *d_up = da * activation_forward(act, gate);
}
// glu_backward and glu_forward's value a = act(gate) * up in one, bit for bit the same, with act(gate) evaluated once
// (and silu's sigmoid once instead of three times): the GPU backward (activation.cu, the fused dgrad epilogue)
// needs all three per element, and recomputing was most of its instructions.
template <typename T>
MOEKIT_HD void glu_backward_and_value(Activation act, T gate, T up, T da, T* d_gate, T* d_up, T* a) {
    if (act == Activation::silu) {
        const T s = silu_sigmoid(gate);
        const T f = gate * s;                                  // silu(gate)
        *d_gate = da * up * (s * (T(1) + gate * (T(1) - s)));  // silu_grad(gate)
        *d_up = da * f;
        *a = f * up;
        return;
    }
    const T f = activation_forward(act, gate);
    *d_gate = da * up * activation_grad(act, gate);
    *d_up = da * f;
    *a = f * up;
}

}  // namespace moekit
