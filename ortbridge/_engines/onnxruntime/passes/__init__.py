"""The onnxruntime engine's graph optimiser: a package of passes.

In: onnx-ad's general reverse model (and the user's graph before it, and the
forward and backward graphs after the cut). Out: the same graphs, rewritten
in place into equal forms that onnxruntime runs faster or that keep fewer
tensors between forward and backward. One module per pass (or family of
passes); :mod:`._pipeline` holds the contract they share and the ordered
list they run in; :mod:`.scan` holds the passes on recurrent layers' loops.
"""

from ._pipeline import BACKWARD, PASSES, PRIMAL, REVERSE, Graphs, Pass, run

__all__ = ["BACKWARD", "PASSES", "PRIMAL", "REVERSE", "Graphs", "Pass", "run"]
