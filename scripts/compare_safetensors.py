#!/usr/bin/env python3
"""Relative error per F32 tensor of two `moekit layer` result files; prints the three worst.

usage: compare_safetensors.py REFERENCE.safetensors OTHER.safetensors LABEL
Used by the device scripts (scripts/device_ep.sh, scripts/device_ep_multi.sh) to compare cuda with cpu runs.
"""
import json
import math
import struct
import sys


def load(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for key, t in header.items():
        if key == "__metadata__" or t["dtype"] != "F32":
            continue
        s, e = t["data_offsets"]
        out[key] = struct.unpack("<%df" % ((e - s) // 4), data[8 + n + s:8 + n + e])
    return out


def main():
    ref, other, label = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
    errs = []
    for key, a in ref.items():
        den = math.sqrt(sum(x * x for x in a))
        if den > 0:
            errs.append((math.sqrt(sum((x - y) ** 2 for x, y in zip(a, other[key]))) / den, key))
    errs.sort(reverse=True)
    print("%s: over %d tensors, worst: %s" % (label, len(errs), ", ".join("%s %.2e" % (k, e) for e, k in errs[:3])))


if __name__ == "__main__":
    main()
