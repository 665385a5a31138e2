"""The ONNX graphs training writes: gradients, updates, a step, an epoch.

In: a model with its loss output and the names of its trainable weights.
Out: graphs onnxruntime runs in one call each: the loss's gradient graph,
from onnxruntime-training's builder or onnx-ad's reverse mode
(:mod:`._gradient`, :mod:`._reverse_gradient`); optimizer updates as ONNX
nodes (:mod:`._update`, :mod:`._sgd_rule`); one training step
(:mod:`._step`); a whole epoch in one ``Loop`` (:mod:`._epoch`).
"""
