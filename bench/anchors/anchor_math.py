"""Pure-Python parts of the side-by-side benchmark (no torch): presets, FLOP counts, counts -> offsets, the
per-expert routing rule used when moekit's JSON has no counts, and the table/JSON of one run.
Shapes: preset (H, F, E, k, T), SwiGLU experts (fc1 [H -> 2F], fc2 [F -> H]). Used by anchors.py;
test: bench/anchors/test_anchor_math.py (ctest anchors_math, label cpu)."""
import math
import random

# Twin of presets() in bench/lib/bench_expert_mlp.cu (the test parses that file and compares).
PRESETS = {
    "mixtral": dict(H=4096, F=14336, E=8, k=2, T=8192),
    "dsv3-ep8": dict(H=7168, F=2048, E=32, k=8, T=4096),
    "dsv3-e256": dict(H=7168, F=2048, E=256, k=8, T=4096),
    "qwen3-30b": dict(H=2048, F=768, E=128, k=8, T=16384),
}


def config_name(preset, zipf_s):
    """'mixtral' or 'mixtral@zipf1.2': one row of the table, one pair of moekit JSON files."""
    return preset if not zipf_s else "%s@zipf%g" % (preset, zipf_s)


def parse_config(name):
    """Inverse of config_name; ValueError naming the rule on a bad name."""
    preset, _, skew = name.partition("@")
    if preset not in PRESETS:
        raise ValueError("config %r: preset %r is not one of %s" % (name, preset, "|".join(PRESETS)))
    if not skew:
        return preset, 0.0
    if not skew.startswith("zipf"):
        raise ValueError("config %r: the part after '@' must be zipfS with S > 0 (e.g. mixtral@zipf1.2)" % name)
    try:
        s = float(skew[4:])
    except ValueError:
        s = -1.0
    if not (s > 0 and math.isfinite(s)):
        raise ValueError("config %r: zipf exponent must be a finite number > 0" % name)
    return preset, s


def fwd_flops(T, k, H, F):
    """Gated (SwiGLU) expert MLP forward: fc1 2*T*k*H*2F + fc2 2*T*k*F*H = 6*T*k*H*F."""
    return 6.0 * T * k * H * F


def fwd_bwd_flops(T, k, H, F):
    """Forward + backward (dgrad and wgrad of both GEMMs): 18*T*k*H*F."""
    return 18.0 * T * k * H * F


def tflops(flop, ms):
    """TFLOP/s of `flop` floating-point operations done in `ms` milliseconds (None if not timed)."""
    if ms is None or not ms > 0:
        return None
    return flop / (ms * 1e-3) / 1e12


def speedup(peer_ms, moekit_ms):
    """moekit / peer in throughput = peer time / moekit time (> 1: moekit faster); None if either is missing."""
    if peer_ms is None or moekit_ms is None or not peer_ms > 0 or not moekit_ms > 0:
        return None
    return peer_ms / moekit_ms


def offsets_from_counts(counts):
    """Cumulative row ends per expert (torch._grouped_mm's `offs`): [c0, c0+c1, ..., T*k]."""
    out, acc = [], 0
    for c in counts:
        if c < 0:
            raise ValueError("negative expert count %d" % c)
        acc += c
        out.append(acc)
    return out


def routing_counts(preset, zipf_s, seed):
    """Per-expert row counts with moekit's rule (bench/lib/bench_expert_mlp.cu routing_counts): each token takes
    the k largest of Gumbel noise - zipf_s * log(e+1). Same rule, Python's own random numbers (not moekit's bits)."""
    p = PRESETS[preset]
    E, k, T = p["E"], p["k"], p["T"]
    rng = random.Random(seed)
    bias = [-zipf_s * math.log(e + 1) for e in range(E)]
    counts = [0] * E
    for _ in range(T):
        logits = [(-math.log(-math.log(max(rng.random(), 1e-300))) + bias[e], e) for e in range(E)]
        logits.sort(reverse=True)
        for _, e in logits[:k]:
            counts[e] += 1
    return counts


def token_expert_pairs(counts, T):
    """A routing with exactly these per-expert counts where each token has k distinct experts: rows listed expert
    by expert, row i goes to token i mod T (a block of <= T consecutive rows never hits a token twice). Returns
    (token, expert) pairs sorted by token. Needs sum(counts) = T*k and every count <= T."""
    total = sum(counts)
    if total % T or max(counts) > T:
        raise ValueError("counts (sum %d, max %d) do not fit %d tokens" % (total, max(counts), T))
    pairs, i = [], 0
    for e, c in enumerate(counts):
        for _ in range(c):
            pairs.append((i % T, e))
            i += 1
    pairs.sort()
    return pairs


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def build_rows(config, moekit, peers, scopes=("layer", "mlp")):
    """Rows of the table for one config. moekit: {'layer': json|None, 'mlp': json|None}; peers: {name: result},
    a result = {'fwd_ms', 'fwd_bwd_ms', 'scope', 'error'?, 'note'?}. Each row: name, scope, fwd/fwd+bwd ms, TFLOP/s,
    and moekit's speed over it on the same scope (layer vs layer, expert MLP vs expert MLP). moekit's rows of a
    scope not in `scopes` (not asked of moekit bench) are left out."""
    preset, zipf_s = parse_config(config)
    p = dict(PRESETS[preset])
    f1, f3 = fwd_flops(p["T"], p["k"], p["H"], p["F"]), fwd_bwd_flops(p["T"], p["k"], p["H"], p["F"])
    rows = []

    def row(name, scope, fwd_ms, fb_ms, vs=None, note=""):
        r = dict(config=config, name=name, scope=scope, fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms,
                 fwd_tflops=tflops(f1, fwd_ms), fwd_bwd_tflops=tflops(f3, fb_ms), note=note,
                 moekit_over_fwd=None, moekit_over_fwd_bwd=None)
        if vs:
            r["moekit_over_fwd"] = speedup(fwd_ms, vs.get("fwd_ms"))
            r["moekit_over_fwd_bwd"] = speedup(fb_ms, vs.get("fwd_bwd_ms"))
        rows.append(r)

    ref = {}
    for scope in ("layer", "mlp"):
        if scope not in scopes:
            continue
        j = moekit.get(scope)
        if not j:
            row("moekit " + scope, scope, None, None, note="moekit: no result (see the bench log)")
            continue
        g, s = j["grouped"], j["sync"]
        ref[scope] = dict(fwd_ms=g.get("fwd_ms"), fwd_bwd_ms=g.get("fwd_bwd_ms"))
        row("moekit " + scope, scope, g.get("fwd_ms"), g.get("fwd_bwd_ms"),
            note="sync-free, one graph; fwd = stage sums")
        row("sync cuBLAS/expert", scope, s.get("fwd_ms"), s.get("fwd_bwd_ms"), vs=ref[scope],
            note="%.1f host syncs/step" % s.get("host_syncs_per_step", float("nan")))
        fl = j.get("floor", {})
        row("dense floor", scope, fl.get("fwd_ms"), fl.get("fwd_bwd_ms"), vs=ref[scope], note="3 x dense fwd")
        rl = j.get("roofline")
        if rl:
            row("roofline", scope, None, rl.get("roofline_ms"), vs=ref[scope],
                note="%s-bound (memory floor %.3f ms)" % (rl.get("bound"), rl.get("memory_floor_ms", float("nan"))))
    for name, res in peers.items():
        scope = res.get("scope", "mlp")
        if res.get("error"):
            row(name, scope, None, None, note="%s: failed: %s" % (name.split()[0], res["error"]))
            continue
        row(name, scope, res.get("fwd_ms"), res.get("fwd_bwd_ms"), vs=ref.get(scope), note=res.get("note", ""))
        if res.get("fwd_bwd_main_grad_ms") is not None:  # peer_sonic.run_layer's second figure
            row(name + " +main grad", scope, res.get("fwd_ms"), res["fwd_bwd_main_grad_ms"], vs=ref.get(scope),
                note="its bf16 weight grads then added into fp32 main grads (Megatron's bf16 default)")
    return rows


HEADER = "%-22s %-26s %6s %9s %9s %7s %7s %8s %8s  %s" % (
    "config", "system", "scope", "fwd ms", "f+b ms", "fwd TF", "f+b TF", "mk/fwd", "mk/f+b", "note")


def format_table(rows, title_lines=()):
    """One text table: TFLOP/s from 6*T*k*H*F (fwd) and 18*T*k*H*F (fwd+bwd); mk/x = moekit's speed over x
    (x's time / moekit's time on the same scope; > 1: moekit faster)."""
    out = list(title_lines) + [HEADER]
    for r in rows:
        out.append("%-22s %-26s %6s %9s %9s %7s %7s %8s %8s  %s" % (
            r["config"], r["name"][:26], r["scope"], fmt(r["fwd_ms"], ".3f"), fmt(r["fwd_bwd_ms"], ".3f"),
            fmt(r["fwd_tflops"], ".0f"), fmt(r["fwd_bwd_tflops"], ".0f"), fmt(r["moekit_over_fwd"], ".2f"),
            fmt(r["moekit_over_fwd_bwd"], ".2f"), r["note"]))
    return "\n".join(out) + "\n"
