"""``OnnxModule``: an ONNX graph as a trainable ``torch.nn.Module``.

One public class whose methods are its API, a thin shell over plain code:
checking a call against the graph (:mod:`._call_checks`), where the weights
live in the module tree (:mod:`._module_weights`), the prepared graph and its
engine (:mod:`._bridge`). ``OnnxModule`` and ``OnnxWeights`` stay here, where
pickles find them.
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from . import _engines, _prepare, _torch_op
from ._bridge import Bridge
from ._call_checks import (
    TORCH_DTYPES,
    bind,
    check_input,
    check_shared_dims,
    check_weights,
    shape_str,
    shared_dims,
    torch_dtype,
)
from ._function import function_name, make_function
from ._module_weights import (
    attribute_path,
    choose_trainable,
    fetch,
    weight_array,
    weights_repr,
)
from ._prepare._call_ranks import CallShapesNeeded
from ._prepare._onnx_utils import ancestors, node_reads
from ._prepare.quantized import float_model
from .exceptions import NotDifferentiableError, OnnxInputError

if TYPE_CHECKING:  # onnxruntime is imported when a session is made, not before
    import onnxruntime

_BATCH_NORM_MODES = ("track", "frozen")
#: Op types ``print(module)`` lists, the most frequent first.
_SHOWN_OP_TYPES = 10
_CPU = torch.device("cpu")
# torch >= 2.3; before it, torch.compile traces the layer (and warns).
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def _is_fake(args, kwargs) -> bool:
    """Whether a call's tensors are fake ones (``torch.export``'s tracing).

    On every call: plain tensors are told apart by their type alone.
    """
    for t in (*args, *kwargs.values()) if kwargs else args:
        if type(t) is not torch.Tensor and isinstance(t, torch.Tensor) and is_fake(t):
            return True
    return False


def _before(exc: NotDifferentiableError, chosen: set[str], model: onnx.ModelProto) -> set[str]:
    """The weights among ``chosen`` that the node ``exc`` refuses reads, directly
    or through the nodes before it: their gradient would cross it."""
    node = next((n for n in model.graph.node if exc.node and n.name == exc.node), None)
    if node is None:
        return set()
    producer = {out: n for n in model.graph.node for out in n.output}
    found, _ = ancestors(producer, node_reads(node))
    return found & chosen


def _warn_frozen(why: str, exc: NotDifferentiableError, names: set[str]) -> None:
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    warnings.warn(
        f"node {exc.node!r} (op type {exc.op_type}) has no gradient here: the "
        f"{len(names)} weights before it stay frozen buffers ({shown}); the weights after "
        f"it train. Pass trainable= to choose, or train the float model it came from "
        f"({why})",
        stacklevel=4,
    )


class OnnxModule(nn.Module):
    """An ONNX graph as a ``torch.nn.Module`` whose weights torch trains.

    Forward and backward run in onnxruntime, by one of two engines (see
    ``backend``); tensors are shared with torch through DLPack. Float initializers become
    ``nn.Parameter`` (trainable) or buffers (frozen), named after the
    initializer (``"fc.weight"`` becomes submodule ``fc``, parameter
    ``weight``, so a state dict of the torch model the graph was exported
    from loads as it is).

    Parameters
    ----------
    model : str, os.PathLike, bytes or onnx.ModelProto
        The ONNX model.
    trainable : None, iterable of str, or callable
        Which float initializers (and weights held in ``Constant`` nodes)
        become parameters. None: the weights a gradient can reach, by their
        role (layers' weights and biases, other tensors of more than one
        element; epsilons, round exponents and such constants of the function,
        BatchNorm running statistics stay buffers). An iterable of names, or
        a callable ``(name, numpy_array) -> bool``.
    providers : list, optional
        onnxruntime execution providers; default: CPU, or CUDA for a module
        on a CUDA device.
    session_options : onnxruntime.SessionOptions, optional
        Replaces the default options (no spinning intra-op threads, as many
        threads as ``torch.get_num_threads()``).
    batch_norm : {"track", "frozen"}
        ``"track"`` (default) behaves like torch's BatchNorm: batch
        statistics and running-statistics updates in train mode. ``"frozen"``
        uses the running statistics in train mode too (affine weights still
        train).
    backend : {"auto", "training-agent", "onnxruntime"}
        The engine that computes gradients. ``"training-agent"``:
        onnxruntime-training 1.19.2's gradient builder and TrainingAgent.
        ``"onnxruntime"``: gradient graphs ortbridge builds from standard ops
        (onnx-ad's reverse mode), run as two inference sessions by any
        onnxruntime; it differentiates more operators and supports double
        backward. ``"auto"`` (default): the onnxruntime engine, and the
        training agent (where the training build is installed) for a graph
        the onnxruntime engine refuses. :attr:`backend` tells which runs.
    dtype : torch.dtype, optional
        Master weights: a file's float16 weights are held (and
        trained) as this dtype, ``torch.float32`` typically, and cast to the
        file's type at each call; the graph still computes in the file's
        precision and ``save()`` writes that. Then torch's ``GradScaler``
        and mixed-precision recipes apply as to a float16 torch layer. A
        bfloat16 file computes in float32 (onnxruntime's CPU provider has
        no bfloat16 kernels for most ops); its weights are held as
        ``torch.bfloat16`` unless ``dtype`` says otherwise, its bfloat16
        inputs and outputs are taken and returned as such, and ``save()``
        writes bfloat16.

    Examples
    --------
    >>> import torch, ortbridge
    >>> from ortbridge.examples import linear_model
    >>> layer = ortbridge.OnnxModule(linear_model(3, 2))
    >>> y = layer(torch.ones(4, 3))
    >>> y.sum().backward()
    >>> [name for name, _ in layer.named_onnx_parameters()]
    ['weight', 'bias']
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        trainable: None | Iterable[str] | Callable[[str, np.ndarray], bool] = None,
        *,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        session_options: onnxruntime.SessionOptions | None = None,
        batch_norm: str = "track",
        backend: str = "auto",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if backend not in _engines.BACKENDS:
            raise OnnxInputError(
                f"backend must be one of {list(_engines.BACKENDS)}, got {backend!r}"
            )
        if batch_norm not in _BATCH_NORM_MODES:
            raise OnnxInputError(
                f"batch_norm must be one of {_BATCH_NORM_MODES}, got {batch_norm!r}"
            )
        original = _prepare.load_model(model)
        prepared = _prepare.normalize(_prepare.load_model(original))
        summary = _prepare.summarize(prepared, original)
        # A bfloat16 file computes in float32 (normalize): the module holds
        # its weights in bfloat16 and takes and returns bfloat16 where it does.
        half_inputs, half_outputs, half_weights = _prepare.bfloat16_names(original)
        self._original = original
        self._summary = summary
        self._batch_norm = batch_norm
        self._providers = providers
        self._session_options = session_options
        self._backend = backend
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise OnnxInputError(f"dtype must be a floating torch dtype, got {dtype!r}")
        if half_weights and dtype is None:
            dtype = torch.bfloat16
        self._master_dtype = dtype
        self._bfloat16_io = (
            [i for i, s in enumerate(summary.inputs) if s.name in half_inputs],
            [i for i, s in enumerate(summary.outputs) if s.name in half_outputs],
        )
        chosen = choose_trainable(trainable, summary, prepared)
        self._onnx_names: dict[str, tuple[str, ...]] = {}
        for name, array in summary.float_initializers.items():
            tensor = torch.from_numpy(np.array(array, copy=True))
            if dtype is not None and (tensor.dtype == torch.float16 or name in half_weights):
                tensor = tensor.to(dtype)
            self._register_weight(name, tensor, name in chosen)
        self._weight_names = list(summary.float_initializers)
        self._build_bridge(prepared)
        if chosen:
            self._check_trainable(chosen, trainable is None)

    # -- construction --------------------------------------------------------

    def _register_weight(self, name: str, tensor: torch.Tensor, trainable: bool) -> None:
        path = attribute_path(self, name)
        owner = self
        for part in path[:-1]:
            child = owner._modules.get(part)
            if child is None:
                child = OnnxWeights()
                owner.add_module(part, child)
            owner = child
        if trainable:
            owner.register_parameter(path[-1], nn.Parameter(tensor))
        else:
            owner.register_buffer(path[-1], tensor)
        self._onnx_names[name] = path

    def _build_bridge(self, prepared: onnx.ModelProto | None = None) -> None:
        # Expected dtypes, computed once: forward checks every call against them.
        self._input_dtypes = [torch_dtype(spec) for spec in self._summary.inputs]
        floats = self._summary.float_initializers
        self._weight_dtypes = [TORCH_DTYPES.get(floats[n].dtype.str) for n in self._weight_names]
        self._weight_shapes = [floats[n].shape for n in self._weight_names]
        self._shared_dims = shared_dims(self._summary.inputs)
        self._bridge = Bridge(
            prepared if prepared is not None else self._summary_model(),
            [s.name for s in self._summary.inputs],
            self._weight_names,
            frozen_batch_norm=self._batch_norm == "frozen",
            providers=self._providers,
            session_options=self._session_options,
            backend=self.__dict__.get("_backend", "auto"),
            zero_gradient=self._summary.zero_gradient,
        )
        self.function = make_function(function_name(self._original), self._summary.name)
        self._op_key = _torch_op.register(self._bridge, self.function.__name__)

    def _summary_model(self) -> onnx.ModelProto:
        return _prepare.normalize(_prepare.load_model(self._original))

    def _check_trainable(self, chosen: set[str], default: bool) -> None:
        """Build the training graph now, so a graph that cannot train fails here."""
        device = self._device()
        prepared = None  # the normalised graph, made once where a refusal needs it
        while True:
            needs = [False] * len(self._summary.inputs) + [n in chosen for n in self._weight_names]
            try:
                feeds = [None] * len(self._summary.inputs) + self._weights()
                self._bridge.gradient_graph(_prepare.TRAIN, needs, device, feeds)
                return
            except CallShapesNeeded:
                return  # only a call's inputs tell what the graph needs: checked then
            except NotDifferentiableError as exc:
                if not default:
                    raise
                # The static analysis may miss a path the builder knows to be
                # dead: by default such weights simply stay frozen. Behind a
                # node no engine differentiates, the default trains what lies
                # after it and names what stays frozen before it.
                names = {exc.unreachable} & chosen
                if not names and self._backend != "training-agent":
                    # (the agent's refusals name the engine that trains the node)
                    if prepared is None:
                        prepared = self._summary_model()
                    names = _before(exc, chosen, prepared)
                if not names:
                    raise
                if exc.unreachable not in names:
                    # Under auto after a fallback both engines refused: the
                    # first one's reason names what it does not decompose.
                    bridge = self._bridge
                    why = f"{exc.reason}; {bridge.engine_reason}" if bridge.fell_back else str(exc)
                    _warn_frozen(why, exc, names)
                for name in names:
                    chosen.discard(name)
                    self._freeze(name)

    def _freeze(self, name: str) -> None:
        path = self._onnx_names[name]
        owner = self._owner(path)
        tensor = owner._parameters.pop(path[-1]).detach()
        owner.register_buffer(path[-1], tensor)

    def _owner(self, path) -> nn.Module:
        owner = self
        for part in path[:-1]:
            owner = owner._modules[part]
        return owner

    # -- public API ----------------------------------------------------------

    @property
    def backend(self) -> str:
        """The engine that differentiates the graph: ``"training-agent"`` or ``"onnxruntime"``.

        Under ``backend="auto"`` it may change once, from the onnxruntime
        engine to the training agent, when the onnxruntime engine refuses a
        gradient graph first built at a forward (before the graph runs: a
        call is never run twice).
        """
        return self._bridge.engine

    @property
    def backend_reason(self) -> str:
        """Why :attr:`backend` runs the graph, in words."""
        return self._bridge.engine_reason

    @property
    def input_names(self) -> list[str]:
        """Names of the graph inputs, in call order."""
        return [s.name for s in self._summary.inputs]

    @property
    def output_names(self) -> list[str]:
        """Names of the graph outputs, in return order."""
        return [s.name for s in self._summary.outputs]

    def onnx_weight(self, name: str) -> torch.Tensor:
        """The parameter or buffer holding initializer ``name``."""
        try:
            path = self._onnx_names[name]
        except KeyError:
            raise OnnxInputError(
                f"no float initializer named {name!r}; known: {sorted(self._onnx_names)}"
            ) from None
        owner = self._owner(path)
        return getattr(owner, path[-1])

    def named_onnx_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Yield ``(onnx_initializer_name, parameter)`` for the trainable weights."""
        for name in self._weight_names:
            tensor = self.onnx_weight(name)
            if isinstance(tensor, nn.Parameter):
                yield name, tensor

    def to_onnx(self, quantized: bool = True) -> onnx.ModelProto:
        """The original model with the current weights in its initializers.

        A quantized file comes back in its own form, the trained weights
        rounded to its integers. ``quantized=False`` writes its float model
        instead: the float weights read directly, each activation's
        quantization a ``Clip`` to its range (what to quantize again with
        one's own calibration). For a float file both are the same.
        """
        changed = {}
        for name in self._weight_names:
            value = weight_array(self.onnx_weight(name))
            if not np.array_equal(value, self._summary.float_initializers[name]):
                changed[name] = value
        source = self._original if quantized else float_model(self._original)
        return _prepare.with_weights(source, changed)

    def save(self, path: str | os.PathLike, quantized: bool = True) -> None:
        """Write :meth:`to_onnx` to ``path`` (``quantized``: as there)."""
        onnx.save(self.to_onnx(quantized=quantized), os.fspath(path))

    def extra_repr(self) -> str:
        """What ``print(module)`` shows: graph, inputs, outputs, engine, nodes, weights."""
        lines = [f"graph: {self._summary.name!r}, engine: {self._bridge.engine}"]
        halves = self.__dict__.get("_bfloat16_io") or ((), ())
        listed = (("inputs", self._summary.inputs), ("outputs", self._summary.outputs))
        for (kind, specs), half in zip(listed, halves):
            shown = ", ".join(f"{s.name} {_spec_str(s, i in half)}" for i, s in enumerate(specs))
            lines.append(f"{kind}: {shown or 'none'}")
        counts = collections.Counter(node.op_type for node in self._original.graph.node)
        ops = [f"{op} x{n}" for op, n in counts.most_common(_SHOWN_OP_TYPES)]
        if len(counts) > _SHOWN_OP_TYPES:
            ops.append(f"{len(counts) - _SHOWN_OP_TYPES} more op types")
        lines.append("nodes: " + ", ".join(ops))
        n_train = sum(1 for _ in self.named_onnx_parameters())
        lines.append(f"trainable: {n_train} of {len(self._weight_names)} float initializers")
        held = [n for n in self._weight_names if n in self._summary.from_constants]
        if held:
            names = ", ".join(held[:_SHOWN_OP_TYPES]) + (
                ", ..." if len(held) > _SHOWN_OP_TYPES else ""
            )
            lines.append(f"held in Constant nodes of the file: {len(held)} ({names})")
        # Weights held by the module itself (names without a dot): no child shows them.
        own = weights_repr(self)
        return "\n".join(lines + [own] if own else lines)

    # -- running -------------------------------------------------------------

    def _device(self) -> torch.device:
        for name in self._weight_names:
            return self.onnx_weight(name).device
        return torch.device("cpu")

    def _weights(self) -> list[torch.Tensor]:
        # Owners are looked up once (walking the dotted path costs more than
        # the onnxruntime call on a small graph). A parametrized weight is no
        # longer in _parameters: getattr computes it.
        # The owner's parameter dict is read at each call: torch.export swaps
        # it for one of fake tensors while it traces, then puts a copy back.
        slots = self.__dict__.get("_weight_slots")
        if slots is None:
            slots = []
            for n in self._weight_names:
                owner = self._owner(self._onnx_names[n])
                slots.append((owner, self._onnx_names[n][-1]))
            self.__dict__["_weight_slots"] = slots
        return [
            p if (p := owner._parameters.get(attr)) is not None else fetch(owner, attr)
            for owner, attr in slots
        ]

    def forward(
        self, *args: torch.Tensor, **kwargs: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the graph on inputs in graph-input order, or as keywords named after them.

        One output gives a tensor, several a tuple.
        """
        if _is_compiling() or torch.jit.is_tracing() or _is_fake(args, kwargs):
            # torch.compile, torch.export and torch.jit see the layer as one torch operator.
            return self._run(args, kwargs, traced=True)
        return self._run(args, kwargs)

    def _run(self, args, kwargs, traced: bool = False):
        specs = self._summary.inputs
        inputs = bind(specs, self._summary.name, args, kwargs)
        half_inputs, half_outputs = self.__dict__.get("_bfloat16_io") or ((), ())
        for i in half_inputs:  # the graph computes them in float32
            if inputs[i].dtype == torch.bfloat16:
                inputs[i] = inputs[i].float()
        # Traced, the plain lookup: Dynamo reads the cached slots' walrus poorly.
        weights = [self.onnx_weight(n) for n in self._weight_names] if traced else self._weights()
        if self.__dict__.get("_master_dtype") is not None:  # to the file's precision
            weights = [
                w.to(d) if d is not None and w.dtype != d else w
                for w, d in zip(weights, self._weight_dtypes)
            ]
        check_weights(self._weight_names, self._weight_dtypes, self._weight_shapes, weights)
        # A graph with neither weights nor inputs (constants only) runs on the CPU.
        device = weights[0].device if weights else inputs[0].device if inputs else _CPU
        inputs = [
            check_input(spec, dtype, t, device)
            for spec, dtype, t in zip(specs, self._input_dtypes, inputs)
        ]
        if self._shared_dims:
            check_shared_dims(specs, self._shared_dims, inputs)
        tensors = inputs + weights
        mode = _prepare.TRAIN if self.training else _prepare.EVAL
        if traced:
            outputs = _torch_op.call(self._op_key, self._bridge, mode, tensors)
        elif torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            outputs = self.function.apply(self._bridge, mode, *tensors)
        else:
            outputs = self._bridge.run_inference(mode, tensors, device)
        if half_outputs:
            outputs = list(outputs)
            for i in half_outputs:
                outputs[i] = outputs[i].to(torch.bfloat16)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's BatchNorm state dicts hold ``num_batches_tracked``, which the
        # exported graph never uses: drop it so they load as they are.
        for name in self._weight_names:
            path = self._onnx_names[name]
            if path[-1] == "running_mean":
                owner = self._owner(path)
                if "num_batches_tracked" not in owner._buffers:
                    key = prefix + ".".join(path[:-1] + ("num_batches_tracked",))
                    state_dict.pop(key, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- pickling / copying: onnxruntime sessions are rebuilt, not copied ----

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_original"] = self._original.SerializeToString()
        state.pop("_bridge", None)
        state.pop("function", None)
        state.pop("_weight_slots", None)
        if state["_session_options"] is not None:
            state["_session_options"] = _options_state(state["_session_options"])
        return state

    def __setstate__(self, state):
        original = onnx.ModelProto()
        original.ParseFromString(state["_original"])
        state["_original"] = original
        if state["_session_options"] is not None:
            state["_session_options"] = _options_from_state(*state["_session_options"])
        self.__dict__.update(state)
        self._build_bridge()


class OnnxWeights(nn.Module):
    """Holds the weights of initializers named like ``"fc.weight"`` (here ``fc``).

    Prints them as torch's layers print their settings:
    ``OnnxWeights(weight: (10, 5), bias: (10,))``, a frozen weight (a buffer)
    marked ``frozen``.
    """

    def extra_repr(self) -> str:
        return weights_repr(self)


def _options_state(options) -> tuple:
    """onnxruntime.SessionOptions cannot be pickled: keep its settable properties.

    Session config entries (``add_session_config_entry``) cannot be listed, so
    a copy does not carry them.
    """
    cls = type(options)
    names = [
        n
        for n in dir(cls)
        if isinstance(getattr(cls, n), property) and getattr(cls, n).fset is not None
    ]
    return cls, {n: getattr(options, n) for n in names}


def _options_from_state(cls, values):
    options = cls()
    for name, value in values.items():
        setattr(options, name, value)
    return options


def _spec_str(spec, bfloat16: bool = False) -> str:
    try:
        dtype = "bfloat16 (computed in float32)" if bfloat16 else str(spec.dtype)
    except (KeyError, TypeError, ValueError):  # not a tensor (a sequence, a map)
        dtype = "?"
    shape = "(unknown shape)" if spec.shape is None else shape_str(spec.shape)
    return f"{dtype} {shape}"
