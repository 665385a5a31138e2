"""The machinery of the fused SGD optimizers: one onnxruntime call a step.

:class:`_FusedSGD` is the :class:`torch.optim.Optimizer` under
:class:`._sgd.OrtSGD` and :class:`._sgd.SklearnSGD`. Its ``step()`` builds
(once per layout of the parameters, then cached) the graph of
:func:`._graphs._sgd_rule.build_update_graph` that takes every parameter, gradient
and velocity and computes the new ones, and runs it with an IOBinding whose
inputs and outputs are the tensors' own memory: onnxruntime writes the new
values in place, no tensor is copied and no parameter changes address.
Tensors are bound by address (the CPU memory that DLPack would share),
checked before every run: an OrtValue made through DLPack would keep each
step's gradients alive until the next one and costs more.

Writing an output into the memory of an input is safe here because every node
reading a parameter (or a velocity) is an ancestor of the node writing its new
value, and onnxruntime runs the nodes of a graph one after the other in
topological order; the tests check values and addresses.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from onnx import TensorProto

from .._runtime._errors import translate
from .._runtime._ort import capi, runtime
from .._runtime._sessions import make_session
from ..exceptions import OnnxInputError, OnnxTypeError
from ._graphs._sgd_rule import _Flags, _scalar_names, _scalar_values, build_update_graph

_ELEM = {torch.float32: TensorProto.FLOAT, torch.float64: TensorProto.DOUBLE}
_NP_DTYPE = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


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
        self.session = make_session(model, options, what="the optimizer's update graph")
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


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.numel(), t.stride()
