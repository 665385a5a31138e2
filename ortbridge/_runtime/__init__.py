"""onnxruntime's plumbing, shared by both engines and the training helpers.

In: ONNX graphs and torch tensors. Out: inference sessions and the tensors
they return, without copies where DLPack allows. :mod:`._ort` says which
onnxruntime is installed (and which CUDA package a GPU needs),
:mod:`._sessions` makes sessions and hands tensors over, :mod:`._threads`
keeps onnxruntime's workers off the caller's core, :mod:`._limits` fits a
model's opsets to what the installed runtime loads, and :mod:`._errors`
turns onnxruntime's failures into ortbridge's errors, in plain words.
"""
