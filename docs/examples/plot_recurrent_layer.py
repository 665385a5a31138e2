"""
A GRU exported to ONNX, trained as a layer
==========================================

``torch.onnx.export`` writes torch's recurrent layers as the ONNX ``GRU``,
``LSTM`` and ``RNN`` nodes. The onnxruntime engine differentiates them in
every configuration of ONNX's node tests, with maintained onnxruntime too. onnxruntime-training's
gradient builder handles the common ones, such as the unidirectional GRU
below, but not all of them: a bidirectional LSTM or a ``sequence_lens``
input, for instance, have no gradient kernel or fail in the builder.
``backend="auto"`` (the default) therefore runs this GRU on the training
agent where the training build is installed, and on the onnxruntime engine
otherwise, as in the environment that built this page; graphs the builder
cannot handle go to the onnxruntime engine in both.

This example exports a one-layer GRU, puts the ONNX graph in a torch model
with a linear head, and trains it to predict the next value of noisy periodic
signals. The same network, with the same initial weights, is trained in
plain torch beside it: the two loss curves should lie on top of each other,
since the ONNX layer computes torch's gradients.
"""

# %%
# Data: the next value of a noisy periodic signal
# -----------------------------------------------

import copy
import logging
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import onnxruntime
import torch

import ortbridge

SEQUENCE, BATCH = 24, 32
rng = np.random.default_rng(0)


def signals(n):
    """Sums of two sines with random frequencies and phases, plus noise."""
    t = np.arange(SEQUENCE + 1)
    freq = rng.uniform(0.1, 0.5, size=(n, 2, 1))
    phase = rng.uniform(0, 2 * np.pi, size=(n, 2, 1))
    wave = np.sin(freq * t + phase).sum(axis=1) / 2 + 0.05 * rng.standard_normal((n, len(t)))
    wave = wave.astype(np.float32)
    return torch.from_numpy(wave[:, :-1, None]), torch.from_numpy(wave[:, -1:])


x_train, y_train = signals(BATCH * 16)
x_test, y_test = signals(256)

# %%
# Export the recurrent part
# -------------------------
#
# The exported module returns the GRU's last hidden state; the batch axis is
# dynamic so that the test set can go through in one call.


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(1, 32, batch_first=True)

    def forward(self, x):
        _, hidden = self.gru(x)
        return hidden[0]


torch.manual_seed(0)
encoder = Encoder()
twin_encoder = copy.deepcopy(encoder)  # the plain torch reference, same weights

logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's notes
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program = torch.onnx.export(
        encoder,
        (x_train[:BATCH],),
        dynamo=True,
        optimize=False,
        verbose=False,
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )
gru_onnx = program.model_proto
print("ONNX nodes:", sorted({node.op_type for node in gru_onnx.graph.node}))

layer = ortbridge.OnnxModule(gru_onnx, backend="auto")
print("engine:", layer.backend, "-", layer.backend_reason)

# %%
# The two models
# --------------
#
# Same head, same initial weights; only the recurrent layer differs: an ONNX
# graph run by onnxruntime, or torch's own ``nn.GRU``.

torch.manual_seed(1)
head = torch.nn.Linear(32, 1)
onnx_model = torch.nn.Sequential(layer, head)
torch_model = torch.nn.Sequential(twin_encoder, copy.deepcopy(head))

with torch.no_grad():
    gap = (onnx_model(x_test) - torch_model(x_test)).abs().max().item()
print(f"largest difference of the two models' predictions before training: {gap:.2e}")

# %%
# Training
# --------
#
# The batches have a fixed shape: the onnxruntime engine builds the gradient
# graph of an RNN for a static input shape and caches it, so the first step
# pays for the build (shown separately below) and the others reuse it.


def fit(model, epochs=12):
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    losses, step_times = [], []
    for epoch in range(epochs):
        order = torch.from_numpy(np.random.default_rng(epoch).permutation(len(x_train)))
        for start in range(0, len(order), BATCH):
            rows = order[start : start + BATCH]
            tic = time.perf_counter()
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x_train[rows]), y_train[rows])
            loss.backward()
            optimizer.step()
            step_times.append(time.perf_counter() - tic)
        model.eval()
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(x_test), y_test).item())
        model.train()
    return losses, step_times


onnx_losses, onnx_times = fit(onnx_model)
torch_losses, torch_times = fit(torch_model)

print(f"{'model':16s} {'first step (s)':>14s} {'median step (ms)':>16s} {'test MSE':>9s}")
for name, losses, times in (
    ("ONNX GRU layer", onnx_losses, onnx_times),
    ("torch nn.GRU", torch_losses, torch_times),
):
    print(f"{name:16s} {times[0]:14.3f} {1e3 * np.median(times[1:]):16.2f} {losses[-1]:9.5f}")

# %%
# The trained weights are the layer's parameters; ``to_onnx()`` writes them
# back into the graph, and onnxruntime inference of it predicts as the module.

session = onnxruntime.InferenceSession(
    layer.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"]
)
(features,) = session.run(None, {layer.input_names[0]: x_test.numpy()})
with torch.no_grad():
    expected = layer(x_test).numpy()
print(f"onnxruntime vs module on the trained graph: {np.abs(features - expected).max():.2e}")

# %%
# Loss curves
# -----------

fig, ax = plt.subplots(figsize=(6, 4))
epochs = np.arange(1, len(onnx_losses) + 1)
ax.plot(epochs, torch_losses, "C0-", lw=4, alpha=0.4, label="torch nn.GRU")
ax.plot(epochs, onnx_losses, "C1.--", label=f"ONNX GRU ({layer.backend} engine)")
ax.set_xlabel("epoch")
ax.set_ylabel("test MSE")
ax.set_yscale("log")
ax.set_title("Next-value prediction, GRU(1 -> 32) + linear head")
ax.legend()
fig.tight_layout()
plt.show()
