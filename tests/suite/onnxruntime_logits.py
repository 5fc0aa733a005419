#!/usr/bin/env python3
"""Runs an ONNX model in onnxruntime for tests/suite/export.rs:

    onnxruntime_logits.py MODEL.onnx INPUT.f32 BATCH SIZE

INPUT.f32 holds BATCH images [3, SIZE, SIZE] as little-endian float32. Prints JSON: the model's
input's and output's names and dimensions (a symbolic one by its name), the logits of the whole
batch and those of the first image run alone (a batch of 1, which a dynamic batch must take),
its producer and its metadata.
"""

import json
import sys

import numpy as np
import onnxruntime


def dims(value):
    return {"name": value.name, "dims": [d if isinstance(d, int) else str(d) for d in value.shape]}


def main():
    model, data, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    x = np.fromfile(data, dtype="<f4").reshape(batch, 3, size, size)
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (output,) = session.get_outputs()
    (input_,) = session.get_inputs()
    logits = session.run(None, {input_.name: x})[0]
    alone = session.run(None, {input_.name: x[:1]})[0]
    report = {
        "input": dims(input_),
        "output": dims(output),
        "logits": logits.astype(float).tolist(),
        "first_alone": alone.astype(float).tolist(),
        "metadata": session.get_modelmeta().custom_metadata_map,
        "producer": session.get_modelmeta().producer_name,
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
