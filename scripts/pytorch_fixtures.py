#!/usr/bin/env python3
"""PyTorch's own outputs for inputs syncstep writes, kept as small fixtures in tests/fixtures/pytorch.

For each fixture, `cargo run --release --example step_inputs` writes seeded weights (random
BatchNorm γ and β) and a synthetic batch with torchvision's names; torchvision's model then runs
one training step on them in float64: train-mode BatchNorm, cross-entropy with label smoothing
0.1, mean over the batch. The fixture records the loss, the logits, each parameter gradient's L2
norm and its elements at syncstep's sample indices (compare::sample_indices), and the running
statistics after the step likewise. tests/suite/pytorch.rs runs `syncstep grad` on the same
inputs and holds it to them. The weights are rewritten by the example each time; only outputs are committed.

Where a ReLU input lies within f32 rounding of zero, an f32 step decides it otherwise than the
f64 step and its gradients part from f64 ones by far more than rounding (docs/design.md, "Same
activation pattern"). A deep network has so many units that some always lie that close, so the
script nudges the seeded weights first: site by site in the f64 forward, each BatchNorm β whose
channel has a ReLU input within MARGIN of zero (relative to the site's RMS) moves by the least
that clears it, and the fixture records the new values (`nudges`: 276 of ResNet-50's 26,560
channels at 16 images), which tests/suite/pytorch.rs sets in the weights syncstep writes. The
same step in float32 then decides every ReLU and max-pool unit as the f64 step does (the script checks), and
its distance from f64 (loss, logits, worst gradient) is f32's rounding alone, recorded as
`f32_against_f64`.

Needs PyTorch, torchvision and safetensors only to regenerate the fixtures:

    python3 scripts/pytorch_fixtures.py
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
OUT_DIR = os.path.join(ROOT, "tests", "fixtures", "pytorch")

# (arch, seed, images, size, classes): small enough for the suite, large enough that every
# BatchNorm site sees at least 8 values per channel (layer4 at 1×1 with 8 images); ResNet-50 at
# 16, where its f32 rounding is 7e-5 (1.6e-4 at 8, past TIE's bound).
FIXTURES = [
    ("resnet18", 0, 8, 32, 10),
    ("resnet34", 0, 8, 32, 10),
    ("resnet50", 0, 16, 32, 10),
]
SAMPLES_PER_TENSOR = 64  # syncstep's compare::SAMPLES_PER_TENSOR
LABEL_SMOOTHING = 0.1
BN_MOMENTUM = 0.1
# Least distance from zero of every ReLU input after the nudges, relative to its site's RMS:
# about 100 times f32's rounding of a unit through the network.
MARGIN = 1e-4


def sample_indices(n):
    k = min(n, SAMPLES_PER_TENSOR)
    return [i * n // k for i in range(k)]


def write_inputs(path, arch, seed, images, size, classes):
    cmd = ["cargo", "run", "--quiet", "--release", "--example", "step_inputs", "--",
           path, str(seed), str(images), str(size), str(classes), arch]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")


def model_for(torch, torchvision, arch, tensors, classes, dtype):
    model = getattr(torchvision.models, arch)(num_classes=classes)
    state = {k: v.to(dtype) for k, v in tensors.items() if k not in ("input", "labels")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("num_batches_tracked") for k in missing):
        sys.exit(f"the inputs do not fit torchvision's {arch}: missing {missing}, unexpected {unexpected}")
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = BN_MOMENTUM
    return model.to(dtype).train()


def record_units(torch, model):
    """Hooks that list, in call order, each ReLU's input with the BatchNorm that ran last before
    it (whose β shifts that input) and each max-pool's input."""
    units, last_bn = [], [None]
    names = {m: n for n, m in model.named_modules()}

    def bn_ran(module, inputs, output):
        last_bn[0] = names[module]

    def unit(module, inputs):
        x = inputs[0].detach().clone()  # before an in-place ReLU overwrites it
        units.append((module, last_bn[0] if isinstance(module, torch.nn.ReLU) else None, x))

    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.register_forward_hook(bn_ran)
        if isinstance(m, (torch.nn.ReLU, torch.nn.MaxPool2d)):
            m.register_forward_pre_hook(unit)
    return units


def step(torch, torchvision, arch, tensors, classes, dtype):
    """One training step: loss, logits, {name: gradient}, {name: buffer after}, and its
    decisions (each ReLU's mask and each max-pool's argmaxes, in call order)."""
    model = model_for(torch, torchvision, arch, tensors, classes, dtype)
    units = record_units(torch, model)
    logits = model(tensors["input"].to(dtype))
    loss = torch.nn.functional.cross_entropy(logits, tensors["labels"], label_smoothing=LABEL_SMOOTHING)
    loss.backward()
    grads = {n: p.grad.detach().flatten() for n, p in model.named_parameters()}
    buffers = {n: b.detach().flatten() for n, b in model.named_buffers() if "running_" in n}
    decisions = []
    for module, _, x in units:
        if isinstance(module, torch.nn.ReLU):
            decisions.append(x > 0)
        else:
            args = (module.kernel_size, module.stride, module.padding)
            decisions.append(torch.nn.functional.max_pool2d(x, *args, return_indices=True)[1])
    return loss.item(), logits.detach(), grads, buffers, decisions


def least_shift(values, margin):
    """The shift of least size that leaves every one of `values` (1-D, f64) at least `margin`
    from zero: zero moved into the nearest gap between sorted values that is wide enough."""
    v = values.sort().values.tolist()
    edges = [float("-inf")] + v + [float("inf")]
    best = None
    for lo, hi in zip(edges, edges[1:]):
        if hi - lo < 2 * margin:
            continue
        zero = min(max(0.0, lo + margin), hi - margin)  # where zero goes inside this gap
        if best is None or abs(zero) < abs(best):
            best = zero
    return -best


def nudge(torch, torchvision, arch, tensors, classes):
    """Moves BatchNorm βs in `tensors` (f32) until every ReLU input of the f64 forward is at
    least MARGIN × its site's RMS from zero; the nudges, in the order made."""
    nudges = []
    for _ in range(10_000):
        model = model_for(torch, torchvision, arch, tensors, classes, torch.float64)
        units = record_units(torch, model)
        with torch.no_grad():
            model(tensors["input"].to(torch.float64))
        close = None
        for module, bn, x in units:
            if not isinstance(module, torch.nn.ReLU):
                continue
            margin = MARGIN * x.pow(2).mean().sqrt().item()
            per_channel = x.transpose(0, 1).flatten(1)
            near = (per_channel.abs() < margin).any(dim=1).nonzero().flatten().tolist()
            if near:
                close = (bn, per_channel, margin, near)
                break
        if close is None:
            return nudges
        bn, per_channel, margin, channels = close
        beta = tensors[bn + ".bias"]
        for c in channels:
            shift = least_shift(per_channel[c], 2 * margin)
            beta[c] = (beta[c] + torch.tensor(shift, dtype=torch.float32)).item()
            nudges.append({"tensor": bn + ".bias", "index": c, "value": float(f"{beta[c].item():.9g}")})
    sys.exit(f"{arch}: the nudges did not settle")


def norm_rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def summary(torch, named):
    out = []
    for name, v in named.items():
        v = v.to(torch.float64)
        out.append({
            "name": name,
            "len": v.numel(),
            "norm": v.norm().item(),
            "sample": [float(f"{v[i].item():.8g}") for i in sample_indices(v.numel())],
        })
    return out


def make(torch, torchvision, versions, arch, seed, images, size, classes):
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.safetensors")
        write_inputs(path, arch, seed, images, size, classes)
        tensors = load_file(path)
    nudges = nudge(torch, torchvision, arch, tensors, classes)
    loss, logits, grads, buffers, decided = step(torch, torchvision, arch, tensors, classes, torch.float64)
    loss32, logits32, grads32, _, decided32 = step(torch, torchvision, arch, tensors, classes, torch.float32)
    flips = sum(int((a != b).sum()) for a, b in zip(decided, decided32))
    if flips:
        sys.exit(f"{arch} seed {seed}: PyTorch's f32 step decides {flips} unit(s) otherwise than "
                 f"its f64 step after the nudges (a max-pool near-tie): choose another seed in FIXTURES")
    rounding = {
        "loss": abs(loss32 - loss) / abs(loss),
        "logits": norm_rel(logits32.double(), logits),
        "gradients": max(norm_rel(grads32[n].double(), g) for n, g in grads.items()),
    }
    return {
        "made_by": "scripts/pytorch_fixtures.py",
        "torch": versions[0],
        "torchvision": versions[1],
        "arch": arch,
        "seed": seed,
        "images": images,
        "image_size": size,
        "classes": classes,
        "label_smoothing": LABEL_SMOOTHING,
        "bn_momentum": BN_MOMENTUM,
        "nudges": nudges,
        "f32_against_f64": {k: float(f"{v:.3g}") for k, v in rounding.items()},
        "loss": loss,
        "logits": [[float(f"{x:.8g}") for x in row] for row in logits.tolist()],
        "samples_per_tensor": SAMPLES_PER_TENSOR,
        "gradients": summary(torch, grads),
        "running_after": summary(torch, buffers),
    }


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    try:
        import torch
        import torchvision
    except ImportError as e:
        sys.exit(f"needs PyTorch and torchvision ({e}); the committed fixtures stay as they are")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    versions = (torch.__version__, torchvision.__version__)
    os.makedirs(OUT_DIR, exist_ok=True)
    for arch, seed, images, size, classes in FIXTURES:
        fixture = make(torch, torchvision, versions, arch, seed, images, size, classes)
        out = os.path.join(OUT_DIR, f"{arch}-seed{seed}.json")
        with open(out + ".tmp", "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
        os.replace(out + ".tmp", out)
        print(f"{out}: loss {fixture['loss']:.6f}, {len(fixture['nudges'])} nudges, f32 against f64 "
              f"{fixture['f32_against_f64']}, {os.path.getsize(out) // 1024} KiB")


if __name__ == "__main__":
    main()
