"""The order of the example gallery: from a first ONNX layer to the benchmarks."""

from __future__ import annotations

ORDER = [
    "plot_feature_extractor.py",
    "plot_finetune_published.py",
    "plot_finetune_published_int8.py",
    "plot_finetune_int8.py",
    "plot_lora_transformer.py",
    "plot_compile_and_ship.py",
    "plot_frozen_backbone.py",
    "plot_recurrent_layer.py",
    "plot_sklearn_mlp.py",
    "plot_full_graph.py",
    "plot_engines.py",
]


class ExampleOrder:
    """Sort key for sphinx-gallery's ``within_subsection_order``: the list above."""

    def __init__(self, src_dir):
        self.src_dir = src_dir

    def __call__(self, filename: str):
        return (ORDER.index(filename) if filename in ORDER else len(ORDER), filename)

    def __repr__(self):
        return f"<{type(self).__name__}>"
