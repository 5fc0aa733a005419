#!/usr/bin/env python3
"""PyTorch's own outputs for inputs syncstep writes, kept as small fixtures in tests/fixtures/pytorch.

For each fixture, `cargo run --release --example step_inputs` writes seeded weights (random
BatchNorm γ and β) and a synthetic batch with torchvision's names; torchvision's model then runs
one training step on them in float64: train-mode BatchNorm, cross-entropy with label smoothing
0.1, mean over the batch. The fixture records the loss, the logits, each parameter gradient's L2
norm and its elements at syncstep's sample indices (compare::sample_indices), and the running
statistics after the step likewise. tests/pytorch.rs runs `syncstep grad` on the same inputs and
holds it to them. The weights are rewritten by the example each time; only outputs are committed.

The same step in float32 is compared with float64 first. Where a ReLU input lies within f32
rounding of zero, f32 gradients part from f64 ones by far more than rounding (docs/design.md,
"Same activation pattern"); such a seed cannot make a fixture, and the script says so.

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
# BatchNorm site sees at least 8 values per channel (layer4 at 1×1 with 8 images). No ResNet-50:
# at 32² its f32 step parts from f64 by 2.5e-4 (past CALM) by rounding alone, and at 33² and 48²
# (layer4 at 2×2) seeds 0-3 each put some of its many ReLU inputs within rounding of zero.
FIXTURES = [
    ("resnet18", 0, 8, 32, 10),
    ("resnet34", 0, 8, 32, 10),
]
SAMPLES_PER_TENSOR = 64  # syncstep's compare::SAMPLES_PER_TENSOR
LABEL_SMOOTHING = 0.1
BN_MOMENTUM = 0.1
# Largest f32-against-f64 gradient error (norm-rel) a fixture's seed may show.
CALM = 1e-4


def sample_indices(n):
    k = min(n, SAMPLES_PER_TENSOR)
    return [i * n // k for i in range(k)]


def write_inputs(path, arch, seed, images, size, classes):
    cmd = ["cargo", "run", "--quiet", "--release", "--example", "step_inputs", "--",
           path, str(seed), str(images), str(size), str(classes), arch]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")


def step(torch, torchvision, arch, tensors, classes, dtype):
    """One training step: loss, logits, {name: gradient}, {name: buffer after}."""
    model = getattr(torchvision.models, arch)(num_classes=classes)
    state = {k: v.to(dtype) for k, v in tensors.items() if k not in ("input", "labels")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("num_batches_tracked") for k in missing):
        sys.exit(f"the inputs do not fit torchvision's {arch}: missing {missing}, unexpected {unexpected}")
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = BN_MOMENTUM
    model = model.to(dtype).train()
    logits = model(tensors["input"].to(dtype))
    loss = torch.nn.functional.cross_entropy(logits, tensors["labels"], label_smoothing=LABEL_SMOOTHING)
    loss.backward()
    grads = {n: p.grad.detach().flatten() for n, p in model.named_parameters()}
    buffers = {n: b.detach().flatten() for n, b in model.named_buffers() if "running_" in n}
    return loss.item(), logits.detach(), grads, buffers


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
    loss, logits, grads, buffers = step(torch, torchvision, arch, tensors, classes, torch.float64)
    _, _, grads32, _ = step(torch, torchvision, arch, tensors, classes, torch.float32)
    chaos = max(norm_rel(grads32[n].double(), g) for n, g in grads.items())
    if not chaos <= CALM:
        sys.exit(f"{arch} seed {seed}: PyTorch's f32 step is {chaos:.2e} from its f64 step "
                 f"(a ReLU input within rounding of zero): choose another seed in FIXTURES")
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
        "f32_against_f64": float(f"{chaos:.3g}"),
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
        print(f"{out}: loss {fixture['loss']:.6f}, f32 against f64 {fixture['f32_against_f64']:.1e}, "
              f"{os.path.getsize(out) // 1024} KiB")


if __name__ == "__main__":
    main()
