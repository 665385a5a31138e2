"""Stochastic gradient descent run by onnxruntime, every parameter in one call.

:class:`OrtSGD` follows :class:`torch.optim.SGD` and :class:`SklearnSGD`
scikit-learn's ``MLPRegressor``. Both are :class:`._fused_sgd._FusedSGD`,
whose ``step()`` runs one ONNX graph updating every parameter and velocity
in place, and differ only in the scalars they feed it. In the letters of
the rule (:mod:`._graphs._sgd_rule`), ``g' = a g + d w + e sign(w)``,
``v = mu v + c g'``, ``w = w + s v``: :class:`OrtSGD` has ``a = c = 1``,
``d = weight_decay``, ``e = 0``, ``s = -lr``; :class:`SklearnSGD` has
``a = 1 / batch``, ``d`` and ``e`` the elastic penalty divided by the batch,
``c = -lr``, ``s = 1``. The scalars are fed as graph inputs: changing a
group's ``lr`` (an LR scheduler) or the batch size never rebuilds the graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..exceptions import OnnxInputError
from ._fused_sgd import _FusedSGD
from ._graphs._sgd_rule import _Flags
from ._graphs._update import check_hyper


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
        check_hyper(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
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
        check_hyper(
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
        check_hyper(lr=lr, momentum=momentum, alpha=alpha)
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
        check_hyper(
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
