#!/usr/bin/env python3
"""Writes the fixture that holds `syncstep export` to PyTorch (tests/suite/export.rs),
tests/fixtures/export/torchvision.json: for each of torchvision's resnet18, resnet34, resnet50
and resnet101 with 10 classes,

- state_dict: every entry of the model's `state_dict()` (name, dtype, shape), in its order:
  what `load_state_dict(strict=True)` requires of a file, no more and no less;
- logits: the model in eval mode, with the weights of scripts/torchvision_fixtures.py's recipe,
  on the recipe's tensor `input` [2, 3, 32, 32] (float32, as PyTorch computes it), and the
  SHA-256 of those weights.

The suite makes the same weights and input, exports them through a checkpoint, and holds the
export's tensors to `state_dict`, and syncstep's logits and onnxruntime's on the exported ONNX
to `logits`. Needs torch, torchvision and NumPy; downloads nothing.

    python3 scripts/export_fixtures.py

By hand, to load an export in PyTorch and run both exports on the recipe's input:

    python3 scripts/export_fixtures.py --check model.safetensors [--onnx model.onnx]

loads the safetensors into torchvision's model of its arch with `strict=True` (needs the
safetensors package) and prints its logits, and with --onnx onnxruntime's (needs onnxruntime)
and the largest difference between the two.
"""

import argparse
import json
import pathlib
import sys

import numpy as np
import torch
import torchvision

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from torchvision_fixtures import seeded_state_dict, uniform, weights_sha256  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "export"
ARCHS = ["resnet18", "resnet34", "resnet50", "resnet101"]
CLASSES, BATCH, SIZE = 10, 2, 32


def recipe_input(size):
    """The recipe's tensor `input`: [BATCH, 3, size, size]."""
    return torch.from_numpy(uniform("input", BATCH * 3 * size * size).reshape(BATCH, 3, size, size))


def logits(model, size):
    model.eval()
    with torch.no_grad():
        return model(recipe_input(size))


def network(arch):
    model = getattr(torchvision.models, arch)(num_classes=CLASSES)
    entries = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
               for name, t in model.state_dict().items()]
    state = seeded_state_dict(arch, CLASSES)
    model.load_state_dict(state, strict=True)
    return {
        "arch": arch,
        "state_dict": entries,
        "weights_sha256": weights_sha256(state),
        "logits": logits(model, SIZE).tolist(),
    }


def dumps(value, depth=0):
    """JSON with one line per entry of a state_dict: a diff of it reads as what changed."""
    pad = " " * (depth + 1)
    if isinstance(value, dict) and depth < 4:
        items = [f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)) and depth < 4:
        items = [pad + (dumps(v, depth + 1) if isinstance(v, dict) else json.dumps(v)) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"
    return json.dumps(value)


def check(path, onnx_path):
    import safetensors
    import safetensors.torch

    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
    state = safetensors.torch.load_file(str(path))
    arch, size = meta["arch"], int(meta["image_size"])
    model = getattr(torchvision.models, arch)(num_classes=state["fc.weight"].shape[0])
    print(f"{path}: {model.load_state_dict(state, strict=True)} (strict=True, {arch})")
    torch_logits = logits(model, size).numpy()
    print(f"PyTorch's logits on the recipe's input [{BATCH}, 3, {size}, {size}]:\n{torch_logits}")
    if onnx_path:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        ort_logits = session.run(None, {"input": recipe_input(size).numpy()})[0]
        print(f"onnxruntime's on {onnx_path}:\n{ort_logits}")
        print(f"largest difference: {np.abs(ort_logits - torch_logits).max():.3e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", type=pathlib.Path)
    parser.add_argument("--onnx", type=pathlib.Path)
    args = parser.parse_args()
    if args.check:
        return check(args.check, args.onnx)
    made_by = f"scripts/export_fixtures.py: torch {torch.__version__}, torchvision {torchvision.__version__}"
    report = {
        "made_by": made_by,
        "classes": CLASSES,
        "image_size": SIZE,
        "batch": BATCH,
        "networks": [network(arch) for arch in ARCHS],
    }
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "torchvision.json"
    out.write_text(dumps(report) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
