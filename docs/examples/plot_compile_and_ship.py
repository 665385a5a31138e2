"""
Compile a torch model with an ONNX layer inside, and ship it as one ONNX file
=============================================================================

A torch model here holds an ONNX layer between two torch layers. It trains
under ``torch.compile(fullgraph=True)``, where the ONNX layer is one torch
operator (``ortbridge::onnx_layer``), and ``torch.onnx.export`` then writes
the whole model, the trained ONNX layer inlined, as one file that plain
onnxruntime runs, with the batch left dynamic.
"""

# %%
# The model
# ---------
#
# The ONNX layer is a small MLP exported from torch; in practice it would be
# a file you downloaded.

import io
import warnings

import matplotlib.pyplot as plt
import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

import ortbridge

torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
buffer = io.BytesIO()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.onnx.export(
        mlp,
        (torch.randn(2, 16),),
        buffer,
        dynamo=False,
        input_names=["x"],
        dynamic_axes={"x": {0: "batch"}},
    )
layer = ortbridge.OnnxModule(buffer.getvalue())
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), layer, nn.Tanh(), nn.Linear(8, 3))

# %%
# Training, compiled
# ------------------
#
# A synthetic task: which of three centres a point lies nearest. The whole
# model compiles as one graph; a new batch size does not compile again.

rng = np.random.default_rng(0)
centres = rng.normal(0, 2, (3, 4)).astype(np.float32)


def batch(n):
    x = rng.normal(0, 1.5, (n, 4)).astype(np.float32)
    y = np.argmin(((x[:, None] - centres[None]) ** 2).sum(-1), axis=1)
    return torch.from_numpy(x), torch.from_numpy(y)


compiled = torch.compile(model, fullgraph=True, dynamic=True)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(150):
    x, y = batch(32 if step % 2 else 48)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(compiled(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

x_test, y_test = batch(500)
model.eval()
with torch.no_grad():
    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
print(f"accuracy on new points: {accuracy:.3f}")

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(losses)
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy")
ax.set_title("A torch model with an ONNX layer, trained compiled")
fig.tight_layout()

# %%
# One ONNX file
# -------------
#
# ``torch.onnx.export`` writes the torch layers as its exporter does and the
# ONNX layer's graph in its place, with the weights just trained.

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program = torch.onnx.export(
        model, (x_test[:4],), dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},)
    )
proto = program.model_proto
print([node.op_type for node in proto.graph.node])
onnx.checker.check_model(proto)

session = onnxruntime.InferenceSession(
    proto.SerializeToString(), providers=["CPUExecutionProvider"]
)
name = session.get_inputs()[0].name
(shipped,) = session.run(None, {name: x_test.numpy()})
with torch.no_grad():
    ours = model(x_test).numpy()
print(f"plain onnxruntime on 500 points against the model: {np.abs(shipped - ours).max():.1e}")
