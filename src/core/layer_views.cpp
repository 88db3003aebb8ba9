// TensorView basics and the shared view checks (see layer_views.h).
#include "core/layer_views.h"

#include <sstream>

#include "moekit/error.h"

namespace moekit {

const char* backend_name(Backend backend) { return backend == Backend::cuda ? "cuda" : "cpu"; }

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> dims, Backend backend_, int device_)
    : data(data_), dtype(dtype_), backend(backend_), device(device_) {
    MOEKIT_CHECK(dims.size() <= size_t(kMaxDims), "a TensorView has at most ", kMaxDims, " dimensions");
    for (int64_t d : dims) shape[size_t(ndim++)] = d;
}

int64_t TensorView::numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[size_t(i)];
    return n;
}

std::string TensorView::to_string() const {
    std::ostringstream os;
    os << dtype_name(dtype) << "[";
    for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[size_t(i)];
    os << "] on " << backend_name(backend);
    if (backend == Backend::cuda) os << ":" << device;
    return os.str();
}

namespace {
std::string shape_string(std::initializer_list<int64_t> shape) {
    std::ostringstream os;
    os << "[";
    int i = 0;
    for (int64_t d : shape) os << (i++ ? ", " : "") << d;
    return os.str() + "]";
}
}  // namespace

void check_view(const char* name, const TensorView& v, DType dtype, std::initializer_list<int64_t> shape,
                const ViewRules& rules, Need need) {
    const std::string want = str(dtype_name(dtype), shape_string(shape), " on ", backend_name(rules.backend),
                                 rules.backend == Backend::cuda ? str(":", rules.device) : std::string());
    if (v.empty()) {
        MOEKIT_REQUIRE(need != Need::required, name, ": null view, expected ", want);
        return;
    }
    MOEKIT_REQUIRE(need != Need::absent, name, ": given (", v.to_string(), ") but this configuration has no such tensor");
    bool same_shape = v.ndim == int(shape.size());
    int i = 0;
    for (int64_t d : shape) same_shape = same_shape && v.shape[size_t(i++)] == d;
    MOEKIT_REQUIRE(v.backend == rules.backend && (rules.backend == Backend::cpu || v.device == rules.device) &&
                       v.dtype == dtype && same_shape,
                   name, ": got ", v.to_string(), ", expected ", want);
}

void check_params(const MoeConfig& c, const LayerParams& p, const ViewRules& r) {
    const int64_t E = c.num_experts(), H = c.hidden_size, F = c.expert_ffn(), F1 = c.fc1_rows();
    const int64_t Le = r.local_experts > 0 ? r.local_experts : E;  // experts held by fc1/fc2
    const int64_t Fs = c.shared_ffn(), Fs1 = Fs * (c.gated_linear_unit ? 2 : 1);
    check_view("router.weight", p.router_weight, r.param, {E, H}, r);
    check_view("router.expert_bias", p.expert_bias, r.bias, {E}, r, needed_if(c.moe_router_enable_expert_bias));
    check_view("fc1", p.fc1, r.param, {Le, F1, H}, r);
    check_view("fc2", p.fc2, r.param, {Le, H, F}, r);
    check_view("shared_experts.linear_fc1", p.shared_fc1, r.param, {Fs1, H}, r, needed_if(Fs > 0));
    check_view("shared_experts.linear_fc2", p.shared_fc2, r.param, {H, Fs}, r, needed_if(Fs > 0));
    check_view("shared_experts.gate_weight", p.shared_gate, r.param, {1, H}, r, needed_if(Fs > 0 && c.moe_shared_expert_gate));
}

void check_grads(const MoeConfig& c, const LayerGrads& g, const ViewRules& r) {
    const int64_t E = c.num_experts(), H = c.hidden_size, F = c.expert_ffn(), F1 = c.fc1_rows();
    const int64_t Le = r.local_experts > 0 ? r.local_experts : E;  // experts held by fc1/fc2
    const int64_t Fs = c.shared_ffn(), Fs1 = Fs * (c.gated_linear_unit ? 2 : 1);
    const DType f = DType::f32;
    check_view("grad router.weight", g.router_weight, f, {E, H}, r);
    check_view("grad fc1", g.fc1, f, {Le, F1, H}, r);
    check_view("grad fc2", g.fc2, f, {Le, H, F}, r);
    check_view("grad shared_experts.linear_fc1", g.shared_fc1, f, {Fs1, H}, r, needed_if(Fs > 0));
    check_view("grad shared_experts.linear_fc2", g.shared_fc2, f, {H, Fs}, r, needed_if(Fs > 0));
    check_view("grad shared_experts.gate_weight", g.shared_gate, f, {1, H}, r, needed_if(Fs > 0 && c.moe_shared_expert_gate));
}

void check_forward_args(const MoeConfig& c, const LayerBounds& b, const ForwardArgs& a, const ViewRules& r) {
    const int64_t T = b.num_tokens(), H = c.hidden_size;
    check_view("input", a.input, r.activation, {T, H}, r);
    check_view("output", a.output, r.activation, {T, H}, r);
    check_view("padding_mask", a.padding_mask, DType::u8, {T}, r, Need::optional);
    check_view("jitter_seed", a.jitter_seed, DType::i64, {1}, r, Need::optional);
    MOEKIT_REQUIRE(a.input.data != a.output.data, "output: must not alias input");
}

void check_backward_args(const MoeConfig& c, const LayerBounds& b, const BackwardArgs& a, const ViewRules& r) {
    const int64_t T = b.num_tokens(), H = c.hidden_size;
    check_view("grad_output", a.grad_output, r.activation, {T, H}, r);
    check_view("grad_input", a.grad_input, r.grad_input, {T, H}, r);
}

}  // namespace moekit
