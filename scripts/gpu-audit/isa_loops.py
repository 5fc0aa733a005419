#!/usr/bin/env python3
"""Whether each GEMM's slice loop keeps the next slices' loads in flight, from RADV's ISA.

Usage: isa_loops.py RUN_DIR [MARKDOWN]   (RUN_DIR from radv-stats.sh with RADV_DEBUG=asm)

For every implicit-GEMM pipeline (asm/<module>__<entry>.s) it finds the slice loop, the
blocks between a label and the last branch back to it that hold the most `v_fmac_f32`, and
counts the `s_waitcnt vmcnt(N)` in it before its last multiply-add: each waits on memory
loads while the tile's sums could go on. 0 is what the kernels are built for (each slice's
loads are stored after the multiply-adds of the slice before); `least N` is the fewest loads
such a wait leaves in flight (vmcnt(0): every one has landed)."""
import os
import re
import sys

LABEL = re.compile(r"^(BB\d+):")
BRANCH = re.compile(r"s_c?branch\w*\s+(BB\d+)")
VMCNT = re.compile(r"s_waitcnt\s+vmcnt\((\d+)\)")


def loop_of(lines):
    """The (start, end) line range of the loop with the most multiply-adds."""
    labels = {}
    best = None
    for i, line in enumerate(lines):
        m = LABEL.match(line)
        if m:
            labels[m.group(1)] = i
        m = BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            start = labels[m.group(1)]
            fmas = sum("v_fmac_f32" in l or "v_fma_f32" in l for l in lines[start:i])
            if best is None or fmas > best[2]:
                best = (start, i, fmas)
    return best


def main():
    run = sys.argv[1]
    markdown = len(sys.argv) > 2
    asm = os.path.join(run, "asm")
    rows = []
    for name in sorted(os.listdir(asm)):
        module, _, entry = name[:-2].partition("__")
        if entry not in ("conv2d_implicit_gemm", "conv2d_implicit_weight"):
            continue
        lines = open(os.path.join(asm, name)).read().splitlines()
        loop = loop_of(lines)
        if loop is None:
            rows.append((module, entry, 0, 0, "no loop"))
            continue
        start, end, fmas = loop
        body = lines[start:end]
        last = max(i for i, l in enumerate(body) if "v_fmac_f32" in l or "v_fma_f32" in l)
        waits = [int(m.group(1)) for l in body[:last] for m in [VMCNT.search(l)] if m]
        least = str(min(waits)) if waits else "-"
        rows.append((module, entry, fmas, len(waits), least))
    head = ("module", "entry", "FMAs in the loop", "vmcnt waits before its last FMA", "least N")
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(map(str, r)) + " |")
    else:
        for r in [head] + rows:
            print("  ".join(map(str, r)))
    bad = [r for r in rows if r[3] and r[4] == "0"]
    print(f"# {len(rows)} pipelines; vmcnt(0) inside the slice loop before its last FMA: "
          f"{', '.join(r[0] for r in bad) if bad else 'none'}")


if __name__ == "__main__":
    main()
