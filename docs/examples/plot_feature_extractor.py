"""
An ONNX feature extractor inside a torch model
==============================================

A common situation: someone hands you a feature extractor as an ONNX file,
trained on a task close to yours, and you want a classifier for your own
labels. :class:`ortbridge.OnnxModule` makes the ONNX graph an ordinary
``torch.nn.Module`` layer, so the usual recipe applies:

1. train a new torch head on top of the frozen extractor;
2. unfreeze the extractor and fine-tune everything with a smaller learning
   rate, the ONNX layer's forward and backward running in onnxruntime.

Here the extractor is trained on the handwritten digits 0-4 of
scikit-learn's ``digits`` data set and exported with ``torch.onnx.export``;
the new task is to recognise all ten digits. We compare two runs that start
from the same trained head: one keeps the extractor frozen, the other
fine-tunes it.
"""

# %%
# The extractor, as someone else would have made it
# -------------------------------------------------
#
# A small torch network is trained for a few epochs on digits 0-4, then its
# feature part (64 pixels to 32 features) is exported. ``optimize=False``
# keeps every weight in the graph (the exporter's optimizer can fold or drop
# some, which would then not train).

import copy
import io
import logging
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import onnx
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ortbridge

torch.manual_seed(0)
digits = load_digits()
X = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.3, random_state=0, stratify=y)


def batches(X, y, batch_size=64, seed=0):
    """Shuffled mini-batches as torch tensors."""
    order = np.random.default_rng(seed).permutation(len(X))
    for start in range(0, len(X), batch_size):
        rows = order[start : start + batch_size]
        yield torch.from_numpy(X[rows]), torch.from_numpy(y[rows])


extractor = torch.nn.Sequential(
    torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.Tanh()
)
proxy = torch.nn.Sequential(extractor, torch.nn.Linear(32, 5))
first_five = y_train < 5
optimizer = torch.optim.Adam(proxy.parameters(), lr=1e-2)
for epoch in range(5):
    for xb, yb in batches(X_train[first_five], y_train[first_five], seed=epoch):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(proxy(xb), yb).backward()
        optimizer.step()

logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's notes
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program = torch.onnx.export(
        extractor,
        (torch.from_numpy(X_train[:8]),),
        dynamo=True,
        optimize=False,
        verbose=False,
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )
buffer = io.BytesIO()
onnx.save(program.model_proto, buffer)
extractor_onnx = buffer.getvalue()  # what we would read from a file
print(f"feature extractor: {len(extractor_onnx)} bytes of ONNX")

# %%
# The ONNX layer in a torch model
# -------------------------------
#
# Every float initializer of the graph becomes a parameter of the layer,
# named as in the graph. ``backend`` says which engine computes the
# gradients and ``backend_reason`` why.

layer = ortbridge.OnnxModule(extractor_onnx)
print(layer)
print("engine:", layer.backend, "-", layer.backend_reason)
for name, param in layer.named_onnx_parameters():
    print(f"  {name:12s} {tuple(param.shape)}")

# %%
# Step 1: train a head on the frozen extractor
# --------------------------------------------
#
# ``requires_grad_(False)`` freezes the ONNX weights as it would any torch
# layer's; onnxruntime then computes no weight gradient at all.


def evaluate(model):
    model.eval()
    with torch.no_grad():  # plain inference session, no activations kept
        logits = model(torch.from_numpy(X_test))
    model.train()
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y_test)).item()
    accuracy = (logits.argmax(1).numpy() == y_test).mean()
    return loss, accuracy


def train(model, optimizer, epochs, first_epoch=0):
    history = []
    for epoch in range(first_epoch, first_epoch + epochs):
        for xb, yb in batches(X_train, y_train, seed=100 + epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
        history.append((epoch + 1, *evaluate(model)))
    return history


head = torch.nn.Linear(32, 10)
model = torch.nn.Sequential(layer, head)
layer.requires_grad_(False)
start = time.perf_counter()
head_history = train(model, torch.optim.Adam(head.parameters(), lr=1e-2), epochs=15)
print(f"head only: {time.perf_counter() - start:.1f} s, test accuracy {head_history[-1][2]:.3f}")

# %%
# Step 2: frozen or fine-tuned
# ----------------------------
#
# Both runs start from the model above (``copy.deepcopy`` rebuilds the
# onnxruntime sessions of the copy). The frozen run goes on training the head
# only; the fine-tuned run unfreezes the ONNX layer and trains everything with
# a ten times smaller learning rate, the gradients of the extractor's weights
# computed by onnxruntime.

frozen = copy.deepcopy(model)
start = time.perf_counter()
frozen_history = train(
    frozen, torch.optim.Adam(frozen[1].parameters(), lr=1e-3), epochs=15, first_epoch=15
)
frozen_seconds = time.perf_counter() - start

tuned = copy.deepcopy(model)
tuned[0].requires_grad_(True)
start = time.perf_counter()
tuned_history = train(
    tuned, torch.optim.Adam(tuned.parameters(), lr=1e-3), epochs=15, first_epoch=15
)
tuned_seconds = time.perf_counter() - start

changed = max(
    (tuned[0].onnx_weight(name) - layer.onnx_weight(name)).abs().max().item()
    for name, _ in layer.named_onnx_parameters()
)
print(f"largest change of an extractor weight by fine-tuning: {changed:.3f}")
print(f"{'run':12s} {'seconds':>8s} {'test loss':>10s} {'accuracy':>9s}")
for label, history, seconds in (
    ("frozen", frozen_history, frozen_seconds),
    ("fine-tuned", tuned_history, tuned_seconds),
):
    print(f"{label:12s} {seconds:8.1f} {history[-1][1]:10.4f} {history[-1][2]:9.3f}")

# %%
# The fine-tuned extractor goes back out as ONNX, with its new weights, for
# any onnxruntime to run (``layer.save(path)`` writes the file).

trained_extractor = tuned[0].to_onnx()
print("initializers:", [init.name for init in trained_extractor.graph.initializer])

# %%
# Loss curves
# -----------

fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
for label, history, style in (
    ("head on frozen extractor", head_history, "k-"),
    ("frozen, head only", frozen_history, "C0-"),
    ("fine-tuned, ONNX layer trained", tuned_history, "C1-"),
):
    epochs, losses, accuracies = zip(*history)
    ax_loss.plot(epochs, losses, style, label=label)
    ax_acc.plot(epochs, accuracies, style, label=label)
for ax in (ax_loss, ax_acc):
    ax.axvline(15.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("epoch")
ax_loss.set_ylabel("test cross-entropy")
ax_loss.set_yscale("log")
ax_acc.set_ylabel("test accuracy")
ax_acc.legend(loc="lower right")
fig.suptitle("Digits 0-9 on an extractor trained on digits 0-4")
fig.tight_layout()
plt.show()
