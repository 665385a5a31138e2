"""
Fine-tuning a published model: PP-OCR's text-direction classifier
=================================================================

Most ONNX files people hold were downloaded, written by an exporter nobody
here controls. This one ships inside the ``rapidocr`` package on PyPI: the
PaddleOCR text-direction classifier, exported by paddle2onnx, which tells an
upright line of text from one turned upside down. Its weights sit in
``Constant`` nodes and its BatchNormalization nodes have the five outputs of
old opsets; :class:`ortbridge.OnnxModule` reads the file as it is and makes
those weights ``nn.Parameter``\\ s.

We fine-tune it on synthetic text lines unlike anything it was trained on,
and compare its accuracy before and after.
"""

# %%
# The file, as a user finds it
# ----------------------------
#
# The model comes from the wheel of a pinned version of the package
# (``pip download --no-deps rapidocr==3.10.0``, the member read from the
# wheel, cached); any copy of the file works the same.

import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import onnxruntime as ort
import torch

import ortbridge
from ortbridge import examples
from ortbridge.examples import published_file

path = published_file("rapidocr", "3.10.0", "rapidocr/models/ch_ppocr_mobile_v2.0_cls_mobile.onnx")
start = time.perf_counter()
classifier = ortbridge.OnnxModule(path)
print(f"built in {time.perf_counter() - start:.1f} s")
print(classifier)

# %%
# Synthetic text lines
# --------------------
#
# Grey glyphs of random widths standing on a baseline, some with ascenders,
# dots or descenders, on a 48 x 96 line; half the lines are turned by 180
# degrees (label 1). The classifier takes three channels scaled to [-1, 1]
# (:func:`ortbridge.examples.text_lines` draws them).


def text_lines(n, rng):
    images, labels = examples.text_lines(n, rng)  # the lines, as numpy arrays
    return torch.from_numpy(images), torch.from_numpy(labels)


rng = np.random.default_rng(0)
x_test, y_test = text_lines(256, rng)


def accuracy(model):
    with torch.no_grad():
        probabilities = model.eval()(x_test)
    return float((probabilities.argmax(1) == y_test).float().mean())


before = accuracy(classifier)
print(f"accuracy before fine-tuning: {before:.3f}")

# %%
# Fine-tuning
# -----------
#
# The graph ends in a softmax, so the loss is the negative log of the right
# class's probability. The module stays in eval mode: BatchNormalization
# keeps its running statistics (batches of 16 lines are too small to
# estimate new ones), while every weight trains. Forward and backward run in
# onnxruntime; Adam is torch's.

optimizer = torch.optim.Adam(classifier.parameters(), lr=3e-4)
losses = []
start = time.perf_counter()
for _ in range(40):
    x, y = text_lines(16, rng)
    probabilities = classifier.eval()(x)
    loss = torch.nn.functional.nll_loss(torch.log(probabilities + 1e-8), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
after = accuracy(classifier)
print(f"40 steps in {time.perf_counter() - start:.1f} s; accuracy after: {after:.3f}")

# %%
# The fine-tuned file
# -------------------
#
# ``save`` writes the trained weights back where the file held them (into
# its ``Constant`` nodes); plain onnxruntime runs the result.

saved = os.path.join(tempfile.mkdtemp(), "ppocr_cls_finetuned.onnx")
classifier.save(saved)
session = ort.InferenceSession(saved, providers=["CPUExecutionProvider"])
plain = session.run(None, {classifier.input_names[0]: x_test[:8].numpy()})[0]
with torch.no_grad():
    ours = classifier.eval()(x_test[:8]).numpy()
print(f"largest difference from plain onnxruntime: {np.abs(plain - ours).max():.1e}")

# %%
# What changed
# ------------

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot(losses)
left.set_yscale("log")
left.set_xlabel("step (16 lines)")
left.set_ylabel("cross-entropy")
left.set_title("fine-tuning the published classifier")
right.bar(["before", "after"], [before, after], color=["tab:gray", "tab:blue"])
right.set_ylim(0, 1.05)
right.set_ylabel("accuracy on 256 synthetic lines")
for k, value in enumerate([before, after]):
    right.text(k, value + 0.02, f"{value:.2f}", ha="center")
fig.tight_layout()
plt.show()
