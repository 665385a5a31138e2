"""The command line (``python -m ortbridge``): ``inspect`` and ``demo``.

In: a model path or nothing. Out: text on stdout: what the graph holds and
what ortbridge would do with it (:mod:`._inspect`), or a short training run
on data that ships with scikit-learn (:mod:`._demo`, the main job).
"""
