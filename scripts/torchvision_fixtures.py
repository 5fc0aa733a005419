#!/usr/bin/env python3
"""Writes the fixtures that hold `syncstep predict --weights` to PyTorch
(tests/suite/pretrained.rs), under tests/fixtures/torchvision/:

- chelsea.png, coffee.png: crops of two photographs scikit-image ships (a cat, 201x150; an
  espresso, 150x200), at their own resolution, as PNG (lossless, so syncstep decodes the
  pixels PIL does).
- preprocess.json: for each photo and input size, torchvision's evaluation preprocessing on
  the PIL image (Resize(floor(size*256/224)), CenterCrop(size)) as 8-bit HWC pixels: their
  SHA-256, per-channel sums, and every 4th row and column (base64).
- predict.json: torchvision's resnet18, resnet34 and resnet50 in eval mode, each with seeded
  weights, on each photo at 224 (the full recipe: ToTensor and ImageNet's Normalize too): the
  top-5 classes and their softmax probabilities, and the SHA-256 of the weights.

The weights are not stored (47 to 102 MB): both sides make them from a recipe. For the tensor `name`
with n elements, u_i = (splitmix64(fnv1a64(name) + i) >> 40) * 2^-23 - 1 in f32 (uniform in
[-1, 1), exact), then: conv weights u * sqrt(6 / fan_in); BatchNorm weights 0.7 + 0.25 u;
BatchNorm biases, running means and fc.bias 0.1 u; running variances 1 + 0.5 u; fc.weight
0.1 u (every scale rounded to f32, every product and sum in f32). These keep the logits of a
random network in a range where probabilities differ from photo to photo (not ResNet-101's: its
top class takes all but 1e-10 of the probability). The training step's fixtures
(scripts/pytorch_fixtures.py) take syncstep's own seeded weights instead, whose running
statistics (0 and 1) saturate every eval-mode network deeper than ResNet-18.

Needs torch, torchvision, Pillow and NumPy; scikit-image only for the photos (kept if already
there). Downloads nothing. Run from anywhere:

    python3 scripts/torchvision_fixtures.py [--weights-out W.safetensors]

--weights-out also saves resnet34's weights (needs the safetensors package), to run
`syncstep predict --weights W.safetensors tests/fixtures/torchvision/*.png` by hand.
"""

import argparse
import base64
import hashlib
import json
import pathlib

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image
from torchvision import transforms

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "torchvision"
# (file, scikit-image's photo, crop box (left, upper, right, lower) in its pixels)
PHOTOS = [
    ("chelsea.png", "chelsea", (120, 60, 321, 210)),
    ("coffee.png", "coffee", (215, 60, 365, 260)),
]
SIZES = [224, 160, 64, 32]
STRIDE = 4
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
MASK = (1 << 64) - 1
ARCHS = ["resnet18", "resnet34", "resnet50"]


def fnv1a64(name):
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def uniform(name, n):
    """The recipe's u for `name`: n values in [-1, 1), f32."""
    z = np.uint64(fnv1a64(name)) + np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-23) - np.float32(1.0)


def seeded_state_dict(arch, num_classes=1000):
    """`arch`'s state_dict made by the recipe (num_batches_tracked left as it is)."""
    model = getattr(torchvision.models, arch)(num_classes=num_classes)
    f32 = np.float32
    state = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            state[name] = t
            continue
        u = uniform(name, t.numel()).reshape(tuple(t.shape))
        if t.dim() == 4:
            v = u * f32(np.sqrt(6.0 / (t.shape[1] * t.shape[2] * t.shape[3])))
        elif name.endswith("running_var"):
            v = f32(1.0) + f32(0.5) * u
        elif name.endswith(("running_mean", "bias")) or name == "fc.weight":
            v = f32(0.1) * u
        else:
            v = f32(0.7) + f32(0.25) * u
        state[name] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    return state


def weights_sha256(state):
    """SHA-256 of the float tensors' f32 little-endian bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        if state[name].is_floating_point():
            h.update(state[name].numpy().astype("<f4").tobytes())
    return h.hexdigest()


def write_photos():
    try:
        import skimage.data
    except ImportError:
        if all((OUT / f).exists() for f, _, _ in PHOTOS):
            print("scikit-image is not installed: keeping the photos there")
            return
        raise SystemExit("scikit-image is needed to write the photos: pip install scikit-image")
    for file, photo, box in PHOTOS:
        Image.fromarray(getattr(skimage.data, photo)()).crop(box).save(OUT / file, optimize=True)


def preprocess_cases():
    cases = []
    for file, _, _ in PHOTOS:
        img = Image.open(OUT / file).convert("RGB")
        for size in SIZES:
            resize = size * 256 // 224
            crop = transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(size)])
            px = np.asarray(crop(img), dtype=np.uint8)
            cases.append({
                "photo": file,
                "size": size,
                "resize": resize,
                "sha256": hashlib.sha256(px.tobytes()).hexdigest(),
                "channel_sums": [int(px[:, :, c].sum()) for c in range(3)],
                "stride": STRIDE,
                "subsample": base64.b64encode(px[::STRIDE, ::STRIDE].tobytes()).decode(),
            })
    return cases


def predictions(arch, state):
    model = getattr(torchvision.models, arch)()
    model.load_state_dict(state)
    model.eval()
    names = torchvision.models.ResNet34_Weights.IMAGENET1K_V1.meta["categories"]
    recipe = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    out = []
    for file, _, _ in PHOTOS:
        x = recipe(Image.open(OUT / file).convert("RGB")).unsqueeze(0)
        with torch.no_grad():
            logits = model(x)[0]
        p = torch.softmax(logits.double(), 0)
        top = torch.topk(p, 5)
        out.append({
            "photo": file,
            "top": [
                {"index": int(i), "class": names[int(i)], "probability": float(v)}
                for v, i in zip(top.values, top.indices)
            ],
        })
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights-out", type=pathlib.Path)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    write_photos()
    made_by = f"scripts/torchvision_fixtures.py: torch {torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}"
    (OUT / "preprocess.json").write_text(
        json.dumps({"made_by": made_by, "cases": preprocess_cases()}, indent=1) + "\n")
    networks = []
    for arch in ARCHS:
        state = seeded_state_dict(arch)
        networks.append({"arch": arch, "weights_sha256": weights_sha256(state),
                         "predictions": predictions(arch, state)})
        if args.weights_out and arch == "resnet34":
            import safetensors.torch
            safetensors.torch.save_file(state, str(args.weights_out))
    report = {"made_by": made_by, "image_size": 224, "networks": networks}
    (OUT / "predict.json").write_text(json.dumps(report, indent=1) + "\n")
    for f in sorted(OUT.iterdir()):
        print(f"{f}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
