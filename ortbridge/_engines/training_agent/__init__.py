"""The training-agent engine (``backend="training-agent"``).

In: the prepared train variant of a model (weights as graph inputs). Out: a
gradient graph object (:class:`._engine.GradientGraph`) that runs
onnxruntime-training 1.19.2's gradient builder once and its ``TrainingAgent``
for every forward and backward. The builder is frozen and gets some nodes
wrong: :mod:`._limits` is the table of what it refuses, crashes on or
differentiates wrongly (probed by ``tests/builder_probes.py``),
:mod:`._rewrites` rewrites the nodes it gets wrong before it sees them, and
:mod:`._gradient_rewrites` fixes the graphs it writes.
"""
