"""Optimizer updates written as plain ONNX nodes, appended to a gradient graph.

Each optimizer reads the weights, their gradients ``<weight>_grad`` (the names
both gradient sources of :mod:`._gradient` give them) and its own state as graph inputs,
and writes the next weights and next state as graph outputs, so that one
onnxruntime call runs forward, backward and update. The formulas are torch's:

- ``sgd`` (``torch.optim.SGD``, ``dampening=0``)::

      g = grad + weight_decay * w
      buf = momentum * buf + g                        (only when momentum > 0)
      g = g + momentum * buf if nesterov else buf
      w = w - lr * g

- ``adamw`` (``torch.optim.AdamW``, ``amsgrad=False``)::

      t = t + 1
      w = w * (1 - lr * weight_decay)
      m = beta1 * m + (1 - beta1) * grad
      v = beta2 * v + (1 - beta2) * grad**2
      w = w - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

Only standard ai.onnx operators are used (Add, Sub, Mul, Div, Sqrt, Pow),
valid from opset 7 on, so the update runs in any opset the model uses.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
from onnx import helper

from ortbridge._prepare import _onnx_utils
from ortbridge._prepare._onnx_utils import NodeBuilder
from ortbridge.exceptions import OnnxInputError

#: Optimizers and their hyperparameters with torch's defaults.
OPTIMIZERS = {
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    "sgd": {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
}
#: Name of the learning-rate input of the training graph.
LEARNING_RATE = "optim/learning_rate"


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """A tensor the training graph reads as ``input`` and writes back as ``output``.

    ``weight`` names the trained weight the slot belongs to (None for the
    step counter); ``kind`` is ``"weight"``, an optimizer state name or
    ``"step"``.
    """

    kind: str
    weight: str | None
    input: str
    output: str
    shape: tuple


def optimizer_options(optimizer: str, options: dict | None) -> dict:
    """torch's defaults for ``optimizer`` updated with ``options``, checked."""
    if optimizer not in OPTIMIZERS:
        raise OnnxInputError(
            f"optimizer={optimizer!r} is not supported: expected one of {sorted(OPTIMIZERS)}"
        )
    merged = dict(OPTIMIZERS[optimizer])
    unknown = set(options or {}) - set(merged)
    if unknown:
        raise OnnxInputError(
            f"optimizer_params {sorted(unknown)} are not options of {optimizer!r}: "
            f"expected some of {sorted(merged)}"
        )
    merged.update(options or {})
    # torch.optim refuses each of these in its constructor.
    check_hyper(
        where="optimizer_params: ",
        **{k: merged[k] for k in ("eps", "weight_decay", "momentum") if k in merged},
    )
    if "betas" in merged:
        betas = merged["betas"]
        if not (
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(non_negative(b) and b < 1 for b in betas)
        ):
            raise OnnxInputError(
                f"optimizer_params: betas must be two numbers in [0, 1), got {betas!r}"
            )
    if optimizer == "sgd":
        check_hyper(
            where="optimizer_params: ", nesterov=merged["nesterov"], momentum=merged["momentum"]
        )
    return merged


def check_learning_rate(value) -> float:
    """``value`` as a float, refused unless finite and >= 0 (as torch.optim does)."""
    if not non_negative(value):
        raise OnnxInputError(f"learning_rate must be a finite number >= 0, got {value!r}")
    return float(value)


def non_negative(value) -> bool:
    """A finite real number >= 0 (a bool is not one), as torch.optim accepts."""
    number = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(
        value, bool
    )
    return number and math.isfinite(value) and value >= 0


def check_hyper(*, where: str = "", nesterov: bool = False, **values) -> None:
    """Refuse a hyper-parameter torch.optim refuses: each of ``values`` must be a
    finite number >= 0, and Nesterov momentum needs a momentum > 0. ``where``
    prefixes the message (the parameter group, ``optimizer_params``)."""
    for name, value in values.items():
        if not non_negative(value):
            raise OnnxInputError(f"{where}{name} must be a finite number >= 0, got {value!r}")
    if nesterov and values["momentum"] <= 0:
        raise OnnxInputError(
            f"{where}nesterov=True needs momentum > 0, got momentum={values['momentum']}"
        )


def append_update(graph, weights: dict, dtype, optimizer: str, options: dict) -> list[StateSlot]:
    """Append the update of ``weights`` (name -> shape) to ``graph``.

    ``graph`` must hold the weights as inputs and their gradients as values
    named ``<weight>_grad``. Returns every state slot, weights first; the
    caller declares slot inputs and outputs (:func:`declare_slots`).
    """
    counter = itertools.count(1)
    builder = NodeBuilder(
        _onnx_utils.elem_type(dtype), lambda base: f"{base}_{next(counter)}", "optim/"
    )
    lr = LEARNING_RATE
    slots = [
        StateSlot("weight", name, name, f"optim/{name}/updated", tuple(shape))
        for name, shape in weights.items()
    ]
    if optimizer == "sgd":
        slots += _sgd(builder, lr, weights, options)
    else:
        slots += _adamw(builder, lr, weights, options)
    graph.node.extend(builder.nodes)
    return slots


def _sgd(b, lr, weights, options) -> list[StateSlot]:
    momentum, wd = options["momentum"], options["weight_decay"]
    slots = []
    for name, shape in weights.items():
        grad = f"{name}_grad"
        if wd:
            grad = b.op("Add", grad, b.op("Mul", name, b.const(wd)))
        if momentum:
            buf = StateSlot("momentum_buffer", name, f"optim/{name}/momentum_buffer", "", shape)
            buf_next = b.op("Add", b.op("Mul", buf.input, b.const(momentum)), grad)
            slots.append(dataclasses.replace(buf, output=buf_next))
            if options["nesterov"]:
                grad = b.op("Add", grad, b.op("Mul", buf_next, b.const(momentum)))
            else:
                grad = buf_next
        b.op("Sub", name, b.op("Mul", grad, lr), out=f"optim/{name}/updated")
    return slots


def _adamw(b, lr, weights, options) -> list[StateSlot]:
    beta1, beta2 = options["betas"]
    eps, wd = options["eps"], options["weight_decay"]
    step = StateSlot("step", None, "optim/step", "optim/step/updated", ())
    one = b.const(1.0)
    t = b.op("Add", step.input, one, out=step.output)
    # Scalars shared by every weight, computed once per step.
    step_size = b.op("Div", lr, b.op("Sub", one, b.op("Pow", b.const(beta1), t)))
    bias2_sqrt = b.op("Sqrt", b.op("Sub", one, b.op("Pow", b.const(beta2), t)))
    decay = b.op("Sub", one, b.op("Mul", lr, b.const(wd))) if wd else None
    slots = [step]
    for name, shape in weights.items():
        grad = f"{name}_grad"
        m = StateSlot("exp_avg", name, f"optim/{name}/exp_avg", "", shape)
        v = StateSlot("exp_avg_sq", name, f"optim/{name}/exp_avg_sq", "", shape)
        m_next = b.op(
            "Add", b.op("Mul", m.input, b.const(beta1)), b.op("Mul", grad, b.const(1 - beta1))
        )
        square = b.op("Mul", grad, grad)
        v_next = b.op(
            "Add", b.op("Mul", v.input, b.const(beta2)), b.op("Mul", square, b.const(1 - beta2))
        )
        denom = b.op("Add", b.op("Div", b.op("Sqrt", v_next), bias2_sqrt), b.const(eps))
        decayed = b.op("Mul", name, decay) if decay else name
        step_ = b.op("Mul", b.op("Div", m_next, denom), step_size)
        b.op("Sub", decayed, step_, out=f"optim/{name}/updated")
        slots += [dataclasses.replace(m, output=m_next), dataclasses.replace(v, output=v_next)]
    return slots


def declare_slots(graph, slots: list[StateSlot], elem_type: int) -> None:
    """Add the learning rate and the slots' inputs to ``graph``, and their outputs."""
    graph.input.append(helper.make_tensor_value_info(LEARNING_RATE, elem_type, []))
    for slot in slots:
        if slot.kind != "weight":  # weights are graph inputs already
            graph.input.append(helper.make_tensor_value_info(slot.input, elem_type, slot.shape))
        graph.output.append(helper.make_tensor_value_info(slot.output, elem_type, slot.shape))
