#!/usr/bin/env python3
"""The table of current figures in docs/performance.md, as markdown, from JSON files.

Each file gives one or more rows, in the order given. It reads three kinds:

- `syncstep bench --json`: the step (time, images/s, GFLOP/s), each replica's peak memory,
  with --replicas or --mpi the data-parallel ratios, with the roofline probe its best GEMM,
  with --profile the dispatches and kernel time;
- `syncstep bench --shapes-only --plan-for gpu --json`: the whole step and its convolutions by
  construction on an H200 and an H100;
- `python3 scripts/vs_pytorch.py --json`: the step beside PyTorch's.

Every row has a date and a machine, taken from the file where it records them ("date",
"machine"; vs_pytorch.py writes the date). Bench's JSON records neither, so give them: --date
and --machine hold for every file after them, until given again ("" clears them). Without
either, a row takes the day the file was last written, and names the adapter the file records
(lavapipe's Mesa version, or the GPU's name).

    python3 scripts/perf-table.py --machine "2-core AMD Zen 4, lavapipe Mesa 25.0.7" \\
        bench-32-8.json vs-224-8.json \\
        --date 2026-12-04 --machine "NVIDIA H200, 16 host cores" gpu-check/exchange-224.json
"""

import datetime
import json
import os
import re
import sys

HEADER = ["what", "figure", "command", "date", "machine"]
OPS = [("conv2d_forward", "forward"), ("conv2d_backward_input", "input-VJP"),
       ("conv2d_backward_weight", "weight gradient")]


def usage(problem):
    sys.exit(f"perf-table.py: {problem} (--help says how to call it)")


def secs(x):
    """Seconds to 3 significant figures."""
    return f"{x:.3g} s"


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def pct(x):
    return f"{100 * x:.0f}%"


def arch_title(name):
    """`resnet34` as the papers write it: ResNet-34."""
    return "ResNet-" + name[len("resnet"):] if name and name.startswith("resnet") else name


def adapter_words(adapter):
    """A short name for an adapter as `gpu::describe` writes it."""
    mesa = re.search(r"Mesa (\d+\.\d+\.\d+)", adapter)
    if "llvmpipe" in adapter:
        return "lavapipe" + (f" Mesa {mesa.group(1)}" if mesa else "")
    return adapter.split(" (")[0]


def file_date(path, report, given):
    """The file's own date, else the one given, else the day it was last written."""
    if report.get("date"):
        return report["date"]
    return given or datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat()


def shape(size, batch, arch=None):
    words = f"{size}², batch {batch}"
    return f"{arch_title(arch)}, {words}" if arch else words


def bench_command(r):
    """The command that wrote a bench file, as far as its config says."""
    c = r["config"]
    cmd = f"syncstep bench --image-size {c['image_size']} --batch {c['global_batch']}"
    if c.get("ranks", 1) > 1:
        cmd = f"mpirun -np {c['ranks']} {cmd} --mpi"
    elif c.get("replicas", 1) > 1:
        cmd += f" --replicas {c['replicas']}"
    if c.get("plan_for", "auto") != "auto":
        cmd += f" --plan-for {c['plan_for']}"
    cmd += f" --steps {c['steps']}"
    if c.get("profile"):
        cmd += " --profile"
    if not r.get("roofline"):
        cmd += " --no-roofline"
    return f"`{cmd}`"


def span(xs):
    """The least and most of some seconds, or the one figure where they agree."""
    lo, hi = f"{min(xs):.3g}", f"{max(xs):.3g}"
    return f"{lo} s" if lo == hi else f"{lo}–{hi} s"


def bench_rows(r):
    """Rows of a `syncstep bench --json` file."""
    c, step, cmd = r["config"], r["step"], bench_command(r)
    replicas = c["replicas"] * c.get("ranks", 1)
    at = shape(c["image_size"], c["global_batch"], c.get("arch"))
    if replicas > 1:
        at = f"{replicas} × {c['batch_per_replica']}, " + shape(c["image_size"], c["global_batch"], c.get("arch"))
    rows = []
    spread = f"{step['min_s']:.3g}–{step['max_s']:.3g}"
    figure = (f"{secs(step['median_s'])} median ({spread}): {step['images_per_s']:.1f} img/s, "
              f"{step['gflops']:.1f} GFLOP/s")
    if replicas == 1:
        rows.append((f"step, {at}", figure, cmd))
    else:
        ranks = f" over {c['ranks']} MPI ranks" if c.get("ranks", 1) > 1 else ""
        what = f"data-parallel step{ranks}, {at}"
        parts = [f"{secs(step['median_s'])} a step"]
        if r.get("ratio") is not None:
            parts.append(f"/ single device at {c['global_batch']}: {r['ratio']:.3f}")
        if r.get("exchange_ratio") is not None:
            parts.append(f"exchange ratio (/ the replicas' own steps): {r['exchange_ratio']:.3f}")
        if r.get("rank_received_bytes_per_step") is not None:
            parts.append(f"rank 0 received {mib(r['rank_received_bytes_per_step'])} a step")
        waits = r.get("exchange_wait") or []
        if waits:
            worst = max(w["median_s"] for w in waits)
            parts.append(f"exchange wait {worst * 1e3:.1f} ms (the slowest rank's median)")
        rows.append((what, "; ".join(parts), cmd))
    peak = max(m["peak_bytes"] for m in step["memory"])
    held = max(m["held_bytes"] for m in step["memory"])
    plan = f", plan {c['plan_for']}" if c.get("plan_for", "auto") != "auto" else ""
    rows.append((f"peak device memory per replica, {at}{plan}",
                 f"{mib(peak)} (held {mib(held)})", cmd))
    roof = r.get("roofline")
    if roof:
        best = max(roof["tiles"] + [roof["implicit"]], key=lambda p: p["gflops"])
        rows.append((f"GEMM roofline probe, {roof['size']}³", f"{roof['gflops']:.1f} GFLOP/s ({best['algo']})",
                     cmd))
    prof = r.get("profile")
    if prof:
        share = prof["kernel_s"] / prof["step_s"]
        rows.append((f"profiled step, {at}",
                     f"{prof['dispatches']} dispatches; {prof['kernel_s'] * 1e3:.0f} ms in kernels of a "
                     f"{prof['step_s'] * 1e3:.0f} ms step ({pct(share)})",
                     cmd))
    return rows


def shapes_rows(r):
    """The rows of a `syncstep bench --shapes-only --json` file: the whole step, then its
    convolutions."""
    c, predicted = r["config"], r["profile"]["predicted"]
    at = shape(c["image_size"], c["batch"], c.get("arch"))
    plan = c.get("plan_for", "gpu")
    step, conv_parts = [], []
    for name in ("H200", "H100"):
        if name not in predicted:
            continue
        p = predicted[name]
        conv, others = p["convolutions"], p["others"]
        ratio = p.get("speed_vs_pytorch_cuda")
        beside = f", {ratio:.2f}× PyTorch CUDA's measured {p['pytorch_cuda_s'] * 1e3:.1f} ms" if ratio else ""
        if not step:
            step.append(f"{len(p['dispatches'])} dispatches")
            step.append(f"{name}: {p['step_predicted_s'] * 1e3:.2f} ms = convolutions {conv['predicted_s'] * 1e3:.2f} "
                        f"+ other kernels {others['predicted_s'] * 1e3:.2f} + launch gaps "
                        f"{p['launch_gaps_s'] * 1e3:.2f}{beside}")
            by_op = " · ".join(pct(p["by_op"][op]["predicted_share"]) for op, _ in OPS)
            issue = " · ".join(pct(p["by_op"][op]["issue"]) for op, _ in OPS)
            conv_parts.append(f"{conv['flops'] / 1e9:.1f} GFLOP in {conv['dispatches']} dispatches")
            conv_parts.append(f"{name}: {pct(conv['predicted_share'])} of the f32 peak (by op {by_op}), "
                              f"multiply-adds {pct(conv['issue'])} of their instructions (by op {issue}), "
                              f"{pct(conv['useful'])} of them useful, occupancy ceiling "
                              f"{pct(conv['occupancy_ceiling'])}")
        else:
            step.append(f"{name}: {p['step_predicted_s'] * 1e3:.2f} ms")
            conv_parts.append(f"{name}: {pct(conv['predicted_share'])} / {pct(conv['occupancy_ceiling'])}")
    cmd = f"`syncstep bench --shapes-only --plan-for {plan} --image-size {c['image_size']} --batch {c['batch']}`"
    return [(f"step by construction ({plan} plan), {at}", "; ".join(step), cmd),
            (f"its convolutions by construction, {at}", "; ".join(conv_parts), "the same")]


def vs_rows(r):
    """Rows of a `scripts/vs_pytorch.py --json` file: one per TF32 setting, or syncstep alone."""
    at = shape(r["image_size"], r["batch"], r.get("arch"))
    rounds = r["rounds"]
    ours = [x["syncstep"]["median_s"] for x in rounds]
    our_peak = max(x["syncstep"]["peak_bytes"] for x in rounds)
    cmd = (f"`python3 scripts/vs_pytorch.py --image-size {r['image_size']} --batch {r['batch']} "
           f"--rounds {len(rounds)} --steps {r['steps']}`")
    kinds = sorted(r.get("ratio_median", {}))
    if not kinds:
        return [(f"step, {at} (PyTorch not run)", f"syncstep {span(ours)}; peak {mib(our_peak)}", cmd)]
    rows = []
    for tf32 in kinds:
        theirs = [x["pytorch"][tf32] for x in rounds]
        device = theirs[0].get("device", "")
        cuda = not device.startswith("CPU")
        label = f"PyTorch {'CUDA' if cuda else 'CPU'}" + (f", TF32 {tf32}" if cuda else "")
        per_round = ", ".join(f"{t['ratio']:.3f}" for t in theirs)
        peak = max(t["peak_bytes"] for t in theirs)
        figure = (f"syncstep {span(ours)}, PyTorch {span([t['median_s'] for t in theirs])}: "
                  f"{r['ratio_median'][tf32]:.3f}× PyTorch's speed (rounds {per_round}); "
                  f"peak {mib(our_peak)} / {mib(peak)}")
        rows.append((f"step beside {label}, {at}", figure, cmd))
    return rows


def machine_of(r):
    """The machine as the file's adapters and host say."""
    if r.get("tool") == "vs_pytorch":
        words = [adapter_words(a) for a in dict.fromkeys(r.get("adapters", []))]
        cpus = (r.get("host") or {}).get("cpus")
        if cpus:
            words.append(f"{cpus} CPUs")
        torch = next((t for x in r["rounds"] for t in x["pytorch"].values()), None)
        if torch:
            words.append(f"PyTorch {torch.get('torch', '?')} on {torch.get('device', '?')}")
        return ", ".join(words)
    if "adapters" in r:
        words = [adapter_words(a) for a in dict.fromkeys(r["adapters"])]
        threads = r.get("lp_num_threads")
        return ", ".join(words) + (f", LP_NUM_THREADS={threads}" if threads else "")
    return "by construction (`kernels::gpu_model`), no GPU run"


def rows_of(path):
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        usage(f"{path}: {e}")
    if report.get("tool") == "vs_pytorch":
        return report, vs_rows(report)
    if "step" in report and "config" in report:
        return report, bench_rows(report)
    if "profile" in report and "predicted" in (report.get("profile") or {}):
        return report, shapes_rows(report)
    usage(f"{path}: neither bench --json, bench --shapes-only --json nor vs_pytorch.py --json")


def cell(text):
    return str(text).replace("|", "\\|")


def main(argv):
    date = machine = None
    lines = []
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(__doc__)
            return 0
        if arg in ("--date", "--machine"):
            value = next(args, None)
            if value is None:
                usage(f"{arg} needs a value")
            if arg == "--date":
                date = value
            else:
                machine = value
            continue
        if arg.startswith("-"):
            usage(f"unknown option {arg}")
        report, rows = rows_of(arg)
        when = file_date(arg, report, date)
        where = report.get("machine") or machine or machine_of(report)
        lines += [list(row) + [when, where] for row in rows]
    if not lines:
        usage("no JSON files given")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in lines:
        print("| " + " | ".join(cell(x) for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
