"""Passes on the Scan nodes of a backward graph (recurrent layers' loops).

onnx-ad differentiates a Scan into a backward Scan whose body repeats, every
step, work that needs doing once: weight-gradient sums, products with
weights from outside the loop, a unit seed axis, copies of its outputs.
Each module moves one kind of that work out of the body or removes it.
"""
