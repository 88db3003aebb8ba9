"""Torch-side helpers shared by the peers (imported only when a peer runs: torch is not on the CI machine):
CUDA-event timing (median of `iters` after `warmup` calls) and moekit's inputs (uniform, never zeros).
Used by peer_torch.py and peer_sonic.py; the non-torch parts are tested in test_anchor_math.py."""
import statistics

import torch


def time_ms(fn, warmup, iters):
    """Median milliseconds of fn() over `iters` calls after `warmup` untimed ones (events on the current stream)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def uniform(shape, scale, gen, dtype=torch.bfloat16):
    """U(-scale, scale) on the GPU (moekit bench's fills: activations 1, weights 0.02*sqrt(3) = std 0.02)."""
    return ((torch.rand(shape, generator=gen, device="cuda") * 2 - 1) * scale).to(dtype)


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
