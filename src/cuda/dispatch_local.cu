// EP = 1 dispatcher (see dispatcher.h): permute into expert-major rows, combine by gathering each token's
// rows; no communication. These are the kernels the single-GPU layer always ran, so EP = 1 through the
// pipeline costs nothing extra. Twin: the EP = 1 branches of src/cpu/dispatch_*.cpp.
#include "cuda/combine.cuh"
#include "cuda/device_buffer.h"
#include "cuda/dispatcher.h"

namespace moekit::cuda {
namespace {

using bf16 = __nv_bfloat16;

template <typename R>
class LocalDispatcher final : public CudaDispatcher<R> {
public:
    explicit LocalDispatcher(const DispatchShape& s) : shape_(s), rows_(s.plan_max_rows * s.router.hidden) {}

    std::string name() const override { return "local"; }
    int64_t num_local_experts() const override { return shape_.router.num_experts; }
    int64_t expert_max_rows() const override { return shape_.plan_max_rows; }
    size_t allocated_bytes() const override { return rows_.bytes(); }
    size_t saved_bytes() const override { return rows_.bytes(); }
    bf16* expert_rows_buffer() override { return rows_.get(); }

    bool set_rows_deferred(bool on) override { return deferred_ = on; }
    ExpertInput<R> dispatch(const RoutingPlan<R>& plan, const uint8_t*, const R*, const bf16* hidden,
                            cudaStream_t stream) override {
        if (!deferred_) write_rows(plan, hidden, stream);
        ExpertInput<R> in{plan.num_experts, plan.max_rows, rows_.get(), plan.row_prob, plan.offsets};
        in.rows_pending = deferred_;
        return in;
    }
    void write_rows(const RoutingPlan<R>& plan, const bf16* hidden, cudaStream_t stream) override {
        permute_rows<R>(plan, shape_.router.hidden, hidden, rows_.get(), stream);
    }
    void combine(const RoutingPlan<R>& plan, const bf16* expert_out, const bf16* shared_out, const float* shared_gate,
                 bf16* out, cudaStream_t stream) override {
        combine_forward<R>(plan, shape_.router.hidden, expert_out, shared_out, shared_gate, out, stream);
    }
    const bf16* combine_backward(const RoutingPlan<R>& plan, const bf16* grad_out, bf16* scratch,
                                 cudaStream_t stream) override {
        cuda::combine_backward<R>(plan, shape_.router.hidden, grad_out, scratch, stream);
        return scratch;
    }
    bool backward_leaves_expert_rows() const override { return true; }  // it reads only its arguments
    void dispatch_backward(const RoutingPlan<R>& plan, const uint8_t* map, const bf16* grad_rows,
                           const R* grad_row_probs, float* grad_input, bool accumulate, R* grad_probs,
                           cudaStream_t stream) override {
        permute_rows_backward<R>(plan, shape_.router.hidden, grad_rows, grad_input, accumulate, stream);
        scatter_row_probs_grad<R>(plan, map, grad_row_probs, grad_probs, stream);
    }

private:
    DispatchShape shape_;
    DeviceBuffer<bf16> rows_;
    bool deferred_ = false;
};

}  // namespace

int64_t DispatchShape::rows_per_source() const {
    const int64_t L = local_experts(), T = router.num_tokens;
    if (!router.dropless() && router.pad_to_capacity) return plan_max_rows / router.num_experts * L;
    return std::min(plan_max_rows, T * std::min<int64_t>(router.topk, L));
}

template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_local_dispatcher(const DispatchShape& shape) {
    return std::make_unique<LocalDispatcher<R>>(shape);
}

template <typename R>
std::unique_ptr<CudaDispatcher<R>> make_cuda_dispatcher(const std::string& type, const DispatchShape& shape,
                                                        DeviceComm* ep) {
    if (shape.ep_size == 1) return make_local_dispatcher<R>(shape);
    MOEKIT_CHECK(ep && ep->size() == shape.ep_size, "EP=", shape.ep_size, " needs a device communicator of that size");
    if (type == "allgather") return make_allgather_cuda_dispatcher<R>(shape, *ep);
    MOEKIT_REQUIRE(type == "alltoall" || type == "flex", "--moe-token-dispatcher-type=", type,
                   ": --device cuda with EP > 1 supports allgather, alltoall and flex");
    if (shape.receive_factor > 0 || shape.echo_slots > 0) return make_budgeted_cuda_dispatcher<R>(shape, *ep);
    return make_alltoall_cuda_dispatcher<R>(shape, *ep);
}

#define MOEKIT_INSTANTIATE_DISPATCHER(R)                                                                      \
    template std::unique_ptr<CudaDispatcher<R>> make_local_dispatcher<R>(const DispatchShape&);               \
    template std::unique_ptr<CudaDispatcher<R>> make_cuda_dispatcher<R>(const std::string&, const DispatchShape&, \
                                                                        DeviceComm*);
MOEKIT_INSTANTIATE_DISPATCHER(float)
MOEKIT_INSTANTIATE_DISPATCHER(double)

}  // namespace moekit::cuda
