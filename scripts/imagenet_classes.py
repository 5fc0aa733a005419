#!/usr/bin/env python3
"""Writes crates/syncstep/src/imagenet_classes.txt: ImageNet-1k's class names, one a line, in the order of
torchvision's classifiers, from torchvision's own metadata (what `syncstep predict --weights`
names a 1000-class prediction with). Needs torchvision only; downloads nothing.

    python3 scripts/imagenet_classes.py
"""

import pathlib

import torchvision

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates" / "syncstep" / "src" / "imagenet_classes.txt"


def main():
    names = torchvision.models.ResNet34_Weights.IMAGENET1K_V1.meta["categories"]
    if len(names) != 1000 or any(not n or "\n" in n for n in names):
        raise SystemExit(f"torchvision {torchvision.__version__}: unexpected categories")
    OUT.write_text("".join(f"{n}\n" for n in names), encoding="utf-8")
    print(f"{OUT}: {len(names)} names (torchvision {torchvision.__version__})")


if __name__ == "__main__":
    main()
