"""
Low-rank adapters (LoRA) on an ONNX transformer
===============================================

Fine-tuning a downloaded transformer rarely trains all of it: its weights
stay frozen and small low-rank updates ``W + B @ A`` train beside them
(LoRA). The weights of an :class:`ortbridge.OnnxModule` are ordinary
``nn.Parameter``\\ s, so torch's parametrizations apply to them;
:func:`ortbridge.lora` puts one update on every weight a MatMul, Gemm or
Conv of the graph reads, and freezes the ONNX weights. ``save`` writes the
merged weights: the fine-tuned file needs neither ortbridge nor the adapters.

The transformer is a small BERT encoder from ``transformers`` (random
weights, exported by torch's TorchScript exporter). The task: say whether a
sequence holds more 7s than 9s.
"""

# %%
# The ONNX encoder
# ----------------

import io
import os
import tempfile
import warnings

import matplotlib.pyplot as plt
import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

import ortbridge

torch.manual_seed(0)
config = transformers.BertConfig(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
)
bert = transformers.BertModel(config, add_pooling_layer=False).eval()


class Encoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


buffer = io.BytesIO()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the exporter's notes
    torch.onnx.export(
        Encoder(bert),
        (torch.randint(1, 32, (4, 16)),),
        buffer,
        dynamo=False,
        opset_version=17,
        input_names=["ids"],
        dynamic_axes={"ids": {0: "batch"}},
    )
encoder_file = onnx.load_from_string(buffer.getvalue())


def batch(n, rng):
    ids = rng.integers(1, 32, (n, 16))
    labels = ((ids == 7).sum(1) > (ids == 9).sum(1)).astype(np.int64)
    return torch.from_numpy(ids), torch.from_numpy(labels)


rng = np.random.default_rng(0)
ids_test, labels_test = batch(512, rng)

# %%
# Two runs from the same start
# ----------------------------
#
# A new torch head reads the first position's features. One run trains the
# head alone on the frozen encoder; the other trains the head and rank-4
# adapters on every product weight of the encoder.


def train(adapt: bool, steps: int = 200):
    torch.manual_seed(1)
    encoder = ortbridge.OnnxModule(encoder_file)
    total = sum(p.numel() for p in encoder.parameters())
    if adapt:
        trained = ortbridge.lora(encoder, rank=4, alpha=8)
    else:
        trained = []
        for param in encoder.parameters():
            param.requires_grad_(False)
    head = torch.nn.Linear(32, 2)
    trained += list(head.parameters())
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    data = np.random.default_rng(2)
    losses = []
    for _ in range(steps):
        ids, labels = batch(64, data)
        loss = torch.nn.functional.cross_entropy(head(encoder(ids)[:, 0]), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        accuracy = float((head(encoder(ids_test)[:, 0]).argmax(1) == labels_test).float().mean())
    n_trained = sum(p.numel() for p in trained)
    print(f"{'LoRA + head' if adapt else 'head only':12s}: {n_trained:,} of "
          f"{total + n_trained:,} weights trained, accuracy {accuracy:.3f}")  # fmt: skip
    return encoder, head, losses, accuracy


_, _, head_losses, head_accuracy = train(adapt=False)
encoder, head, lora_losses, lora_accuracy = train(adapt=True)

# %%
# The merged file
# ---------------
#
# ``save`` writes ``W + B @ A`` into each adapted initializer: plain
# onnxruntime runs the fine-tuned encoder with the module's outputs.

saved = os.path.join(tempfile.mkdtemp(), "bert_lora_merged.onnx")
encoder.save(saved)
session = ort.InferenceSession(saved, providers=["CPUExecutionProvider"])
plain = session.run(None, {"ids": ids_test[:8].numpy()})[0]
with torch.no_grad():
    ours = encoder(ids_test[:8]).numpy()
print(f"merged file against the module: largest difference {np.abs(plain - ours).max():.1e}")

# %%
# Training curves
# ---------------

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(head_losses, label=f"head only (accuracy {head_accuracy:.2f})", color="tab:gray")
ax.plot(lora_losses, label=f"LoRA + head (accuracy {lora_accuracy:.2f})", color="tab:blue")
ax.set_xlabel("step (64 sequences)")
ax.set_ylabel("cross-entropy")
ax.set_title("rank-4 adapters on a frozen ONNX encoder")
ax.legend()
fig.tight_layout()
plt.show()
