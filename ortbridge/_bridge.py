"""State shared by an :class:`~ortbridge.OnnxModule` and its autograd Function.

Holds the prepared graph and, per mode, device and set of tensors needing a
gradient, the onnxruntime sessions built for it (built on first use, kept).
"""

from __future__ import annotations

import onnx
import torch

from . import _graph
from ._runtime import GradientGraph, InferenceGraph, current_stream
from .exceptions import NotDifferentiableError


class Bridge:
    """Prepared graph plus caches of gradient graphs and inference sessions."""

    def __init__(
        self,
        model: onnx.ModelProto,
        input_names: list[str],
        weight_names: list[str],
        *,
        frozen_batch_norm: bool,
        providers=None,
        session_options=None,
    ):
        self.model = model
        self.input_names = list(input_names)
        self.weight_names = list(weight_names)
        self.feed_names = self.input_names + self.weight_names
        self.frozen_batch_norm = frozen_batch_norm
        self.providers = providers
        self.session_options = session_options
        position = {name: i for i, name in enumerate(self.feed_names)}
        self.batch_norms = [] if frozen_batch_norm else _graph.batch_norm_nodes(model)
        self._stat_positions = [(position[b.mean], position[b.var]) for b in self.batch_norms]
        #: Feed positions of the running statistics updated in train mode.
        self.running_stat_positions = {p for pair in self._stat_positions for p in pair}
        self._gradient_graphs: dict = {}
        self._inference_graphs: dict = {}

    def _variant(self, mode: str, for_gradient: bool):
        model, extra = _graph.make_variant(
            self.model, mode, self.frozen_batch_norm, for_gradient=for_gradient
        )
        return _graph.weights_as_inputs(model, self.weight_names), extra

    def gradient_graph(self, mode: str, needs_grad: tuple, device: torch.device) -> GradientGraph:
        # Called on every forward: the key is built without extra calls.
        stream = current_stream(device) if device.type == "cuda" else None
        key = (mode, needs_grad if type(needs_grad) is tuple else tuple(needs_grad), device, stream)
        graph = self._gradient_graphs.get(key)
        if graph is None:
            n_in = len(self.input_names)
            model, _ = self._variant(mode, for_gradient=True)
            inputs = [n for n, need in zip(self.input_names, needs_grad[:n_in]) if need]
            while True:
                try:
                    graph = GradientGraph(
                        model,
                        self.weight_names,
                        [n for n, need in zip(self.weight_names, needs_grad[n_in:]) if need],
                        inputs,
                        device,
                        self.session_options,
                        self.providers,
                        batch_norm_nodes=self.batch_norms if mode == _graph.TRAIN else (),
                        caller_order=self.feed_names,
                    )
                    break
                except NotDifferentiableError as exc:
                    # An input requiring grad that no gradient reaches gets
                    # none, as in torch (its .grad stays None).
                    if exc.unreachable not in inputs:
                        raise
                    inputs.remove(exc.unreachable)
            self._gradient_graphs[key] = graph
        return graph

    def inference_graph(self, mode: str, device: torch.device) -> InferenceGraph:
        key = (mode, device, current_stream(device))
        graph = self._inference_graphs.get(key)
        if graph is None:
            model, _ = self._variant(mode, for_gradient=False)
            graph = InferenceGraph(model, device, self.session_options, self.providers)
            self._inference_graphs[key] = graph
        return graph

    def update_running_stats(self, tensors, new_stats) -> None:
        """Copy the new running statistics (train mode) into their buffers."""
        if not new_stats:
            return
        with torch.no_grad():
            for (mean_pos, var_pos), k in zip(self._stat_positions, range(0, len(new_stats), 2)):
                tensors[mean_pos].copy_(new_stats[k])
                tensors[var_pos].copy_(new_stats[k + 1])

    def run_inference(self, mode: str, tensors) -> list[torch.Tensor]:
        graph = self.inference_graph(mode, tensors[0].device)
        outputs = graph.run(dict(zip(self.feed_names, tensors)))
        n_user = len(outputs) - (2 * len(self.batch_norms) if mode == _graph.TRAIN else 0)
        self.update_running_stats(tensors, outputs[n_user:])
        return outputs[:n_user]
