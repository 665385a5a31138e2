"""An estimator's epoch in one onnxruntime call, on :class:`._graphs._epoch.EpochGraph`.

The model with its loss is the step of the graph's ``Loop``
(:meth:`_EpochsInGraph._epoch_engine`); the graphs are cached by batch size
and update rule. Their state is flat: the parameters of ``module_`` and the
velocities of ``optimizer_`` are made views of two flat buffers
(:meth:`_EpochsInGraph._flat_state`), which an epoch reads without packing
and writes back with one copy each, so that ``module_`` and ``optimizer_``
hold the trained state after every epoch (``to_onnx``, the predictions and
pickling read it there). A batch whose loss is not finite ends the epoch
with the weights of the batch before it.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _prepare
from .._runtime._sessions import quiet_session_options
from ._graphs._epoch import EpochGraph
from ._graphs._epoch import Hyper as _Hyper
from ._graphs._epoch import Rule as _Rule


class _EpochsInGraph:
    """One-call epochs of :class:`._estimators._BaseOnnxSGD`."""

    def _epoch_engine(self):
        """What runs epochs in onnxruntime, or None to run batch by batch.

        The model with its loss, ready for :class:`._graphs._epoch.EpochGraph`;
        models with BatchNormalization go batch by batch through ``module_``,
        which keeps their running statistics, and so do models whose trained
        weights are not all of the loss's type (the epoch graph's state is one
        flat vector).
        """
        if self._engine is False:
            model = _prepare.normalize(self.module_.to_onnx())
            loss_type = model.graph.output[0].type.tensor_type.elem_type
            trained = dict(self.module_.named_onnx_parameters())
            types = {init.data_type for init in model.graph.initializer if init.name in trained}
            if types != {loss_type} or any(
                node.op_type == "BatchNormalization" for node in model.graph.node
            ):
                self._engine = None
            else:
                model, _ = _prepare.make_variant(model, _prepare.TRAIN, False, for_gradient=True)
                self._engine = model
        return self._engine

    def _epoch_graph(self, rows):
        rule = _Rule(
            velocity=self.momentum != 0,
            nesterov=self.momentum != 0 and bool(self.nesterovs_momentum),
            l2=self.alpha != 0 and self.l1_ratio != 1,
            l1=self.alpha != 0 and self.l1_ratio != 0,
        )
        key = (rows, rule)
        graph = self._epoch_graphs.get(key)
        if graph is None:
            if len(self._epoch_graphs) >= 8:  # partial_fit on ever new sizes
                self._epoch_graphs.pop(next(iter(self._epoch_graphs)))
            module = self.module_
            graph = self._epoch_graphs[key] = EpochGraph(
                self._epoch_engine(),
                tuple(module.input_names),
                module.output_names[0],
                [name for name, _ in module.named_onnx_parameters()],
                self._penalised_names,
                rule,
                rows,
                _epoch_session_options(rows * self._n_weights()),
                self.backend,
            )
        return graph

    def _n_weights(self):
        return sum(t.numel() for t in self.module_.state_dict().values() if t.is_floating_point())

    def _epoch_in_graph(self, X, y, w, starts, stops, sums, lr):
        """The epoch as one onnxruntime call (two with a shorter last batch)."""
        params = [p for _, p in self.module_.named_onnx_parameters()]
        hyper = _Hyper(lr, self.momentum, self.alpha, self.l1_ratio)
        velocity = self.momentum != 0
        flat = self._flat_state(params, velocity)
        batch = int(stops[0] - starts[0])
        n_full = X.shape[0] // batch
        keep = sums > 0  # every row of the batch has weight 0: nothing to learn
        total = 0.0
        groups = [(batch, slice(0, n_full * batch), np.arange(n_full))]
        if n_full < len(starts):
            groups.append((int(stops[-1] - starts[-1]), slice(n_full * batch, None), [n_full]))
        state = [buffer.numpy() for buffer in flat]
        for rows, part, index in groups:
            index = np.asarray(index)[keep[index]]
            if not len(index):
                continue
            graph = self._epoch_graph(rows)
            data = [a[part].reshape(-1, rows, *a.shape[1:]) for a in (X, y, w)]
            batches = index - index[0] if rows != batch else index
            args = (data, batches, sums[index], hyper)
            new_state, values = graph.run(*args, state)
            finite = np.isfinite(values)
            if not finite.all():
                # Keep the weights of the last finite batch, then say where.
                bad = int(np.argmin(finite))
                if bad > 0:
                    state, _ = graph.run(*args, state, trips=bad)
                self._write_state(flat, state)
                start = int(starts[index[bad]])
                raise self._diverged(float(values[bad]), start, start + rows, lr)
            state = new_state
            # scikit-learn's loss_: the mean of each batch, weighted by its rows.
            total += float(np.sum(values.astype(np.float64) / sums[index] * rows))
        self._write_state(flat, state)
        return total

    def _flat_state(self, params, velocity):
        """The epoch graphs' state: flat buffers the parameters and velocities are views of.

        An epoch then reads the state without packing it and writes it back
        with one copy per buffer. Made again when a parameter or a velocity
        was replaced (``load_state_dict`` copies into them: it keeps them).
        """
        state = self.optimizer_.state
        flat = self._flat
        if flat is not None:
            views = flat[1] + (flat[3] if velocity else [])
            tensors = params + ([state[p].get("velocity") for p in params] if velocity else [])
            if len(flat[1]) == len(params) and all(
                t is not None and t.data_ptr() == v.data_ptr() and t.shape == v.shape
                for t, v in zip(tensors, views)
            ):
                return [flat[0], flat[2]] if velocity else [flat[0]]
        with torch.no_grad():
            weights, weight_views = _flat_views([p.detach() for p in params])
            for p, view in zip(params, weight_views):
                p.data = view
            velocities = [state[p].get("velocity") for p in params]
            velocities = [
                torch.zeros_like(p) if v is None else v for p, v in zip(params, velocities)
            ]
            vel, vel_views = _flat_views(velocities)
            for p, view in zip(params, vel_views):
                state[p]["velocity"] = view
        self._flat = (weights, weight_views, vel, vel_views)
        return [weights, vel] if velocity else [weights]

    @staticmethod
    def _write_state(flat, state):
        """Copy the state an epoch graph returned into the flat buffers."""
        for buffer, value in zip(flat, state):
            np.copyto(buffer.numpy(), value)


def _flat_views(tensors):
    """A flat tensor holding copies of ``tensors``, and views of it shaped as them."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    views, offset = [], 0
    for t in tensors:
        view = flat[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += t.numel()
    return flat, views


#: Multiply-adds of a step (about 3 per weight and row) under which one thread
#: is faster: waking a second one costs more than it saves. Measured: 2.3e5
#: (the scikit-learn benchmark) 6.9 ms an epoch on 1 thread, 8.0 on 2;
#: 3.9e7 (784-256-1, batch 64) 48 ms against 37.
_ONE_THREAD_WORK = 4e6


def _epoch_session_options(weights_times_rows):
    """Quiet sessions, not spinning; one thread for small steps, torch's count otherwise."""
    so = quiet_session_options()
    small = 3 * weights_times_rows < _ONE_THREAD_WORK
    so.intra_op_num_threads = 1 if small else torch.get_num_threads()
    so.inter_op_num_threads = 1
    return so
