#!/usr/bin/env python3
"""The convolutions' time per op and per layer as the GPU model predicted it beside what a GPU
took, from two of `syncstep bench`'s JSON files at one shape:

    python3 scripts/predicted_vs_measured.py SHAPES.json PROFILE.json [--model H200]

SHAPES.json is `bench --shapes-only --plan-for gpu --json`'s, PROFILE.json `bench --profile
--json`'s (run on the GPU). Both list every dispatch in recording order; the profile's carry
their measured seconds, the shapes' their predicted ones. Rows: the convolution launchers, then
each layer's convolution dispatches, slowest measured first; the model's launch gaps are not in
its figures (the measured step's time outside kernels is printed apart)."""

import argparse
import json
import sys
from collections import defaultdict


def dispatches(path, key):
    with open(path) as f:
        report = json.load(f)
    profile = report.get("profile")
    if not profile:
        sys.exit(f"{path} holds no profile: run bench with --profile or --shapes-only")
    return profile, profile[key] if key == "in_order" else profile["predicted"][key]["dispatches"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes")
    parser.add_argument("profile")
    parser.add_argument("--model", default="H200", help="H100 or H200 (default H200)")
    args = parser.parse_args()
    _, predicted = dispatches(args.shapes, args.model)
    profile, measured = dispatches(args.profile, "in_order")
    if len(predicted) != len(measured):
        sys.exit(f"the two steps differ: {len(predicted)} dispatches recorded, {len(measured)} profiled")
    by_op, by_layer = defaultdict(lambda: [0.0, 0.0, 0]), defaultdict(lambda: [0.0, 0.0, 0])
    for p, m in zip(predicted, measured):
        if (p["layer"], p["entry"]) != (m["layer"], m["entry"]):
            sys.exit(f"the two steps differ at {p['layer']} {p['entry']} / {m['layer']} {m['entry']}")
        if not p["kernel"].startswith("conv2d"):
            continue
        for table, key in ((by_op, p["kernel"]), (by_layer, (p["layer"], p["kernel"]))):
            row = table[key]
            row[0] += p["predicted_s"]
            row[1] += m["seconds"]
            row[2] += 1
    print(f"{'convolutions':<52} {'dispatches':>10} {'predicted ms':>13} {'measured ms':>12} {'measured/predicted':>19}")
    for title, table in (("by launcher", by_op), ("by layer", by_layer)):
        print(title)
        for key, (pred, meas, n) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            name = key if isinstance(key, str) else f"{key[0]} · {key[1][7:]}"
            print(f"  {name:<50} {n:>10} {pred * 1e3:>13.3f} {meas * 1e3:>12.3f} {meas / max(pred, 1e-12):>19.2f}")
    total_pred = sum(r[0] for r in by_op.values())
    total_meas = sum(r[1] for r in by_op.values())
    print(f"all convolutions: predicted {total_pred * 1e3:.3f} ms, measured {total_meas * 1e3:.3f} ms "
          f"({total_meas / max(total_pred, 1e-12):.2f}×); the profiled step: {profile['step_s'] * 1e3:.1f} ms, "
          f"{profile['kernel_s'] * 1e3:.1f} ms in kernels")


if __name__ == "__main__":
    main()
