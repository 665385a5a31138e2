"""Stochastic gradient descent run by onnxruntime, every parameter in one call.

:class:`OrtSGD` is a :class:`torch.optim.Optimizer` whose ``step()`` builds
(once per layout of the parameters, then cached) one ONNX graph that takes
every parameter, gradient and velocity and computes the new ones, and runs it
with an IOBinding whose inputs and outputs are the tensors' own memory:
onnxruntime writes the new values in place, no tensor is copied and no
parameter changes address. Tensors are bound by address (the CPU memory that
DLPack would share), checked before every run: an OrtValue made through DLPack
would keep each step's gradients alive until the next one and costs more.

Both conventions of the project are one family of graphs with different
scalar inputs. With ``g`` the gradient, a group's update is::

    g' = a g + d w + e sign(w)
    v  = mu v + c g'                       (with momentum)
    w  = w + s v            or, Nesterov:  w = w + s (mu v + c g')
    w  = w + s c g'                        (without momentum)

computed in torch.optim.SGD's order of operations (so that float32 rounds the
same way), leaving out the multiplications by a coefficient that is always 1.

:class:`OrtSGD` follows :class:`torch.optim.SGD` (``a = c = 1``,
``d = weight_decay``, ``e = 0``, ``s = -lr``); :class:`SklearnSGD` follows
scikit-learn's ``MLPRegressor`` (``a = 1 / batch``, ``d`` and ``e`` the
elastic penalty divided by the batch, ``c = -lr``, ``s = 1``). The scalars are
fed as graph inputs: changing a group's ``lr`` (an LR scheduler) or the batch
size never rebuilds the graph.

Writing an output into the memory of an input is safe here because every node
reading a parameter (or a velocity) is an ancestor of the node writing its new
value, and onnxruntime runs the nodes of a graph one after the other in
topological order; the tests check values and addresses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
from onnx import TensorProto, helper

from .._onnx_utils import make_model
from .._ort import capi, runtime
from .._ort_errors import translate
from ..exceptions import OnnxInputError, OnnxTypeError

_ELEM = {torch.float32: TensorProto.FLOAT, torch.float64: TensorProto.DOUBLE}
_NP_DTYPE = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


class _Flags(NamedTuple):
    """What the update of a group computes (part of the graph's cache key)."""

    velocity: bool
    nesterov: bool
    l2: bool
    l1: bool
    #: The gradient's coefficient (``c a`` with a velocity, ``a`` without) is 1.
    unit_grad: bool
    #: ``s`` is 1.
    unit_step: bool


@functools.cache
def _scalar_names(flags: _Flags) -> tuple[str, ...]:
    """Names of the scalar inputs a group's update multiplies by."""
    if flags.velocity:
        names = [] if flags.unit_grad else ["ca"]
        names += ["cd"] if flags.l2 else []
        names += ["ce"] if flags.l1 else []
        names += ["mu"]
        return (*names, *([] if flags.unit_step else ["s"]))
    if flags.l2 or flags.l1:
        names = [] if flags.unit_grad else ["a"]
        names += ["d"] if flags.l2 else []
        names += ["e"] if flags.l1 else []
        return (*names, "sc")
    return () if flags.unit_grad and flags.unit_step else ("ka",)


def _scalar_values(flags: _Flags, a, d, e, c, s, mu) -> list[float]:
    """The scalars of :func:`_scalar_names` from the coefficients of the rule."""
    values = {"ca": c * a, "cd": c * d, "ce": c * e, "mu": mu, "s": s,
              "a": a, "d": d, "e": e, "sc": s * c, "ka": s * c * a}  # fmt: skip
    return [values[name] for name in _scalar_names(flags)]


def _update_nodes(i, k, flags, penalised=None):
    """Nodes updating parameter ``i`` with the scalars of set ``k``.

    The operations are torch.optim.SGD's, in its order, so that float32
    results round the same way; a multiplication by a coefficient that is
    always 1 is left out. The penalty terms read ``penalised`` (the
    parameter by default).
    """
    w, g, v = f"w{i}", f"g{i}", f"v{i}"
    pw = penalised or w

    def sc(name):
        return f"k{k}_{name}"

    def t(name):
        return f"t{i}_{name}"

    nodes = []
    add = nodes.append
    make = helper.make_node
    if not (flags.velocity or flags.l2 or flags.l1):
        if flags.unit_grad and flags.unit_step:
            add(make("Add", [w, g], [f"w{i}_new"]))
        else:
            add(make("Mul", [sc("ka"), g], [t("step")]))
            add(make("Add", [w, t("step")], [f"w{i}_new"]))
        return nodes
    # The gradient with its penalty terms, times c when there is a velocity.
    pre = "c" if flags.velocity else ""
    grad = g
    if not flags.unit_grad:
        add(make("Mul", [sc(f"{pre}a"), g], [t("ga")]))
        grad = t("ga")
    if flags.l2:
        add(make("Mul", [sc(f"{pre}d"), pw], [t("dw")]))
        add(make("Add", [grad, t("dw")], [t("g_l2")]))
        grad = t("g_l2")
    if flags.l1:
        add(make("Sign", [pw], [t("sign")]))
        add(make("Mul", [sc(f"{pre}e"), t("sign")], [t("ew")]))
        add(make("Add", [grad, t("ew")], [t("g_l1")]))
        grad = t("g_l1")
    if not flags.velocity:
        add(make("Mul", [sc("sc"), grad], [t("step")]))
        add(make("Add", [w, t("step")], [f"w{i}_new"]))
        return nodes
    # v is read (mu v) before v_new, written into v's memory, is computed.
    add(make("Mul", [sc("mu"), v], [t("mv")]))
    add(make("Add", [t("mv"), grad], [f"v{i}_new"]))
    step = f"v{i}_new"
    if flags.nesterov:
        add(make("Mul", [sc("mu"), f"v{i}_new"], [t("mvn")]))
        add(make("Add", [t("mvn"), grad], [t("nesterov")]))
        step = t("nesterov")
    if not flags.unit_step:
        add(make("Mul", [sc("s"), step], [t("step")]))
        step = t("step")
    add(make("Add", [w, step], [f"w{i}_new"]))
    return nodes


def build_update_graph(layout):
    """The ONNX model updating a layout of parameters.

    ``layout`` is a tuple ``(sets, params)``: ``sets`` lists ``(elem_type,
    flags)`` for each set of scalars (a parameter group and a dtype), ``params``
    ``(set index, rank)`` of each parameter (a 0-d parameter is bound as 1-D).
    Inputs are the scalars ``k<set>_<name>`` (shape ``(1,)``), then ``w<i>``,
    ``g<i>`` and, with momentum, ``v<i>`` for each parameter; outputs are
    ``w<i>_new`` and ``v<i>_new``.
    """
    sets, params = layout
    inputs, outputs, nodes = [], [], []
    for k, (elem, flags) in enumerate(sets):
        for name in _scalar_names(flags):
            inputs.append(helper.make_tensor_value_info(f"k{k}_{name}", elem, [1]))
    for i, (k, rank) in enumerate(params):
        elem, flags = sets[k]
        shape = [f"n{i}_{axis}" for axis in range(rank)]
        names = ["w", "g"] + (["v"] if flags.velocity else [])
        for name in names:
            inputs.append(helper.make_tensor_value_info(f"{name}{i}", elem, shape))
        outputs.append(helper.make_tensor_value_info(f"w{i}_new", elem, shape))
        if flags.velocity:
            outputs.append(helper.make_tensor_value_info(f"v{i}_new", elem, shape))
        nodes += _update_nodes(i, k, flags)
    graph = helper.make_graph(nodes, "ortbridge_sgd", inputs, outputs)
    return make_model(graph)


class _Update:
    """A session running one layout, and its binding to the tensors' memory."""

    def __init__(self, layout):
        ort = runtime()  # standard operators only: any onnxruntime runs them
        model = build_update_graph(layout)
        options = ort.SessionOptions()
        # Elementwise work on small tensors: one thread, and no spinning against
        # torch's own thread pool.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        self.run_options = capi().RunOptions()
        sets, params = layout
        C = capi()
        self.binding = C.SessionIOBinding(self.session._sess)
        self.device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        # The numpy views keep the scalar buffers (bound by address) alive.
        self.scalars = []
        for k, (elem, flags) in enumerate(sets):
            dtype = torch.float32 if elem == TensorProto.FLOAT else torch.float64
            names = _scalar_names(flags)
            buffer = torch.zeros(len(names), dtype=dtype)
            for j, name in enumerate(names):
                self.bind(f"k{k}_{name}", buffer[j : j + 1])
            self.scalars.append(buffer.numpy())
        self.forget()

    def forget(self):
        """Forget what is bound: the next step binds every tensor again."""
        self.bound_w, self.bound_g, self.bound_v = {}, {}, {}

    def bind(self, name, tensor, output=None):
        # Bound by address: the caller checks before every run that each name
        # still points to its tensor's memory (same address, same shape), so a
        # tensor freed and replaced by another at the same address is harmless.
        shape = list(tensor.shape) or [1]  # 0-d times a (1,) scalar is (1,)
        dtype = _NP_DTYPE[tensor.dtype]
        ptr = tensor.data_ptr()
        self.binding.bind_input(name, self.device, dtype, shape, ptr)
        if output is not None:
            self.binding.bind_output(output, self.device, dtype, shape, ptr)

    def run(self):
        try:
            self.session._sess.run_with_iobinding(self.binding, self.run_options)
        except Exception as exc:  # onnxruntime raises its own RuntimeError types
            raise translate(exc, "run the SGD update graph") from exc


class _Plan(NamedTuple):
    """What one step does, reused while the same parameters have gradients."""

    key: tuple
    update: _Update
    #: (index, parameter, group index, position in group, its state or None)
    entries: list
    #: (flags, group) of each set of scalars, in the update's order.
    set_groups: list
    #: ``optimizer.state`` when the plan was made (``load_state_dict`` replaces it).
    state: dict


class _FusedSGD(torch.optim.Optimizer):
    """Machinery shared by :class:`OrtSGD` and :class:`SklearnSGD`."""

    #: Key of the velocity in ``self.state[p]``.
    _velocity_key = "momentum_buffer"

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        self._updates = {}
        self._plan = None

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_updates", None)
        state.pop("_plan", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._updates = {}
        self._plan = None

    def _flags(self, group) -> _Flags:
        raise NotImplementedError

    def _coefficients(self, group) -> tuple[float, float, float, float, float, float]:
        """``(a, d, e, c, s, mu)`` of the update rule of the module docstring."""
        raise NotImplementedError

    def _check_group(self, group, gi) -> None:
        """Check a group's hyperparameters when a plan is made."""

    def _make_plan(self, key, flags):
        sets, set_index, entries, layout_params = [], {}, [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                elem = _ELEM.get(p.dtype)
                if elem is None or p.device.type != "cpu":
                    raise OnnxTypeError(
                        f"parameter {pi} of group {gi} is a {p.dtype} tensor on {p.device}: "
                        f"{type(self).__name__} updates float32 and float64 CPU tensors"
                    )
                if (gi, elem) not in set_index:
                    set_index[gi, elem] = len(sets)
                    sets.append((elem, flags[gi], group))
                pstate = self.state[p] if flags[gi].velocity else None
                entries.append((len(entries), p, gi, pi, pstate))
                layout_params.append((set_index[gi, elem], max(p.dim(), 1)))
        layout = (tuple((elem, fl) for elem, fl, _ in sets), tuple(layout_params))
        update = self._updates.get(layout)
        if update is None:
            update = self._updates[layout] = _Update(layout)
        else:
            update.forget()  # another plan may have bound other tensors
        set_groups = [(fl, group) for _, fl, group in sets]
        return _Plan(key, update, entries, set_groups, self.state)

    def _check_grad(self, grad, gi, pi):
        # torch itself keeps a gradient's shape, dtype and device those of its
        # parameter.
        if grad.is_sparse:
            raise OnnxTypeError(
                f"parameter {pi} of group {gi} has a sparse gradient: "
                f"{type(self).__name__} needs dense gradients"
            )
        return grad if grad.is_contiguous() else grad.contiguous()

    def _new_velocity(self, p, gi, pi):
        state = self.state[p]
        velocity = state.get(self._velocity_key)
        if velocity is None:
            velocity = state[self._velocity_key] = torch.zeros_like(
                p, memory_format=torch.contiguous_format
            )
        elif not velocity.is_contiguous() or velocity.shape != p.shape:
            raise OnnxInputError(
                f"the velocity of parameter {pi} of group {gi} has shape "
                f"{tuple(velocity.shape)} (contiguous: {velocity.is_contiguous()}), "
                f"expected a contiguous tensor of shape {tuple(p.shape)}"
            )
        return velocity

    def _step(self):
        """One update of every parameter that has a gradient (no closure, no hooks)."""
        groups = self.param_groups
        # As torch reads them at step(): a value changed since the plan was made
        # (a scheduler, param_groups edited by hand) is checked before use.
        for gi, group in enumerate(groups):
            self._check_group(group, gi)
        flags = tuple([self._flags(group) for group in groups])
        with_grad = [id(p) for group in groups for p in group["params"] if p.grad is not None]
        if not with_grad:
            return
        plan = self._plan
        if plan is None or plan.key != (flags, with_grad) or plan.state is not self.state:
            plan = self._plan = self._make_plan((flags, with_grad), flags)
        update = plan.update
        for (fl, group), scalars in zip(plan.set_groups, update.scalars):
            scalars[:] = _scalar_values(fl, *self._coefficients(group))
        bound_w, bound_g, bound_v = update.bound_w, update.bound_g, update.bound_v
        velocity_key = self._velocity_key
        touched = []
        for i, p, gi, pi, pstate in plan.entries:
            # Bound by address and layout: rebind when a tensor's memory, size or
            # strides changed (a view of the same memory reads differently).
            key = _layout(p)
            if bound_w.get(i) != key:
                if not p.is_contiguous():
                    raise OnnxInputError(
                        f"parameter {pi} of group {gi} (shape {tuple(p.shape)}) is not "
                        "contiguous: onnxruntime reads contiguous memory only"
                    )
                update.bind(f"w{i}", p, f"w{i}_new")
                bound_w[i] = key
            grad = p.grad
            key = _layout(grad)
            if bound_g.get(i) != key:
                bound = self._check_grad(grad, gi, pi)
                update.bind(f"g{i}", bound)
                if bound is not grad:
                    # A contiguous copy: alive until the run, never reused after.
                    touched.append(bound)
                bound_g[i] = key if bound is grad else None
            touched.append(p)
            if pstate is not None:
                velocity = pstate.get(velocity_key)
                key = None if velocity is None else _layout(velocity)
                if key is None or bound_v.get(i) != key:
                    velocity = self._new_velocity(p, gi, pi)
                    update.bind(f"v{i}", velocity, f"v{i}_new")
                    bound_v[i] = _layout(velocity)
                touched.append(velocity)
        update.run()
        # onnxruntime wrote into the tensors' memory behind autograd's back.
        torch.autograd.graph.increment_version(touched)
        del touched  # the contiguous copies of gradients, if any, go here

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient, in one onnxruntime call.

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss.

        Returns
        -------
        The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss


class OrtSGD(_FusedSGD):
    """Stochastic gradient descent, as :class:`torch.optim.SGD`, run by onnxruntime.

    ``step()`` updates every parameter (and momentum buffer) in one onnxruntime
    call on a graph built once per layout of parameters, writing in place into
    the parameters' own memory. The update rule and the state are
    :class:`torch.optim.SGD`'s (``state[p]["momentum_buffer"]``, no
    dampening), so the two can be swapped, LR schedulers included.

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups (dicts), float32 or float64 CPU tensors.
    lr : float
        Learning rate.
    momentum : float, default 0
        Momentum factor.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0``).
    weight_decay : float, default 0
        L2 penalty added to the gradient, ``g + weight_decay * w``.

    Examples
    --------
    >>> import torch
    >>> from ortbridge.training import OrtSGD
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = OrtSGD([w], lr=0.1, momentum=0.9)
    >>> (w * w).sum().backward()
    >>> opt.step()
    >>> w.detach().tolist()
    [0.800000011920929, 0.800000011920929, 0.800000011920929]
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        _check_hyper(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        # dampening=0 and maximize=False: torch.optim.SGD reads them from a
        # state dict saved by OrtSGD.
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "dampening": 0.0,
            "maximize": False,
        }
        super().__init__(params, defaults)

    def _check_group(self, group, gi):
        _check_hyper(
            lr=group["lr"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
            nesterov=group["nesterov"],
            where=f"param_groups[{gi}]: ",
        )
        # A state dict of torch.optim.SGD may carry options OrtSGD lacks.
        if group.get("dampening", 0) or group.get("maximize", False):
            raise OnnxInputError(
                f"group {gi} has dampening={group.get('dampening', 0)} and maximize="
                f"{group.get('maximize', False)}: OrtSGD supports dampening=0, maximize=False"
            )

    def _flags(self, group):
        momentum = group["momentum"] != 0
        return _Flags(momentum, momentum and bool(group["nesterov"]),
                      group["weight_decay"] != 0, False, True, False)  # fmt: skip

    def _coefficients(self, group):
        lr = float(group["lr"])
        return 1.0, float(group["weight_decay"]), 0.0, 1.0, -lr, float(group["momentum"])


class SklearnSGD(_FusedSGD):
    """SGD with scikit-learn's conventions (``MLPRegressor``), run by onnxruntime.

    The gradients are those of a loss summed over the batch; ``step(grad_scale=...)``
    divides them by the batch size (or the sum of its sample weights), adds the
    elastic penalty ``alpha * (l1_ratio * |w|_1 + (1 - l1_ratio) / 2 * |w|^2)``
    of the groups where ``alpha > 0``, divided likewise, then updates
    ``v = momentum * v - lr * g; w += v`` (Nesterov: ``w += momentum * v - lr * g``).
    Velocities are in ``state[p]["velocity"]``.

    Examples
    --------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = SklearnSGD([w], lr=0.5, momentum=0.0)
    >>> w.grad = torch.tensor([2.0, 4.0])  # summed over a batch of two rows
    >>> opt.step(grad_scale=0.5)
    >>> w.detach().tolist()
    [0.5, 0.0]
    """

    _velocity_key = "velocity"

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = True,
        alpha: float = 0.0,
        l1_ratio: float = 0.0,
    ):
        _check_hyper(lr=lr, momentum=momentum, alpha=alpha)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "alpha": alpha,
            "l1_ratio": l1_ratio,
        }
        super().__init__(params, defaults)
        self.grad_scale = 1.0

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("grad_scale", 1.0)

    def _check_group(self, group, gi):
        _check_hyper(
            lr=group["lr"],
            momentum=group["momentum"],
            alpha=group["alpha"],
            where=f"param_groups[{gi}]: ",
        )
        if not 0 <= group["l1_ratio"] <= 1:
            raise OnnxInputError(f"l1_ratio must be in [0, 1], got {group['l1_ratio']}")

    def _flags(self, group):
        momentum = group["momentum"] != 0
        alpha, l1_ratio = group["alpha"] != 0, group["l1_ratio"]
        return _Flags(momentum, momentum and bool(group["nesterov"]),
                      alpha and l1_ratio != 1, alpha and l1_ratio != 0, False, True)  # fmt: skip

    def _coefficients(self, group):
        a = float(self.grad_scale)
        alpha, l1_ratio = float(group["alpha"]), float(group["l1_ratio"])
        d = a * alpha * (1 - l1_ratio)
        e = a * alpha * l1_ratio
        return a, d, e, -float(group["lr"]), 1.0, float(group["momentum"])

    def step(self, closure=None, *, grad_scale: float | None = None):
        """Update the parameters; ``grad_scale`` multiplies the summed gradients."""
        if grad_scale is not None:
            self.grad_scale = grad_scale
        return super().step(closure)

    def _step(self, grad_scale: float | None = None):
        if grad_scale is not None:
            self.grad_scale = grad_scale
        super()._step()


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.numel(), t.stride()


def _check_hyper(*, nesterov=False, where="", **values):
    for name, value in values.items():
        number = isinstance(value, (int, float, np.floating, np.integer))
        if not (number and math.isfinite(value) and value >= 0):
            raise OnnxInputError(f"{where}{name} must be a finite number >= 0, got {value!r}")
    if nesterov and values["momentum"] <= 0:
        raise OnnxInputError(f"nesterov=True needs momentum > 0, got momentum={values['momentum']}")
