"""torch._grouped_mm expert MLP (fc1 grouped GEMM [R,H]x[E,H,2F], SwiGLU x probs, fc2 [R,F]x[E,F,H]) on moekit's
per-expert counts, bf16: training forward and forward+backward (autograd: dgrad and wgrad, bf16 weight grads set
to None each step). Twin of moekit's --scope mlp step (bench/lib/bench_expert_mlp.cu mlp_step)."""
import torch
import torch.nn.functional as F

from peer_timing import reason, time_ms, uniform


def run(preset, counts, iters, warmup, seed):
    H, Fd, E = preset["H"], preset["F"], preset["E"]
    R = sum(counts)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = 0.02 * 3 ** 0.5
    x = uniform((R, H), 1.0, gen).requires_grad_()
    w1 = uniform((E, 2 * Fd, H), w, gen).requires_grad_()  # Megatron's fc1 per expert: [2F, H]
    w2 = uniform((E, H, Fd), w, gen).requires_grad_()
    probs = (torch.rand((R, 1), generator=gen, device="cuda") * 0.95 + 0.05).to(torch.bfloat16).requires_grad_()
    dy = uniform((R, H), 1.0, gen)
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)

    def forward():
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up * probs
        return torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)

    def fwd_bwd():
        for t in (x, w1, w2, probs):
            t.grad = None
        forward().backward(dy)

    fwd_ms = time_ms(forward, warmup, iters)
    note = "permuted rows in, no gather/scatter; bf16 wgrad"
    try:  # a backward it cannot do leaves the forward's time standing
        fb_ms = time_ms(fwd_bwd, warmup, iters)
    except Exception as e:
        fb_ms, note = None, "backward failed: " + reason(e)
    return dict(scope="mlp", fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms, note=note)
