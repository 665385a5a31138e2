"""
A published ONNX backbone, frozen, under a new torch head
=========================================================

openWakeWord ships its speech embedding model in its PyPI wheel: a Keras
network converted by tf2onnx that turns 76 frames of a 32-band
mel spectrogram into 96 features. Put inside a torch model as an
:class:`ortbridge.OnnxModule` with its weights frozen, it is a feature
extractor a small torch head learns on: torch trains the head, onnxruntime
runs the backbone (as plain inference, since nothing in it needs a
gradient).

The task is synthetic: tell a rising tone from a falling one and from a
steady one, in noise.
"""

# %%
# The backbone
# ------------

import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import ortbridge
from ortbridge.examples import published_file

path = published_file("openwakeword", "0.4.0", "openwakeword/resources/models/embedding_model.onnx")
backbone = ortbridge.OnnxModule(path).eval()
backbone.requires_grad_(False)
print(backbone)

# %%
# Synthetic spectrograms
# ----------------------
#
# A bright band moving up (class 0), down (class 1) or staying (class 2)
# across the 32 mel bands over the 76 frames, in Gaussian noise.


def clips(n, rng):
    frames, bands = np.arange(76)[:, None], np.arange(32)[None, :]
    labels = rng.integers(0, 3, n)
    x = rng.normal(0, 0.3, (n, 76, 32)).astype(np.float32)
    for clip, label in zip(x, labels):
        slope = rng.uniform(0.15, 0.35) * (1, -1, 0)[label]
        centre = rng.uniform(4, 28) + slope * (frames - 38)
        clip += 2.0 * np.exp(-0.5 * ((bands - centre) / 1.5) ** 2)
    return torch.from_numpy(x[..., None]), torch.from_numpy(labels)


rng = np.random.default_rng(0)
x_test, y_test = clips(300, rng)

fig, axes = plt.subplots(1, 3, figsize=(9, 2.6), sharey=True)
for label, ax in enumerate(axes):
    ax.imshow(x_test[y_test == label][0, ..., 0].T, origin="lower", aspect="auto")
    ax.set_title(("rising", "falling", "steady")[label])
    ax.set_xlabel("frame")
axes[0].set_ylabel("mel band")
fig.tight_layout()

# %%
# The model: ONNX backbone, torch head
# ------------------------------------

model = torch.nn.Sequential(
    backbone,
    torch.nn.Flatten(),
    torch.nn.Linear(96, 32),
    torch.nn.ReLU(),
    torch.nn.Linear(32, 3),
)
trained = [p for p in model.parameters() if p.requires_grad]
print(f"{sum(p.numel() for p in trained):,} weights train, "
      f"{sum(p.numel() for p in backbone.parameters()):,} stay frozen")  # fmt: skip
optimizer = torch.optim.Adam(trained, lr=3e-3)
losses, accuracies = [], []
start = time.perf_counter()
for step in range(150):
    x, y = clips(32, rng)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % 10 == 9:
        with torch.no_grad():
            accuracies.append(float((model(x_test).argmax(1) == y_test).float().mean()))
print(f"150 steps in {time.perf_counter() - start:.1f} s, accuracy {accuracies[-1]:.3f}")

# %%
# Training curve
# --------------

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(losses, color="tab:blue", label="cross-entropy")
ax.set_xlabel("step (32 clips)")
ax.set_ylabel("cross-entropy")
second = ax.twinx()
second.plot(range(9, 150, 10), accuracies, "o-", color="tab:orange", label="test accuracy")
second.set_ylabel("test accuracy")
second.set_ylim(0, 1.05)
ax.set_title("a torch head on openWakeWord's frozen ONNX embedding model")
fig.tight_layout()
plt.show()
