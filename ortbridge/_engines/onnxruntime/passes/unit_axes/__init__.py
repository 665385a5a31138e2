"""Passes on where axes of size 1 sit in a backward graph.

onnx-ad's reverse carries a unit seed axis on every adjoint, and moves it
(and a model's own unit axes) with ``Reshape`` and ``Transpose`` nodes that
cost onnxruntime a dispatch each, or a slow path of its Transpose kernel.
One module removes the seed axis from the adjoints; the other squeezes the
transposes that still move a unit axis, and composes those of transposes.
"""
