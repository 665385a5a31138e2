"""The onnxruntime engine (``backend="onnxruntime"``), for any maintained onnxruntime.

In: the prepared train variant of a model. Out: a gradient graph object
(:class:`._engine.OrtGradientGraph`) that runs a forward graph and a backward
graph as two plain inference sessions, built per input shape at the first
call that needs them. The steps, in order:

1. :mod:`._reverse_prep` and :mod:`._ad_rewrites` (with ``_conv``, ``_pad``,
   ``_slice`` and ``_bodies``) make the graph one onnx-ad differentiates
   correctly, refusing by name what it cannot; :mod:`._train_ops` lowers
   train-mode BatchNormalization and Dropout to standard ops, and
   :mod:`._resolved` keeps one graph per set of resolved If/Loop nodes.
2. onnx-ad's reverse mode writes the reverse model, with ortbridge's
   corrections to its rules (:mod:`._rules`).
3. :mod:`.passes` makes it cheaper (the optimiser's ordered passes) and
   :mod:`._split` cuts it into the forward and backward graphs, the backward
   reading the forward's residuals.
"""
