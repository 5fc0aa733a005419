#!/usr/bin/env python3
"""Per-pipeline ACO statistics of one run-one.sh run (RUNDIR/bench.log, RUNDIR/shapes.json,
RUNDIR/spv/, RUNDIR/wgsl/): one row per implicit-GEMM pipeline the step created (every
pipeline with --all), sorted by the share of the step's convolution FLOPs each runs
(dispatches matched one to one against `bench --shapes-only`'s list, in order).
--pipeline SUBSTR keeps the pipelines whose "module::entry" contains SUBSTR, of any family.

usage: radv_table.py RUNDIR [--family navi31] [--all] [--markdown] [--pipeline SUBSTR]
"""
import json
import re
import sys
from collections import OrderedDict, defaultdict

# Mesa 25.0.7 radv_null_winsys.c / ac_gpu_info.c for the families used here.
FAMILIES = {
    # family: (wave64 VGPRs per SIMD, max waves per SIMD, LDS bytes per WGP, LDS alloc granule)
    "navi31": (768, 16, 128 * 1024, 1024),
    "navi32": (768, 16, 128 * 1024, 1024),
    "navi33": (512, 16, 128 * 1024, 1024),
    "navi21": (512, 16, 128 * 1024, 1024),
    "gfx1201": (512, 16, 128 * 1024, 1024),
}


def parse_log(path):
    pipelines = OrderedDict()  # k -> dict
    pending = None
    dispatches = []
    mesa = None
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if mesa is None:
            m = re.search(r"radv Mesa (\d+\.\d+\.\d+)", line)
            if m:
                mesa = m.group(1)
        m = re.search(r"compiling pipeline (\S+)::(\S+)$", line)
        if m:
            pending = (m.group(1), m.group(2))
            continue
        m = re.match(r"null-submit-pipeline-begin (\d+) entry=(\S+) module=(\S+)", line)
        if m:
            k, entry, spv = int(m.group(1)), m.group(2), m.group(3)
            if pending and pending[1] == entry:
                module = pending[0]
            else:
                module = "(wgpu internal)"
            pending = None
            pipelines[k] = {"k": k, "module": module, "entry": entry, "spv": spv, "stats": {}}
            continue
        if line.startswith("null-submit-stats "):
            parts = line.split("\t")
            k = int(parts[0].split()[1])
            st = {}
            for p in parts[1:]:
                if "=" in p:
                    key, val = p.split("=", 1)
                    st[key] = val
            pipelines[k]["stats"] = st
            continue
        m = re.match(r"null-submit-dispatch (-?\d+) (\d+) (\d+) (\d+)", line)
        if m:
            dispatches.append((int(m.group(1)), int(m.group(2)) * int(m.group(3)) * int(m.group(4))))
    return pipelines, dispatches, mesa


def workgroup_size_spv(path):
    """The SPIR-V's LocalSize (what the driver compiled)."""
    import subprocess
    try:
        dis = subprocess.run(["spirv-dis", path], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"OpExecutionMode %\S+ LocalSize (\d+) (\d+) (\d+)", dis)
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else None


def workgroup_size(rundir, module, entry):
    try:
        text = open(f"{rundir}/wgsl/{module}.wgsl").read()
    except OSError:
        return None
    m = re.search(r"@compute\s+@workgroup_size\(([^)]*)\)\s*fn\s+" + re.escape(entry) + r"\s*\(", text)
    if not m:
        return None
    size = 1
    for d in m.group(1).split(","):
        d = d.strip().rstrip("u")
        if d and not d.isdigit():
            return None
        if d:
            size *= int(d)
    return size


def tile_of(module):
    m = re.search(r"(\d+)t-(\d+)x(\d+)-(\d+)x(\d+)(?:-k(\d+))?", module)
    if not m:
        return None
    t, bm, bn, tm, tn = map(int, m.groups()[:5])
    return {"threads": t, "bm": bm, "bn": bn, "tm": tm, "tn": tn, "bk": m.group(6) or "-"}


def occupancy(family, wave, vgprs, lds, wg):
    """Mesa 25.0.7 radv_get_max_waves for GFX10.3+: waves (of `wave` lanes) per SIMD, and
    which of VGPRs / LDS / the hardware's 16 limits it."""
    phys64, maxw, lds_wgp, gran = FAMILIES.get(family, (512, 16, 128 * 1024, 1024))
    physical = phys64 * (64 // wave)
    v = -(-vgprs // (8 if wave == 32 else 4)) * (8 if wave == 32 else 4)
    real = phys64 // 64 * (2 if wave == 32 else 1)
    v = -(-v // real) * real
    by_vgpr = physical // v if v else 10**6
    by_lds = 10**6
    if lds:
        per_wave = (-(-lds // gran) * gran) // (-(-wg // wave))
        by_lds = -(-(lds_wgp // 4) // per_wave)
    waves = min(maxw, by_vgpr, by_lds)
    limit = [n for n, w in (("hw", maxw), ("VGPR", by_vgpr), ("LDS", by_lds)) if w == waves]
    return waves, by_vgpr, by_lds, "+".join(limit)


def main():
    args = sys.argv[1:]
    rundir = args[0]
    family = "navi31"
    if "--family" in args:
        family = args[args.index("--family") + 1]
    show_all = "--all" in args
    md = "--markdown" in args
    only = args[args.index("--pipeline") + 1] if "--pipeline" in args else None
    pipelines, dispatches, mesa = parse_log(f"{rundir}/bench.log")
    shapes = json.load(open(f"{rundir}/shapes.json"))
    order = shapes["profile"]["in_order"]
    cfg = shapes["config"]

    # The first step's dispatches, matched against the recorded list.
    flops = defaultdict(float)
    count = defaultdict(int)
    model_regs = {}
    predicted = shapes["profile"].get("predicted", {}).get("H200", {}).get("dispatches", [])
    conv_flops = sum(d["flops"] for d in order if d["kernel"].startswith("conv2d"))
    matched = 0
    mismatch = None
    for i, d in enumerate(order):
        if i >= len(dispatches):
            mismatch = f"only {len(dispatches)} dispatches logged"
            break
        k, groups = dispatches[i]
        p = pipelines.get(k)
        if p is None or p["entry"] != d["entry"] or groups != d["workgroups"]:
            mismatch = f"dispatch {i}: logged {p and p['entry']} x{groups}, recorded {d['entry']} x{d['workgroups']}"
            break
        flops[k] += d["flops"]
        count[k] += 1
        if i < len(predicted) and predicted[i].get("registers") is not None:
            model_regs[k] = predicted[i]["registers"]
        matched += 1

    print(f"# {rundir}: ResNet-34 {cfg['image_size']}x{cfg['image_size']} batch {cfg['batch']}, "
          f"plan {cfg['plan_for']}, RADV {family} (Mesa {mesa or '?'} ACO, null winsys)")
    print(f"# {len(pipelines)} pipelines; {matched}/{len(order)} dispatches of the step matched "
          f"to their pipelines{'' if mismatch is None else ' — MISMATCH: ' + mismatch}; "
          f"convolution FLOPs of the step: {conv_flops / 1e9:.1f} GFLOP")

    cols = ["module", "entry", "tile (BMxBN, TMxTN, BK)", "WG", "wave", "VGPR", "pre-sched VGPR",
            "model regs", "SGPR (pre-sched)", "spill V/S", "scratch B", "LDS B", "waves/SIMD", "lanes/SIMD", "limit",
            "code B", "instr", "disp", "% conv FLOP"]
    rows = []
    flags = []
    for k, p in pipelines.items():
        implicit = p["module"].startswith("conv2d_implicit")
        if only is not None:
            if only not in p["module"] + "::" + p["entry"]:
                continue
        elif not implicit and not show_all:
            continue
        st = p["stats"]
        wave = int(st.get("subgroup", 0))
        vg = int(st.get("VGPRs", 0))
        lds = int(st.get("LDS size", 0))
        wg = workgroup_size_spv(f"{rundir}/spv/{p['spv']}") or workgroup_size(rundir, p["module"], p["entry"]) or 0
        t = tile_of(p["module"])
        if t and p["entry"] in ("conv2d_implicit_gemm", "conv2d_implicit_weight"):
            tile = f"{t['bm']}x{t['bn']}, {t['tm']}x{t['tn']}, k{t['bk']}"
        else:
            tile = "-"
        waves, by_v, by_l, limit = occupancy(family, wave, vg, lds, wg) if wave else (0, 0, 0, "?")
        reported = int(st.get("Subgroups per SIMD", 0))
        # RADV reports waves x (wave/32) on GFX10+ (radv_get_max_waves).
        check = "" if reported == waves * (wave // 32) else f" (!= RADV {reported})"
        pre = int(st.get("Pre-Sched VGPRs", 0) or 0)
        by_pre = occupancy(family, wave, pre, 0, wg)[1] if wave and pre else 10**6
        flags.append((p["module"] + "::" + p["entry"], wave, waves, by_v, by_l, by_pre))
        rows.append([
            p["module"], p["entry"], tile, str(wg), f"w{wave}", str(vg), st.get("Pre-Sched VGPRs", "?"),
            str(model_regs.get(k, "-")),
            f"{st.get('SGPRs', '?')} ({st.get('Pre-Sched SGPRs', '?')})", f"{st.get('Spilled VGPRs', '?')}/{st.get('Spilled SGPRs', '?')}",
            st.get("Scratch size", "?"), str(lds), f"{waves}{check}", str(waves * wave), limit, st.get("Code size", "?"),
            st.get("Instructions", "?"), str(count.get(k, 0)),
            f"{100 * flops.get(k, 0) / conv_flops:.1f}" if conv_flops else "-",
        ])
    rows.sort(key=lambda r: -float(r[-1]) if r[-1] != "-" else 0)
    if md:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    flagged = [r for r in rows if r[9] not in ("0/0",) or r[10] not in ("0",)]
    print(f"# spills or scratch: {'none' if not flagged else ', '.join(r[0] + '::' + r[1] + ' (spill V/S ' + r[9] + ', scratch ' + r[10] + ' B/wave)' for r in flagged)}")
    by_vgpr = [f"{n} ({bv} w{w}; by pre-sched demand {bp})" for n, w, wv, bv, bl, bp in flags if bv < 4]
    print(f"# allocated VGPRs allow < 4 waves/SIMD: {'none' if not by_vgpr else ', '.join(by_vgpr)}")
    by_pre = [f"{n} ({bp} w{w})" for n, w, wv, bv, bl, bp in flags if bp < 4]
    print(f"# pre-scheduling VGPR demand allows < 4 waves/SIMD: {'none' if not by_pre else ', '.join(by_pre)}")
    low = [f"{n} ({wv} w{w}, VGPR {'%d' % bv if bv < 10**6 else '-'} / LDS {'%d' % bl if bl < 10**6 else '-'})"
           for n, w, wv, bv, bl, bp in flags if wv < 4]
    print(f"# < 4 waves/SIMD by any limit: {'none' if not low else ', '.join(low)}")

if __name__ == "__main__":
    main()
