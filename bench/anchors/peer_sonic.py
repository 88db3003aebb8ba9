"""SonicMoE (PyPI `sonic-moe`, CuTe-DSL kernels compiled at run time) on a preset, bf16 SwiGLU, no biases; a
measuring stick only. Two timings: its whole layer with its own router (top-k then softmax) on inputs skewed the
way moekit bench skews (bench/lib/bench_util.cuh apply_zipf_skew), and its expert path (gather, grouped MLP,
aggregate; no router) on a routing with moekit's exact per-expert counts (anchor_math.token_expert_pairs)."""
import math
import os

import torch

from anchor_math import token_expert_pairs
from peer_timing import free, time_ms, uniform


# Its GEMMs autotune over 44 SM90 configurations per GEMM kind and shape, each compiled at run time (the first
# device call spent > 330 s on mixtral alone). SONIC_TUNE=narrow (default) keeps four configurations that cover its
# tile families (128x192 / 128x128 ping-pong, 256x128 / 128x256 cooperative); "default" its single default; "full" all.
_NARROW = {(128, 192, True, 2, 1), (128, 128, True, 2, 1), (256, 128, False, 2, 1), (128, 256, False, 1, 2)}
TUNE = os.environ.get("SONIC_TUNE", "narrow")


def _restrict_autotune():
    """Must run before sonicmoe imports quack.gemm_interface (its decorators read the configuration list)."""
    if TUNE == "full":
        return
    import quack.gemm_config as gc
    full = gc._get_sm90_configs
    default = gc.GemmConfig()

    def narrowed(epilogue=None, tune_coop=True):
        cs = full(epilogue, tune_coop)
        key = (lambda c: (c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n, c.swap_ab))
        want = {k + (False,) for k in _NARROW} if TUNE == "narrow" else \
            {(default.tile_m, default.tile_n, default.pingpong, default.cluster_m, default.cluster_n, False)}
        return [c for c in cs if key(c) in want] or cs[:1]
    gc._get_sm90_configs = narrowed


def tune_note():
    return {"narrow": "autotune over 4 SM90 configs", "default": "its default config, no autotune",
            "full": "full autotune"}.get(TUNE, "SONIC_TUNE=%s" % TUNE)


def import_sonic():
    if TUNE not in ("narrow", "default", "full"):
        raise ValueError("SONIC_TUNE=%s must be narrow, default or full" % TUNE)
    _restrict_autotune()
    import sonicmoe  # noqa: F401  (an ImportError here is reported as "sonic: failed: import ...")
    from sonicmoe import moe_general_routing_inputs, moe_TC_softmax_topk_layer
    return moe_TC_softmax_topk_layer, moe_general_routing_inputs


def _weights(p, gen):
    H, Fd, E = p["H"], p["F"], p["E"]
    w = 0.02 * 3 ** 0.5
    # SonicMoE's layout: w1 (2F, H, E) and w2 (H, F, E) as permuted views of per-expert [2F, H] / [H, F].
    w1 = uniform((E, 2 * Fd, H), w, gen).requires_grad_()
    w2 = uniform((E, H, Fd), w, gen).requires_grad_()
    return w1, w2


def _fwd_bwd(step, leaves, dy):
    def fb():
        for t in leaves:
            t.grad = None
        step().backward(dy)
    return fb


def run_layer(p, zipf_s, iters, warmup, seed):
    """Its layer (router included) with its own routing; counts range reported in the note."""
    layer, _ = import_sonic()
    H, E, T, k = p["H"], p["E"], p["T"], p["k"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = uniform((T, H), 1.0, gen)
    router_w = uniform((E, H), 0.02 * 3 ** 0.5, gen)
    if zipf_s > 0:  # moekit bench's skew: input column 0 = 1, router column 0 = -S*log(e+1)*noise
        noise = math.sqrt(H / 3.0) * 0.02
        x[:, 0] = 1.0
        router_w[:, 0] = torch.tensor([-zipf_s * math.log(e + 1) * noise for e in range(E)], device="cuda")
    x.requires_grad_()
    router_w.requires_grad_()
    w1, w2 = _weights(p, gen)
    dy = uniform((T, H), 1.0, gen)
    stream = torch.cuda.current_stream().cuda_stream

    last = {}

    def step():
        out, _, last["freq"] = layer(x, router_w, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, k, stream,
                                     "swiglu")
        return out

    fb = _fwd_bwd(step, (x, router_w, w1, w2), dy)
    fb()  # first call compiles and autotunes
    fwd_ms = time_ms(step, warmup, iters)
    fb_ms = time_ms(fb, warmup, iters)
    counts = last["freq"].tolist()
    # Its weight gradients are bf16 (autograd's .grad of bf16 weights). Megatron trains bf16 with fp32 main grads,
    # and a wgrad without gradient-accumulation fusion reaches them by main_grad += grad after the backward;
    # moekit's wgrads write the fp32 main grad themselves. Timed as a second figure, the plain one stays the anchor.
    # Where the fp32 main grads do not fit beside its bf16 grads (dsv3-e256 on an 80 GB H100: 45 GB more), the anchor
    # stands alone and the note says why the second figure is missing.
    params = (router_w, w1, w2)
    fb_main_ms, main_note, mains = None, "", []
    try:
        mains = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in params]

        def fb_main_grad():
            fb()
            for m, t in zip(mains, params):
                m.add_(t.grad)
        fb_main_ms = time_ms(fb_main_grad, warmup, iters)
    except torch.cuda.OutOfMemoryError:
        main_note = "; +main grad not timed: its fp32 main grads do not fit in device memory"
    del x, router_w, w1, w2, dy, params, mains
    free()
    return dict(scope="layer", fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms, fwd_bwd_main_grad_ms=fb_main_ms,
                note="own router (top-k, softmax); tokens/expert %d..%d; %s%s" % (min(counts), max(counts), tune_note(),
                                                                                 main_note))


def run_expert_path(p, counts, iters, warmup, seed):
    """Its general-routing entry (no router) on moekit's per-expert counts, scores' gradient included."""
    _, general = import_sonic()
    H, E, T = p["H"], p["E"], p["T"]
    pairs = token_expert_pairs(counts, T)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    tok = torch.tensor([t for t, _ in pairs], dtype=torch.int32, device="cuda")
    exp = torch.tensor([e for _, e in pairs], dtype=torch.int32, device="cuda")
    scores = (torch.rand(len(pairs), generator=gen, device="cuda") * 0.95 + 0.05).requires_grad_()
    x = uniform((T, H), 1.0, gen).requires_grad_()
    w1, w2 = _weights(p, gen)
    dy = uniform((T, H), 1.0, gen)
    stream = torch.cuda.current_stream().cuda_stream

    def step():
        return general(x, scores, tok, exp, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, E, stream,
                       _swiglu())[0]

    fb = _fwd_bwd(step, (x, scores, w1, w2), dy)
    fb()  # compile
    fwd_ms = time_ms(step, warmup, iters)
    fb_ms = time_ms(fb, warmup, iters)
    del x, scores, w1, w2, dy
    free()
    return dict(scope="layer", fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms,
                note="no router: gather+MLP+aggregate on moekit's counts; %s" % tune_note())


def _swiglu():
    from sonicmoe.enums import ActivationType
    return ActivationType.SWIGLU
