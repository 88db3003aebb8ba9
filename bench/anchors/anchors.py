#!/usr/bin/env python3
"""Side-by-side benchmark driver (issue 10, point 4): moekit bench's JSON files next to torch._grouped_mm and
SonicMoE timed in the same device call (scripts/device_anchors.sh runs it).
  anchors.py plan   [--configs ...]                          the plan and FLOPs (no torch)
  anchors.py torch  --moekit-dir D --out F [--dry-run]       torch._grouped_mm expert MLP per config
  anchors.py sonic  --moekit-dir D --out F [--dry-run]       SonicMoE layer + expert path per config
  anchors.py report --moekit-dir D --peer NAME=F[:RC] ... --json F --table F
Configs: PRESET or PRESET@zipfS. moekit files: D/<config>_layer.json, D/<config>_mlp.json (config with '@'
replaced by '_'). Peers write their JSON after every config, so a crash or timeout keeps what was done, and
--resume-after RC goes on in a new process after a crash."""
import argparse
import json
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import anchor_math as am  # noqa: E402

DEFAULT_CONFIGS = ["mixtral", "dsv3-ep8", "dsv3-e256", "qwen3-30b", "dsv3-ep8@zipf1.2", "mixtral@zipf1.2"]


class UsageError(Exception):
    pass


def start_stack_watchdog(period_s, out):
    """Every period_s seconds, print the main thread's stack to out (a daemon thread; period_s <= 0: none).
    Not faulthandler.dump_traceback_later: its watchdog walks the other threads' frames without the GIL and can
    crash the process it watches (CPython issues 116008, 140815): SonicMoE's process died (exit 139) on 2026-12-07
    with that dump cut mid-line at its 120 s mark, while Triton compiled a kernel, and on 2026-11-28 after one. This
    one takes the GIL, so it reads frames no thread is changing; a main thread in native code holding the GIL delays
    the dump and never corrupts it."""
    if period_s <= 0:
        return None
    main_id = threading.main_thread().ident
    t0 = time.time()

    def watch():
        while True:
            time.sleep(period_s)
            frame = sys._current_frames().get(main_id)
            if frame is None:
                return
            stack = "".join(traceback.format_stack(frame))
            out.write("anchors: the main thread at %.0f s:\n%s" % (time.time() - t0, stack))
            out.flush()

    t = threading.Thread(target=watch, name="stack-watchdog", daemon=True)
    t.start()
    return t


def moekit_file(d, config, scope):
    return os.path.join(d, "%s_%s.json" % (config.replace("@", "_"), scope))


def load_moekit(d, config):
    out = {}
    for scope in ("layer", "mlp"):
        path = moekit_file(d, config, scope) if d else None
        out[scope] = None
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    out[scope] = json.load(f)
            except (OSError, ValueError) as e:
                print("anchors: %s: unreadable (%s); treated as missing" % (path, e), file=sys.stderr)
    return out


def counts_for(config, moekit, seed):
    """moekit's per-expert counts for this config: the --scope mlp JSON (moekit's routing_counts rule, used by
    its expert-MLP timing), else the layer JSON (its router's counts), else the same rule generated here."""
    preset, zipf_s = am.parse_config(config)
    p = am.PRESETS[preset]
    for scope in ("mlp", "layer"):
        j = moekit.get(scope)
        if j and isinstance(j.get("counts"), list) and len(j["counts"]) == p["E"] and sum(j["counts"]) == p["T"] * p["k"]:
            return j["counts"], "moekit %s JSON" % scope
    return am.routing_counts(preset, zipf_s, seed), "generated here (moekit's rule, Python's random numbers)"


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plan(args):
    lines = []
    for c in args.configs:
        preset, s = am.parse_config(c)
        p = am.PRESETS[preset]
        lines.append("%-20s H %5d F %5d E %3d k %d T %5d zipf %-4g  fwd %7.2f TFLOP  fwd+bwd %7.2f TFLOP  moekit: %s"
                     % (c, p["H"], p["F"], p["E"], p["k"], p["T"], s, am.fwd_flops(p["T"], p["k"], p["H"], p["F"]) / 1e12,
                        am.fwd_bwd_flops(p["T"], p["k"], p["H"], p["F"]) / 1e12,
                        moekit_file(args.moekit_dir or "<moekit-dir>", c, "{layer,mlp}")))
    print("\n".join(lines))
    return 0


def resumed_configs(prior, rc):
    """The configs of an earlier run of this peer whose process died (exit rc): what it finished is kept, and the
    config it was timing gets the death as its error, so a run with --resume-after goes on from the next one."""
    configs = {c: dict(e) for c, e in (prior.get("configs") or {}).items()}
    if prior.get("in_progress"):
        label, config = prior["in_progress"]
        entry = configs.setdefault(config, {})
        if not isinstance(entry.get(label), dict):
            entry[label] = {"error": "the peer's process died while timing it (exit %s); the configs after it ran "
                                     "in a new process" % rc}
    return configs


def run_peer(args, name):
    """Times one peer on every config; each config's failure is recorded and the next config still runs. With
    --resume-after RC, the configs an earlier run (--out) finished are kept and not timed again."""
    if args.dry_run:
        print("anchors %s --dry-run: would time %s on %d configs, %d warm-up + %d timed iterations each"
              % (name, name, len(args.configs), args.warmup, args.iters))
        return plan(args)
    start = time.time()
    result = dict(peer=name, configs={}, in_progress=None, finished=False)
    if args.resume_after is not None and os.path.exists(args.out):
        with open(args.out) as f:
            prior = json.load(f)
        result["configs"] = resumed_configs(prior, args.resume_after)
        result["resumed_after"] = (prior.get("resumed_after") or []) + [args.resume_after]
    if args.skip_reason:  # the device script found a reason not to try (python version, wheels not carried)
        result.update(finished=True, configs={c: {"error": args.skip_reason} for c in args.configs})
        write_json(args.out, result)
        print("anchors %s: %s" % (name, args.skip_reason))
        return 0
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
        result["torch"] = torch.__version__
        result["device"] = torch.cuda.get_device_name()
        if name == "sonic":
            import peer_sonic
            peer_sonic.import_sonic()
            import sonicmoe
            result["sonic"] = getattr(sonicmoe, "__version__", "?")
    except Exception as e:  # import or set-up failure: every config gets the reason
        reason = "import: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        for c in args.configs:
            result["configs"][c] = {"error": reason}
        result["finished"] = True
        write_json(args.out, result)
        print("anchors %s: %s" % (name, reason))
        return 0
    import peer_timing
    # A config that neither finishes nor fails (compiling, autotuning, a hang) leaves its stack in the log.
    start_stack_watchdog(args.stack_dump_s, sys.stderr)
    if name == "torch":
        import peer_torch
        passes = [("torch._grouped_mm", lambda p, s, counts: peer_torch.run(p, counts, args.iters, args.warmup,
                                                                            args.seed))]
    else:  # the whole layer first on every config (the acceptance comparison), then the expert path
        import peer_sonic
        passes = [("sonic layer", lambda p, s, counts: peer_sonic.run_layer(p, s, args.iters, args.warmup, args.seed)),
                  ("sonic experts", lambda p, s, counts: peer_sonic.run_expert_path(p, counts, args.iters, args.warmup,
                                                                                    args.seed))]
        passes = [(label, fn) for label, fn in passes if label.split()[-1] in args.sonic_passes]
    result["labels"] = [label for label, _ in passes]
    for label, fn in passes:
        for c in args.configs:
            entry = result["configs"].setdefault(c, {})
            if isinstance(entry.get(label), dict):  # done (or died) in the run this one resumes
                continue
            if time.time() - start > args.deadline_s:
                entry[label] = {"error": "skipped: the %d s time limit was reached" % args.deadline_s}
                continue
            result["in_progress"] = [label, c]
            write_json(args.out, result)
            preset, zipf_s = am.parse_config(c)
            counts, entry["counts_source"] = counts_for(c, load_moekit(args.moekit_dir, c), args.seed)
            try:
                entry[label] = fn(am.PRESETS[preset], zipf_s, counts)
            except Exception as e:
                traceback.print_exc()
                entry[label] = {"error": peer_timing.reason(e)}
            peer_timing.free()  # outside the except: its traceback holds the failed call's tensors
            print("anchors %s %s %s (%.0f s): %s" % (name, label, c, time.time() - start, json.dumps(entry[label])[:300]),
                  flush=True)
            write_json(args.out, result)
    result["in_progress"] = None
    result["finished"] = True
    write_json(args.out, result)
    return 0


def peer_results(spec, configs):
    """--peer NAME=FILE[:RC] -> {config: {row name: result}}; configs the peer never reached get a reason."""
    name, _, rest = spec.partition("=")
    path, _, rc = rest.partition(":")
    if not name or not path:
        raise UsageError("--peer=%s must be NAME=FILE or NAME=FILE:RC" % spec)
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    rc_note = "" if not rc or rc == "0" else " (too little time left to start it)" if rc == "skipped" else \
        " (exit %s%s)" % (rc, ", timed out" if rc in ("124", "137") else "")
    labels = data.get("labels") or sorted({k for e in data.get("configs", {}).values() for k, v in e.items()
                                           if isinstance(v, dict)}) or [name]
    out = {}
    for c in configs:
        entry = data.get("configs", {}).get(c) or {}
        rows = {}
        if "error" in entry and not any(isinstance(v, dict) for v in entry.values()):
            rows[name] = {"error": entry["error"]}
        else:
            for label in labels:
                v = entry.get(label)
                if isinstance(v, dict):
                    rows[label] = dict(v)
                elif not data:
                    rows[label] = {"error": "no result file%s" % rc_note}
                elif data.get("in_progress") == [label, c]:
                    rows[label] = {"error": "died or was stopped during this config%s" % rc_note}
                else:
                    rows[label] = {"error": "not reached%s" % rc_note}
        for label, v in rows.items():
            v.setdefault("scope", "layer" if label.startswith("sonic") else "mlp")
            if entry.get("counts_source"):
                v.setdefault("counts_source", entry["counts_source"])
        out[c] = rows
    return out, data


def report(args):
    rows, peers_meta = [], {}
    per_config = {c: {} for c in args.configs}
    for spec in args.peer:
        res, data = peer_results(spec, args.configs)
        peers_meta[spec.partition("=")[0]] = {k: v for k, v in data.items() if k != "configs"}
        for c in args.configs:
            per_config[c].update(res[c])
    moekit_all = {}
    for c in args.configs:
        moekit = load_moekit(args.moekit_dir, c)
        moekit_all[c] = moekit
        rows += am.build_rows(c, moekit, per_config[c], args.scopes)
    devices = [d.get("device") for d in peers_meta.values()] + \
        [j.get("device") for m in moekit_all.values() for j in m.values() if j]
    title = [
        "moekit vs peers, one device call (%s). TFLOP/s: 6*T*k*H*F fwd, 18*T*k*H*F fwd+bwd (SwiGLU experts);"
        % next((d for d in devices if d), "device unknown"),
        "mk/x = x's time / moekit's time on the same scope (layer vs layer, mlp vs mlp; > 1: moekit faster).",
        "moekit fwd = sum of eager stage medians; fwd+bwd = one CUDA graph. torch._grouped_mm: moekit's counts",
        "(moekit's mlp JSON). SonicMoE 'layer': its own router (top-k then softmax: same top-k set as moekit's",
        "softmax-then-top-k on equal logits), inputs skewed like moekit bench's; 'experts': no router, moekit's counts.",
    ]
    # Issue 10's acceptance from the same files: moekit's layer JSON, SonicMoE's layer rows, and the per-GEMM JSON
    # that scripts/device_anchors.sh writes beside moekit's (gemm_<preset>.json, bench_grouped_gemm --json).
    gemms = {}
    for preset in am.GEMM_ACCEPTANCE_PRESETS:
        path = os.path.join(args.moekit_dir, "gemm_%s.json" % preset) if args.moekit_dir else None
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
                gemms[preset] = next((r for r in (data if isinstance(data, list) else [data])
                                      if isinstance(r, dict) and r.get("preset") == preset and "gemms" in r), None)
            except (OSError, ValueError) as e:
                print("anchors: %s: unreadable (%s); treated as missing" % (path, e), file=sys.stderr)
    checks = am.acceptance(args.configs, {c: moekit_all[c].get("layer") for c in args.configs},
                           {c: per_config[c].get("sonic layer") for c in args.configs}, gemms)
    table = am.format_table(rows, title) + "\n" + am.format_acceptance(checks)
    sys.stdout.write(table)
    if args.table:
        with open(args.table, "w") as f:
            f.write(table)
    if args.json:
        write_json(args.json, dict(configs=args.configs, rows=rows, acceptance=checks, peers=peers_meta,
                                   peer_results=per_config,
                                   moekit={c: {s: (j is not None) for s, j in m.items()} for c, m in moekit_all.items()}))
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["plan", "torch", "sonic", "report"])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="PRESET or PRESET@zipfS")
    ap.add_argument("--moekit-dir", help="folder of moekit bench --json files (<config>_{layer,mlp}.json)")
    ap.add_argument("--out", help="peer result JSON (torch, sonic)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deadline-s", type=int, default=240, help="peers: start no config after this many seconds")
    ap.add_argument("--sonic-passes", nargs="+", choices=["layer", "experts"], default=["layer", "experts"],
                    help="sonic: its whole layer, its expert path on moekit's counts, or both")
    ap.add_argument("--stack-dump-s", type=int, default=120,
                    help="peers: print the main thread's stack to stderr this often (0: never)")
    ap.add_argument("--dry-run", action="store_true", help="peers: print the plan, import nothing")
    ap.add_argument("--skip-reason", help="peers: record this reason for every config and time nothing")
    ap.add_argument("--resume-after", help="peers: an earlier run into --out died with this exit code: keep what "
                    "it finished, mark the config it was timing failed, time the rest")
    ap.add_argument("--peer", action="append", default=[], help="report: NAME=FILE[:RC] (repeatable)")
    ap.add_argument("--json", help="report: write all rows as JSON here")
    ap.add_argument("--table", help="report: write the table here")
    ap.add_argument("--scopes", nargs="+", choices=["layer", "mlp"], default=["layer", "mlp"],
                    help="report: the scopes moekit bench was asked for (its rows of the others are left out)")
    args = ap.parse_args(argv)
    try:
        for c in args.configs:
            am.parse_config(c)
        if not 1 <= args.iters <= 100000 or not 0 <= args.warmup <= 1000:
            raise UsageError("--iters=%d must be in [1, 100000] and --warmup=%d in [0, 1000]" % (args.iters, args.warmup))
        if args.command in ("torch", "sonic") and not args.dry_run and not args.out:
            raise UsageError("anchors %s needs --out FILE (or --dry-run)" % args.command)
        if args.moekit_dir and not os.path.isdir(args.moekit_dir):
            raise UsageError("--moekit-dir=%s is not a folder" % args.moekit_dir)
    except (ValueError, UsageError) as e:
        print("anchors: %s" % e, file=sys.stderr)
        return 2
    if args.command == "plan":
        return plan(args)
    if args.command == "report":
        try:
            return report(args)
        except UsageError as e:
            print("anchors: %s" % e, file=sys.stderr)
            return 2
    return run_peer(args, args.command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
