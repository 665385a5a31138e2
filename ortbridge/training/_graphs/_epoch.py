"""A whole epoch of the estimators' mini-batch SGD in one onnxruntime call.

An epoch on small batches is thousands of tiny steps. Run one by one, each
pays for a forward call, a backward call and an update call, torch's
autograd and Python, which together cost more than the arithmetic (about
600 us a step against 200 us for scikit-learn's whole numpy step on the
model of ``benchmarks/bench_sklearn.py``). Here a step is the body of an
ONNX ``Loop``; the weights and velocities are its loop-carried state and the
batch losses a scan output, so an epoch is one call and nothing crosses into
Python between steps. A step:

- takes its batch ``batches[i]`` out of the epoch's rows, given as arrays
  of shape ``(number of batches, rows, ...)``;
- runs the forward, the loss and the backward of a gradient source
  (:mod:`._gradient`: the training build's gradient builder, or onnx-ad's
  standard-op reverse graph, which any onnxruntime runs);
- applies scikit-learn's update with the nodes :class:`.._sgd.SklearnSGD`
  runs (:func:`._sgd_rule._update_nodes`); the coefficients that depend on the
  batch (``1 / sum of its sample weights`` times the learning rate...) are
  computed by the caller in float64 and gathered per step.

What makes a step cheap is the number of nodes, each costing about a
microsecond of dispatch whatever its size:

- every batch of a graph has the same number of rows, fixed in the graph,
  so that the backward's shape computations (``Shape``,
  ``BroadcastGradientArgs``, ``Reshape``) fold into constants, a third of the
  nodes (onnxruntime folds the builder's, onnx-ad's graph is built static and
  its seed axis's views collapsed by the optimiser's
  :mod:`~ortbridge._engines.onnxruntime.passes._simplify`); a shorter last
  batch runs on a second graph built for its size;
- the weights are one flat vector, split into views for the forward, and
  their gradients are concatenated, so the update is a handful of nodes
  for all weights instead of a handful per weight;
- the backward's seed (the gradient of the loss, 1) is the batch's
  coefficient of the gradient, so the gradients come out scaled (where the
  seed has the loss's type: not for a float64 loss on the builder, whose
  seed is float32).

A step whose loss is not finite does not stop the loop; the caller finds it
in the returned losses and reruns the epoch up to the batch before it, from
the state it started from, to keep the last finite weights.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortbridge._engines.onnxruntime.passes._simplify import merge_reshapes
from ortbridge._runtime._errors import translate
from ortbridge._runtime._limits import fit_to_runtime
from ortbridge._runtime._sessions import training_session

from ._gradient import ONNX_AD, gradient_model
from ._sgd_rule import _Flags, _scalar_names, _scalar_values, _update_nodes

_P = "ortbridge_epoch/"
#: Coefficients that depend on the batch (through its sum of sample weights).
_PER_BATCH = frozenset({"ca", "cd", "ce", "a", "d", "e", "ka"})


class Rule(NamedTuple):
    """What an update computes: scikit-learn's SGD with these terms."""

    velocity: bool
    nesterov: bool
    #: The elastic penalty's L2 and L1 parts (on the penalised weights).
    l2: bool
    l1: bool


class Hyper(NamedTuple):
    """An epoch's hyperparameters."""

    lr: float
    momentum: float
    alpha: float
    l1_ratio: float


def _dims(value: onnx.ValueInfoProto) -> list:
    dims = value.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else None for d in dims]


class EpochGraph:
    """The epoch loop of one model for batches of ``rows`` rows.

    ``model`` maps its ``data_inputs`` ``(X, target, weight)`` to the scalar
    ``loss``, the weighted sum over the batch (:func:`.._losses.append_loss`);
    ``trainable`` are the weights to update, ``penalised`` those under the
    elastic penalty. The state is two flat vectors: the weights, flattened
    and concatenated in ``trainable`` order, and their velocities.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        data_inputs: tuple[str, str, str],
        loss: str,
        trainable: list[str],
        penalised: set[str],
        rule: Rule,
        rows: int,
        session_options,
        backend: str = "auto",
    ):
        self.trainable = list(trainable)
        self.data_inputs = list(data_inputs)
        self.rows = rows
        out = next(o for o in model.graph.output if o.name == loss)
        self.elem = out.type.tensor_type.elem_type
        self.dtype = np.dtype(helper.tensor_dtype_to_np_dtype(self.elem))
        inits = {init.name: init for init in model.graph.initializer}
        self.shapes = [tuple(inits[name].dims) for name in self.trainable]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        mask = np.concatenate(
            [
                np.full(size, name in penalised, self.dtype)
                for name, size in zip(trainable, self.sizes)
            ]
        )
        self.penalty = (rule.l2 or rule.l1) and bool(mask.any())
        static = onnx.ModelProto()
        static.CopyFrom(model)
        for value in static.graph.input:
            dims = value.type.tensor_type.shape.dim
            if value.name in self.data_inputs and dims:
                dims[0].Clear()
                dims[0].dim_value = rows
        gradient = gradient_model(static, loss, self.trainable, session_options, backend)
        self.source, self.reason = gradient.source, gradient.reason
        # The backward's seed (a constant 1) becomes the coefficient of the
        # gradient where it has the loss's type (the builder's is float32).
        self.seeded = gradient.seed is not None and gradient.seed_elem == self.elem
        self.flags = _Flags(
            rule.velocity,
            rule.nesterov,
            rule.l2 and self.penalty,
            rule.l1 and self.penalty,
            self.seeded,
            True,
        )
        self.model = self._loop_model(gradient.model, loss, gradient.seed, mask)
        self.session = training_session(
            self.model, session_options, "the epoch graph", reverse=self.source == ONNX_AD
        )

    # -- graph ------------------------------------------------------------------

    def _loop_model(self, built, loss, seed, mask) -> onnx.ModelProto:
        elem, flags = self.elem, self.flags
        scalars = _scalar_names(flags)
        weights, grads, velocity = f"{_P}weights", f"{_P}grads", f"{_P}velocity"
        body = onnx.GraphProto()
        body.CopyFrom(built.graph)
        body.name = "ortbridge_epoch_step"
        data = {v.name: v for v in body.input if v.name in self.data_inputs}
        nodes = [helper.make_node("Gather", [f"{_P}batches", f"{_P}i"], [f"{_P}batch"])]
        for name in self.data_inputs:
            nodes.append(helper.make_node("Gather", [f"{_P}all/{name}", f"{_P}batch"], [name]))
        # The weights: views of the flat state.
        pieces = [f"{_P}flat/{name}" for name in self.trainable]
        nodes.append(helper.make_node("Split", [weights, f"{_P}sizes"], pieces, axis=0))
        for name, piece in zip(self.trainable, pieces):
            nodes.append(helper.make_node("Reshape", [piece, f"{_P}shape/{name}"], [name]))
        consts = [
            numpy_helper.from_array(np.array(self.sizes, np.int64), f"{_P}sizes"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{_P}flat"),
        ]
        consts += [
            numpy_helper.from_array(np.array(shape, np.int64), f"{_P}shape/{name}")
            for name, shape in zip(self.trainable, self.shapes)
        ]
        for name in scalars:
            if name in _PER_BATCH:
                nodes.append(
                    helper.make_node("Gather", [f"{_P}all/{name}", f"{_P}i"], [f"{_P}{name}"])
                )
        if self.seeded:
            # The coefficient of the gradient becomes the gradient of the loss.
            coefficient = _scalar_names(flags._replace(unit_grad=False))[0]
            keep = [init for init in body.initializer if init.name != seed]
            del body.initializer[:]
            body.initializer.extend(keep)
            nodes.append(helper.make_node("Gather", [f"{_P}all/{coefficient}", f"{_P}i"], [seed]))
        nodes += list(body.node)
        flat_grads = [f"{_P}flat/{name}_grad" for name in self.trainable]
        for name, flat in zip(self.trainable, flat_grads):
            nodes.append(helper.make_node("Reshape", [f"{name}_grad", f"{_P}flat"], [flat]))
        nodes.append(helper.make_node("Concat", flat_grads, [grads], axis=0))
        # The update, on the flat vectors; the penalty reads the masked weights.
        penalised = weights
        if self.penalty and not mask.all():
            consts.append(numpy_helper.from_array(mask, f"{_P}mask"))
            nodes.append(helper.make_node("Mul", [weights, f"{_P}mask"], [f"{_P}penalised"]))
            penalised = f"{_P}penalised"
        rename = {"w0": weights, "g0": grads, "v0": velocity, penalised: penalised}
        rename.update(
            {f"k0_{n}": f"{_P}{n}" if n in _PER_BATCH else f"{_P}all/{n}" for n in scalars}
        )
        for nd in _update_nodes(0, 0, flags, penalised):
            nd.input[:] = [rename.get(s, f"{_P}{s}") for s in nd.input]
            nd.output[:] = [rename.get(s, f"{_P}{s}") for s in nd.output]
            nodes.append(nd)
        # The reported value: the batch's loss plus the penalty of its weights.
        value = loss
        if self.penalty:
            terms = []
            for op, part in (("ReduceL1", "l1"), ("ReduceSumSquare", "l2")):
                if getattr(flags, part):
                    nodes.append(helper.make_node(op, [penalised], [f"{_P}{part}"], keepdims=0))
                    nodes.append(
                        helper.make_node(
                            "Mul", [f"{_P}{part}", f"{_P}all/pen_{part}"], [f"{_P}pen_{part}"]
                        )
                    )
                    terms.append(f"{_P}pen_{part}")
            nodes.append(helper.make_node("Sum", [loss, *terms], [f"{_P}value"]))
            value = f"{_P}value"
        del body.node[:]
        body.node.extend(nodes)
        body.initializer.extend(consts)

        def info(name, shape, el=elem):
            return helper.make_tensor_value_info(name, el, shape)

        size = sum(self.sizes)
        carried = [weights] + ([velocity] if flags.velocity else [])
        carried_out = [f"{_P}w0_new"] + ([f"{_P}v0_new"] if flags.velocity else [])
        del body.input[:]
        body.input.extend(
            [info(f"{_P}i", [], TensorProto.INT64), info(f"{_P}cond", [], TensorProto.BOOL)]
            + [info(name, [size]) for name in carried]
        )
        del body.output[:]
        body.output.extend(
            [info(f"{_P}cond", [], TensorProto.BOOL)]
            + [info(name, [size]) for name in carried_out]
            + [info(value, [])]
        )
        merge_reshapes(body)  # the gradients' reshapes to flat read their sources
        # The outer graph: the epoch's data and coefficients, then the state.
        outer = [
            info(f"{_P}trips", [], TensorProto.INT64),
            info(f"{_P}batches", [None], TensorProto.INT64),
        ]
        for name in self.data_inputs:
            v = data[name]
            outer.append(info(f"{_P}all/{name}", [None, *_dims(v)], v.type.tensor_type.elem_type))
        outer += [info(f"{_P}all/{n}", [None] if n in _PER_BATCH else []) for n in scalars]
        if self.seeded:
            outer.append(info(f"{_P}all/{coefficient}", [None]))
        if self.penalty:
            outer += [info(f"{_P}all/pen_l1", []), info(f"{_P}all/pen_l2", [])]
        state_in = [f"{_P}in/{k}" for k in range(len(carried))]
        state_out = [f"{_P}out/{k}" for k in range(len(carried))]
        outer += [info(name, [size]) for name in state_in]
        loop = helper.make_node(
            "Loop", [f"{_P}trips", "", *state_in], [*state_out, f"{_P}values"], body=body
        )
        outputs = [info(name, [size]) for name in state_out] + [info(f"{_P}values", [None])]
        graph = helper.make_graph([loop], "ortbridge_epoch", outer, outputs)
        model = helper.make_model(graph, opset_imports=list(built.opset_import))
        model.ir_version = built.ir_version
        return fit_to_runtime(model)

    # -- running ------------------------------------------------------------

    def run(self, data, batches, sums, hyper: Hyper, state, trips=None):
        """Run the batches ``data[k][batches]`` (``sums``: their sample-weight sums).

        ``data`` are the model's data inputs shaped ``(number of batches,
        rows, ...)``; ``state`` the flat weights, then the flat velocities.
        Returns the new state and the value (loss plus penalty) of each batch
        run, the first ``trips`` of them if given.
        """
        a = 1.0 / np.asarray(sums, dtype=np.float64)
        alpha, l1_ratio = hyper.alpha, hyper.l1_ratio
        d = a * alpha * (1 - l1_ratio)
        e = a * alpha * l1_ratio
        coefficients = (a, d, e, -hyper.lr, 1.0, hyper.momentum)
        feeds = {
            f"{_P}trips": np.array(len(batches) if trips is None else trips, np.int64),
            f"{_P}batches": np.asarray(batches, np.int64),
        }
        for name, array in zip(self.data_inputs, data):
            feeds[f"{_P}all/{name}"] = array
        values = dict(zip(_scalar_names(self.flags), _scalar_values(self.flags, *coefficients)))
        if self.seeded:
            unseeded = self.flags._replace(unit_grad=False)
            name, value = next(
                zip(_scalar_names(unseeded), _scalar_values(unseeded, *coefficients))
            )
            feeds[f"{_P}all/{name}"] = np.asarray(value, self.dtype)
        for name, value in values.items():
            shape = np.shape(a) if name in _PER_BATCH else ()
            feeds[f"{_P}all/{name}"] = np.broadcast_to(np.asarray(value, self.dtype), shape).copy()
        if self.penalty:
            feeds[f"{_P}all/pen_l1"] = np.array(alpha * l1_ratio, self.dtype)
            feeds[f"{_P}all/pen_l2"] = np.array(0.5 * alpha * (1 - l1_ratio), self.dtype)
        for k, array in enumerate(state):
            feeds[f"{_P}in/{k}"] = array
        try:
            out = self.session.run(None, feeds)
        except Exception as exc:  # onnxruntime raises its own RuntimeError types
            raise translate(exc, "run the epoch graph") from exc
        return out[:-1], out[-1]
