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


# Issue 10's acceptance as one side-by-side call measures it: the whole layer's limit over its roofline per preset
# (a zipf config takes its preset's), the per-GEMM floors (dense cuBLAS time / the per-shape choice's, the median of
# the per-round ratios of bench_grouped_gemm --acceptance-only) on the presets named, SonicMoE's layer at least
# moekit's speed wherever it ran.
ROOFLINE_LIMITS = {"mixtral": 1.18, "dsv3-ep8": 1.18, "qwen3-30b": 1.35, "dsv3-e256": 1.35}
GEMM_ACCEPTANCE_PRESETS = ("mixtral", "dsv3-ep8")
GEMM_FLOORS = (("fwd", 0.95), ("dgrad", 0.90), ("wgrad", 0.90))
GEMM_NAMES = ("fc1_fwd", "fc2_fwd", "fc2_dgrad", "fc2_wgrad", "fc1_dgrad", "fc1_wgrad")


def gemm_floor(name):
    """The acceptance floor of a GEMM named like 'fc1_wgrad': 0.95 for a forward, 0.90 for a dgrad or wgrad."""
    for kind, floor in GEMM_FLOORS:
        if name.endswith("_" + kind):
            return floor
    raise ValueError("GEMM %r: not a fwd, dgrad or wgrad" % name)


def gemm_ratio(g):
    """dense / the per-shape choice of one bench_grouped_gemm row: the median of its per-round ratios, else the
    ratio of its medians; None where either was not timed."""
    if g.get("dense_over_auto_median") is not None:
        return g["dense_over_auto_median"]
    a, d = g.get("auto_ms"), g.get("dense_ms")
    return d / a if a and d and a > 0 and d > 0 else None


def acceptance(configs, layers, sonic, gemms):
    """The checks of one call. layers: {config: moekit bench layer JSON or None}; sonic: {config: SonicMoE's layer
    result ({'fwd_bwd_ms'} or {'error'}) or None}; gemms: {preset: bench_grouped_gemm JSON (one preset's object) or
    None}. Each check: dict(point, what, value, limit, met) with met True / False, or None where it was not measured
    (value None, `note` says why)."""
    checks = []

    def add(point, what, value, limit, met, note=""):
        checks.append(dict(point=point, what=what, value=value, limit=limit, met=met, note=note))

    for c in configs:
        preset, _ = parse_config(c)
        j = layers.get(c)
        g = (j or {}).get("grouped", {}).get("fwd_bwd_ms")
        s = (j or {}).get("sync", {}).get("fwd_bwd_ms")
        roof = ((j or {}).get("roofline") or {}).get("roofline_ms")
        ratio = speedup(s, g)
        add("sync-free faster than sync", c, ratio, "> 1", None if ratio is None else ratio > 1.0,
            "" if ratio is not None else "no moekit layer result")
        over = g / roof if g and roof else None
        limit = ROOFLINE_LIMITS[preset]
        add("layer over roofline", c, over, "<= %.2f" % limit, None if over is None else over <= limit,
            "" if over is not None else "no moekit layer result")
        res = sonic.get(c) or {}
        mk = speedup(res.get("fwd_bwd_ms"), g)
        why = "" if mk is not None else "no moekit layer result" if not g else \
            "SonicMoE: %s" % (res.get("error") or "no result")
        add("SonicMoE / moekit", c, mk, ">= 1", None if mk is None else mk >= 1.0, why)
    for preset in GEMM_ACCEPTANCE_PRESETS:
        rows = {r.get("name"): r for r in ((gemms.get(preset) or {}).get("gemms") or [])}
        for name in GEMM_NAMES:
            r = rows.get(name)
            v = gemm_ratio(r) if r else None
            floor = gemm_floor(name)
            add("per GEMM dense / choice", "%s %s" % (preset, name), v, ">= %.2f" % floor,
                None if v is None else v >= floor, "" if v is not None else "not timed in this call")
    return checks


def format_acceptance(checks):
    """The checks as text: one line each, then the verdict (every point met, or how many were not / not measured)."""
    out = ["issue 10 acceptance, this call:"]
    for k in checks:
        state = "met" if k["met"] else "NOT MET" if k["met"] is False else "not measured"
        out.append("  %-26s %-22s %8s  %-7s %s%s" % (k["point"], k["what"], fmt(k["value"], ".3f"), k["limit"], state,
                                                    "  (%s)" % k["note"] if k["note"] else ""))
    missed = sum(1 for k in checks if k["met"] is False)
    unmeasured = sum(1 for k in checks if k["met"] is None)
    if not missed and not unmeasured:
        out.append("  every point met in this call (%d checks)" % len(checks))
    else:
        # SonicMoE is compared only where it ran (the rule); any other unmeasured check leaves the verdict open.
        out.append("  %d of %d checks met; %d not met, %d not measured" %
                   (len(checks) - missed - unmeasured, len(checks), missed, unmeasured))
    return "\n".join(out) + "\n"
