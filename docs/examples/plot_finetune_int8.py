"""
Fine-tuning an int8 file and shipping it as int8
================================================

Files deployed on CPUs and edge devices are often int8: quantized after
training, with no float model beside them. Here the int8 file is PaddleOCR's
text-direction classifier as the ``rapidocr`` package ships it, quantized by
onnxruntime's own quantizer (``quantize_static``: QDQ form, int8 weights per
channel, uint8 activations), as a deployment would ship it.

:class:`ortbridge.OnnxModule` trains each int8 weight as a float parameter
under fake quantization, torch's quantization-aware training: the forward is
the int8 file's arithmetic, the gradient passes straight through each
rounding. ``save()`` writes an int8 file again, with the same nodes, scales
and zero points. We compare accuracy before and after fine-tuning, and the
file sizes.
"""

# %%
# The int8 file
# -------------

import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
import torch
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

import ortbridge
from ortbridge.examples import published_file, text_lines

source = published_file(
    "rapidocr", "3.10.0", "rapidocr/models/ch_ppocr_mobile_v2.0_cls_mobile.onnx"
)
workdir = tempfile.mkdtemp()

# %%
# Synthetic text lines (as in :doc:`plot_finetune_published`:
# :func:`ortbridge.examples.text_lines`): dark glyphs on a baseline, half the
# lines turned by 180 degrees (label 1).


rng = np.random.default_rng(0)


class Calibration:
    """Batches onnxruntime's quantizer measures the activations' ranges on."""

    def __init__(self, batches):
        self._left = iter(batches)

    def get_next(self):
        return next(self._left, None)


# paddle2onnx wrote opset 11 and held the weights in ``Constant`` nodes,
# which the quantizer leaves float: the file goes to opset 13 (per-channel
# scales need it) and through the quantizer's pre-processing (onnxruntime's
# own graph optimisation makes the weights initializers), as onnxruntime's
# documentation advises.
opset13 = os.path.join(workdir, "cls_opset13.onnx")
onnx.save(onnx.version_converter.convert_version(onnx.load(source), 13), opset13)
prepared = os.path.join(workdir, "cls_prepared.onnx")
quant_pre_process(opset13, prepared, skip_symbolic_shape=True)
input_name = onnx.load(source).graph.input[0].name
batches = [{input_name: text_lines(16, rng)[0]} for _ in range(8)]
int8_path = os.path.join(workdir, "cls_int8.onnx")
quantize_static(
    prepared, int8_path, Calibration(batches), quant_format=QuantFormat.QDQ,
    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
)  # fmt: skip
layer = ortbridge.OnnxModule(int8_path)
trained = dict(layer.named_onnx_parameters())
int8_weights = [
    i.name for i in onnx.load(int8_path).graph.initializer if i.data_type == onnx.TensorProto.INT8
]
print(f"{len(trained)} trainable parameters, {len(int8_weights)} of them int8 in the file")

# %%
# Accuracy before
# ---------------
#
# Measured with plain onnxruntime on the int8 file, the way it is deployed.

x_test, y_test = text_lines(256, rng)


def deployed_accuracy(path):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    probabilities = session.run(None, {input_name: x_test})[0]
    return float((probabilities.argmax(1) == y_test).mean())


print(f"float file's accuracy: {deployed_accuracy(str(source)):.3f}")
before = deployed_accuracy(int8_path)
print(f"int8 file's accuracy before fine-tuning: {before:.3f}")

# %%
# Fine-tuning the int8 file
# -------------------------
#
# As for the float file: the module stays in eval mode (BatchNormalization on
# its running statistics; the quantizer folded it into the convolutions
# anyway), every int8 weight trains as a float parameter, Adam is torch's.

optimizer = torch.optim.Adam(layer.parameters(), lr=3e-4)
losses = []
start = time.perf_counter()
for _ in range(40):
    x, y = text_lines(16, rng)
    probabilities = layer.eval()(torch.from_numpy(x))
    loss = torch.nn.functional.nll_loss(torch.log(probabilities + 1e-8), torch.from_numpy(y))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"40 steps in {time.perf_counter() - start:.1f} s")

# %%
# Shipping it as int8
# -------------------
#
# ``save`` writes the file in its own form: the trained weights rounded to
# their int8 values with the file's scales, the same QDQ nodes. The accuracy
# is measured on that file with plain onnxruntime.

tuned_path = os.path.join(workdir, "cls_int8_finetuned.onnx")
layer.save(tuned_path)
after = deployed_accuracy(tuned_path)
same_nodes = [n.op_type for n in onnx.load(tuned_path).graph.node] == [
    n.op_type for n in onnx.load(int8_path).graph.node
]
print(f"int8 file's accuracy after fine-tuning: {after:.3f} (same nodes: {same_nodes})")


# %%
# File sizes: the int8 weights are a quarter of their float size; scales,
# zero points and int32 biases make up much of the rest in a model this
# small. The fine-tuned file is the int8 file's size: nothing was added.


def kib(path, kinds):
    inits = onnx.load(path).graph.initializer
    return (
        sum(len(i.raw_data) or 4 * len(i.float_data) for i in inits if i.data_type in kinds) / 1024
    )


for name, path in (("int8", int8_path), ("fine-tuned int8", tuned_path)):
    print(
        f"{name} file: {os.path.getsize(path) / 1024:.0f} KiB, of which int8 weights "
        f"{kib(path, {onnx.TensorProto.INT8}):.0f} KiB"
    )
print(f"float file: {os.path.getsize(source) / 1024:.0f} KiB")

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
left.plot(losses)
left.set_xlabel("step")
left.set_ylabel("loss")
left.set_title("Fine-tuning the int8 file")
right.bar(["before", "after"], [before, after], color=["#999999", "#3c78d8"])
right.set_ylim(0, 1)
right.set_ylabel("accuracy of the int8 file (onnxruntime)")
right.set_title("Shipped as int8")
fig.tight_layout()
plt.show()
