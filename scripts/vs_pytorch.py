#!/usr/bin/env python3
"""syncstep's training step beside PyTorch's, at the same shapes, in alternating runs.

Each round runs `syncstep bench` (one device) and then scripts/pytorch_step.py, each in a
fresh process, and prints both medians with the ratio PyTorch s / syncstep s: syncstep's speed
as a fraction of PyTorch's (1.0: as fast). On a CUDA machine PyTorch runs twice a round, TF32
off and on. Where PyTorch is not installed, it says so and times syncstep alone.
Ratios within a round are what to compare: these machines drift between rounds.

    python3 scripts/vs_pytorch.py --image-size 32 --batch 8
    python3 scripts/vs_pytorch.py --image-size 224 --batch 8 --rounds 2 --steps 3
    python3 scripts/vs_pytorch.py --syncstep "scripts/mesa-sid.sh target/release/syncstep"
    python3 scripts/vs_pytorch.py --image-size 224 --batch 8 --json vs-224-8.json

--json writes every round's figures, the date and the adapter, for scripts/perf-table.py.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps of each run")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="PyTorch's device (auto: CUDA where PyTorch sees one)")
    p.add_argument("--syncstep", default=None,
                   help="the syncstep binary (default: target/release/syncstep, else PATH), "
                   "or a command that runs it with the arguments that follow, as "
                   "\"scripts/mesa-sid.sh target/release/syncstep\"")
    p.add_argument("--bench-args", default="",
                   help="more arguments for syncstep bench, e.g. \"--adapter vulkan:0\"")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rounds, the date and the adapter as JSON to PATH")
    args = p.parse_args()
    for name in ("image_size", "batch", "rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def syncstep_command(given):
    """The syncstep command as a list: the binary, or a launcher and its arguments before it."""
    if given:
        return shlex.split(given)
    built = os.path.join(HERE, "..", "target", "release", "syncstep")
    if os.path.exists(built):
        return [os.path.normpath(built)]
    found = shutil.which("syncstep")
    if not found:
        sys.exit("no syncstep binary: cargo build --release, or give --syncstep PATH")
    return [found]


def run(cmd, what):
    """Runs `cmd` and returns the finished process; on failure exits with what it printed."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{what} failed (exit {done.returncode}):\n{done.stderr.strip()}")
    return done


def bench(syncstep, args, out):
    cmd = syncstep + ["bench", "--image-size", str(args.image_size), "--batch", str(args.batch),
           "--steps", str(args.steps), "--no-roofline", "--json", out] + args.bench_args.split()
    run(cmd, "syncstep bench")
    with open(out) as f:
        report = json.load(f)
    step = report["step"]
    return step["median_s"], max(m["peak_bytes"] for m in step["memory"]), report["adapters"]


def torch_device(args):
    """PyTorch's device for this run, or None (with the reason printed) where it cannot run."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, torchvision; print(torch.cuda.is_available())"],
        capture_output=True, text=True)
    if probe.returncode != 0:
        print("PyTorch is not installed here (pip install torch torchvision): "
              "syncstep alone.\n")
        return None
    cuda = probe.stdout.strip() == "True"
    if args.device == "cuda" and not cuda:
        sys.exit("--device cuda: PyTorch sees no CUDA device")
    return "cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu"


def pytorch(args, device, tf32):
    cmd = [sys.executable, os.path.join(HERE, "pytorch_step.py"),
           "--image-size", str(args.image_size), "--batch", str(args.batch),
           "--steps", str(args.steps), "--device", device, "--tf32", tf32]
    if device == "cpu":
        cmd += ["--threads", str(os.cpu_count() or 1)]
    return json.loads(run(cmd, "scripts/pytorch_step.py").stdout)


def mib(n):
    return f"{n / 2**20:.0f} MiB"


def main():
    args = parse_args()
    syncstep = syncstep_command(args.syncstep)
    device = torch_device(args)
    kinds = [] if device is None else (["off", "on"] if device == "cuda" else ["off"])
    print(f"ResNet-34 training step, {args.image_size}×{args.image_size}, batch {args.batch}, "
          f"median of {args.steps} steps a run, {args.rounds} rounds")
    ratios = {k: [] for k in kinds}
    rounds, adapters = [], []
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, args.rounds + 1):
            ours, our_peak, adapters = bench(syncstep, args, os.path.join(tmp, "bench.json"))
            line = f"round {r}: syncstep {ours:.4f} s (peak {mib(our_peak)})"
            rounds.append({"syncstep": {"median_s": ours, "peak_bytes": our_peak}, "pytorch": {}})
            for tf32 in kinds:
                theirs = pytorch(args, device, tf32)
                ratio = theirs["median_s"] / ours
                ratios[tf32].append(ratio)
                rounds[-1]["pytorch"][tf32] = dict(theirs, ratio=ratio)
                label = "PyTorch" + (f" TF32 {tf32}" if device == "cuda" else "")
                line += (f" | {label} {theirs['median_s']:.4f} s (peak "
                         f"{mib(theirs['peak_bytes'])}, {theirs['device']}): {ratio:.3f}×")
            print(line, flush=True)
    for tf32, rs in ratios.items():
        label = "PyTorch" + (f" TF32 {tf32}" if device == "cuda" else "")
        print(f"syncstep's speed / {label}'s, median of {len(rs)} rounds: "
              f"{statistics.median(rs):.3f}× (rounds {', '.join(f'{x:.3f}' for x in rs)})")
    if args.json:
        write_json(args, started, adapters, rounds, ratios)
    return 0


def write_json(args, started, adapters, rounds, ratios):
    """The figures for scripts/perf-table.py. "pytorch" and "ratio_median" are keyed by TF32
    ("off", and on CUDA "on"); ratio is PyTorch s / syncstep s, as printed."""
    figures = {
        "tool": "vs_pytorch",
        "date": started.strftime("%Y-%m-%d"),
        "started": started.isoformat(timespec="seconds"),
        "arch": "resnet34",
        "image_size": args.image_size,
        "batch": args.batch,
        "steps": args.steps,
        "bench_args": args.bench_args,
        "adapters": adapters,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                 "system": platform.platform()},
        "rounds": rounds,
        "ratio_median": {k: statistics.median(rs) for k, rs in ratios.items()},
    }
    with open(args.json, "w") as f:
        json.dump(figures, f, indent=1)
        f.write("\n")
    print(f"figures written to {args.json}")


if __name__ == "__main__":
    sys.exit(main())
