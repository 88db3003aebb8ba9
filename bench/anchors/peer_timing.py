"""Torch-side helpers shared by the peers (imported only when a peer runs: torch is not on the CI machine):
CUDA-event timing (median of `iters` after `warmup` calls) and moekit's inputs (uniform, never zeros).
Used by peer_torch.py and peer_sonic.py; the non-torch parts are tested in test_anchor_math.py."""
import statistics

import torch


def time_ms(fn, warmup, iters, min_warm_s=2.0):
    """Median milliseconds of fn() over `iters` calls after `warmup` untimed ones (events on the current stream),
    and at least `min_warm_s` seconds of them: the H100's 700 W cap pulls the SM clock from 1980 to 1.1-1.5 GHz
    about a second into a heavy load, and moekit bench times in that steady state (docs/perf.md)."""
    import time
    start, done = time.monotonic(), 0
    while done < warmup or time.monotonic() - start < min_warm_s:
        fn()
        torch.cuda.synchronize()
        done += 1
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
    """U(-scale, scale) on the GPU (moekit bench's fills: activations 1, weights 0.02*sqrt(3) = std 0.02), made in
    place in `dtype`: dsv3-e256's fc1 is 15 GB in bf16, an fp32 temporary would double that."""
    t = torch.rand(shape, generator=gen, device="cuda", dtype=dtype)
    return t.mul_(2 * scale).sub_(scale)


def reason(e):
    """One line naming an exception and where it was raised (what a peer refuses, e.g. a bare assert)."""
    import traceback
    tb = traceback.extract_tb(e.__traceback__)
    where = " at %s:%d" % (tb[-1].filename.split("site-packages/")[-1].split("/tmp/")[-1], tb[-1].lineno) if tb else ""
    msg = (str(e).splitlines() or [""])[0][:160]
    return "%s: %s%s" % (type(e).__name__, msg, where)


def free():
    """Returns cached blocks between configs; after a device fault this fails too, which is not news."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:
        pass
