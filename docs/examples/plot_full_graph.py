"""
Full-graph training: checkpoints and export
===========================================

When the whole model is ONNX, torch has nothing to do during training.
:class:`ortbridge.training.OrtFullGraphTrainer` appends the loss, the
gradients and the optimizer's update (torch's ``AdamW`` or ``SGD``) to the
graph, and each training step is one onnxruntime call; the weights and the
optimizer state stay in onnxruntime's buffers from step to step.

This example trains a small MLP to fit a surface, stops half way and writes a
checkpoint (weights, AdamW moments, step count, shuffling state), goes on in
the same trainer and in a fresh trainer that loads the checkpoint, checks
that the two runs are the same, and exports the trained model for
onnxruntime inference.
"""

# %%
# A model and a surface to fit
# ----------------------------
#
# The model could come from anywhere; here a torch MLP is exported once.

import logging
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import onnx
import onnxruntime
import torch

from ortbridge.training import OrtFullGraphTrainer

rng = np.random.default_rng(0)
X = rng.uniform(-1, 1, size=(2048, 2)).astype(np.float32)


def surface(X):
    return (np.sin(3 * X[:, :1]) * np.cos(2 * X[:, 1:])).astype(np.float32)


y = surface(X)

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Linear(2, 64),
    torch.nn.Tanh(),
    torch.nn.Linear(64, 64),
    torch.nn.Tanh(),
    torch.nn.Linear(64, 1),
)
logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's notes
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program = torch.onnx.export(
        net,
        (torch.from_numpy(X[:8]),),
        dynamo=True,
        optimize=False,
        verbose=False,
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )
mlp_onnx = program.model_proto

# %%
# Train, stop, checkpoint
# -----------------------
#
# ``fit`` runs ``max_iter`` epochs and continues from the current state when
# called again. The files go to a folder next to this script.

workdir = Path("full_graph_run")
workdir.mkdir(exist_ok=True)

options = dict(
    loss="squared_error",
    optimizer="adamw",
    learning_rate=3e-3,
    batch_size=64,
    max_iter=20,
    random_state=0,
)
trainer = OrtFullGraphTrainer(mlp_onnx, **options)
start = time.perf_counter()
trainer.fit(X, y)
first_half = time.perf_counter() - start
trainer.save_checkpoint(workdir / "half_way.ckpt")
print(
    f"{trainer.n_iter_} epochs, {trainer.n_steps_} steps (one onnxruntime call each) "
    f"in {first_half:.2f} s, loss {trainer.train_losses_[-1]:.5f}"
)
print(f"checkpoint: {(workdir / 'half_way.ckpt').stat().st_size} bytes")

# %%
# Two ways to go on
# -----------------
#
# The same trainer trains 20 more epochs. A new trainer, built with the same
# model and options, loads the checkpoint and trains the same 20 epochs: it
# draws the same batches and applies the same AdamW updates, so its losses
# should equal the first trainer's.

start = time.perf_counter()
trainer.fit(X, y)
second_half = time.perf_counter() - start

resumed = OrtFullGraphTrainer(mlp_onnx, **options)
resumed.load_checkpoint(workdir / "half_way.ckpt")
resumed.fit(X, y)

continued = np.array(trainer.train_losses_[-20:])
reloaded = np.array(resumed.train_losses_[-20:])
weights, weights_resumed = trainer.get_weights(), resumed.get_weights()
print(f"epochs 21-40 in {second_half:.2f} s ({1e3 * second_half / 20 / 32:.3f} ms a step)")
print(f"largest difference of the losses: {np.abs(continued - reloaded).max():.1e}")
print(
    "largest difference of the weights:",
    f"{max(np.abs(weights[k] - weights_resumed[k]).max() for k in weights):.1e}",
)

# %%
# Export for inference
# --------------------
#
# ``to_onnx`` returns the predicting model (no loss, no optimizer) with the
# trained weights, in an IR version the installed onnxruntime loads. Any
# onnxruntime runs it.

onnx.save(trainer.to_onnx(), workdir / "trained.onnx")
session = onnxruntime.InferenceSession(
    str(workdir / "trained.onnx"), providers=["CPUExecutionProvider"]
)
grid = np.stack(np.meshgrid(np.linspace(-1, 1, 60), np.linspace(-1, 1, 60)), -1)
grid = grid.reshape(-1, 2).astype(np.float32)
(predicted,) = session.run(None, {session.get_inputs()[0].name: grid})
print(f"onnxruntime vs trainer.predict: {np.abs(predicted - trainer.predict(grid)).max():.1e}")
print(f"RMS error on the grid: {np.sqrt(np.mean((predicted - surface(grid)) ** 2)):.4f}")

# %%
# The same training in torch
# --------------------------
#
# For scale, the torch network the graph was exported from, trained the same
# way in torch eager (torch's ``AdamW``, same learning rate and batch size;
# its own shuffling, so the curve differs a little).

optimizer = torch.optim.AdamW(net.parameters(), lr=options["learning_rate"])
X_t, y_t = torch.from_numpy(X), torch.from_numpy(y)
order_rng = np.random.default_rng(1)
torch_losses = []
start = time.perf_counter()
for _ in range(trainer.n_iter_):
    order = torch.from_numpy(order_rng.permutation(len(X)))
    total = 0.0
    for begin in range(0, len(X), options["batch_size"]):
        rows = order[begin : begin + options["batch_size"]]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(X_t[rows]), y_t[rows])
        loss.backward()
        optimizer.step()
        total += loss.item() * len(rows)
    torch_losses.append(total / len(X))
torch_seconds = time.perf_counter() - start
steps = trainer.n_steps_
print(f"{'':24s} {'ms a step':>9s} {'last epoch loss':>15s}")
print(
    f"{'OrtFullGraphTrainer':24s} {1e3 * (first_half + second_half) / steps:9.3f} "
    f"{trainer.train_losses_[-1]:15.5f}"
)
print(f"{'torch eager, AdamW':24s} {1e3 * torch_seconds / steps:9.3f} {torch_losses[-1]:15.5f}")

# %%
# Loss curves and the fitted surface
# ----------------------------------

fig, (ax_loss, ax_true, ax_fit) = plt.subplots(1, 3, figsize=(13, 4), layout="constrained")
epochs = np.arange(1, trainer.n_iter_ + 1)
ax_loss.plot(epochs, trainer.train_losses_, "C0-", lw=4, alpha=0.4, label="one trainer, 40 epochs")
ax_loss.plot(epochs[20:], reloaded, "C1.--", label="new trainer from the checkpoint")
ax_loss.plot(epochs, torch_losses, "C2-", lw=1, label="torch eager, AdamW")
ax_loss.axvline(20.5, color="grey", lw=0.8, ls=":")
ax_loss.set_xlabel("epoch")
ax_loss.set_ylabel("training MSE")
ax_loss.set_yscale("log")
ax_loss.legend(fontsize="small")
for ax, values, title in (
    (ax_true, surface(grid), "target sin(3 x1) cos(2 x2)"),
    (ax_fit, predicted, "trained.onnx in onnxruntime"),
):
    image = ax.imshow(
        values.reshape(60, 60), origin="lower", extent=(-1, 1, -1, 1), vmin=-1, vmax=1
    )
    ax.set_title(title)
    ax.set_xlabel("x1")
fig.colorbar(image, ax=[ax_true, ax_fit], shrink=0.8)
plt.show()
