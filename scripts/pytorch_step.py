#!/usr/bin/env python3
"""PyTorch's ResNet-34 training step, the same step `syncstep bench` times.

torchvision's resnet34 (random weights, K classes), training mode, f32: forward,
cross-entropy with label smoothing 0.1, backward, and SGD with momentum 0.9 and weight decay
5e-4 (syncstep's `StepConfig::default`). Synthetic images and labels, made once. Prints one
JSON object: the median, min and max seconds a step over the timed steps, images/s, and the
peak memory of the step (CUDA: `max_memory_allocated`; CPU: the growth of the process's peak
resident set over what it held before the model existed).

Run by scripts/vs_pytorch.py, which alternates it with `syncstep bench`; alone:
    python3 scripts/pytorch_step.py --image-size 32 --batch 8 --device cpu
"""

import argparse
import json
import resource
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--tf32", choices=["off", "on"], default="off",
                   help="CUDA only: TF32 in matmuls and convolutions")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0: PyTorch's default)")
    args = p.parse_args()
    for name in ("image_size", "batch", "classes", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def peak_rss_bytes():
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    args = parse_args()
    try:
        import torch
        import torchvision
    except ImportError as e:
        print(f"PyTorch is not installed ({e}): pip install torch torchvision", file=sys.stderr)
        return 3
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: PyTorch sees no CUDA device", file=sys.stderr)
        return 3
    if args.threads:
        torch.set_num_threads(args.threads)
    tf32 = args.device == "cuda" and args.tf32 == "on"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    device = torch.device(args.device)
    rss_before = peak_rss_bytes()

    torch.manual_seed(0)
    model = torchvision.models.resnet34(num_classes=args.classes).to(device).train()
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.classes, (args.batch,), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()
        opt.step()
        return loss

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        name = torch.cuda.get_device_name()
    else:
        peak = peak_rss_bytes() - rss_before
        name = f"CPU, {torch.get_num_threads()} threads"
    median = statistics.median(seconds)
    print(json.dumps({
        "torch": torch.__version__,
        "device": name,
        "tf32": tf32,
        "image_size": args.image_size,
        "batch": args.batch,
        "median_s": median,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "steps_s": seconds,
        "images_per_s": args.batch / median,
        "peak_bytes": peak,
        "loss": float(loss),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
