"""The ``OnnxModule`` against onnxruntime inference: outputs, and gradients by finite differences.

:func:`_verify` runs the module at given inputs, compares its outputs and
takes its gradients for a cotangent; :func:`_finite_differences` checks them
element by element, kinks included (the package docstring has the rules).
``ortbridge.gradcheck`` uses the same check on a user's module.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from ._cases import _REFUSALS, _first_line, _Refused


@dataclasses.dataclass
class _Tolerance:
    rtol: float
    atol: float
    step: float
    eps: float


_TOLERANCES = {
    "float64": _Tolerance(rtol=1e-4, atol=1e-6, step=1e-6, eps=float(np.finfo(np.float64).eps)),
    "float32": _Tolerance(rtol=1e-2, atol=5e-4, step=1e-3, eps=float(np.finfo(np.float32).eps)),
}


#: Output elements this large are saturated stand-ins for infinity (a masked
#: attention score): like infinite ones, they get a zero cotangent.
_SATURATED = 1e30


@dataclasses.dataclass
class _Check:
    checked: int = 0
    max_error: float = 0.0
    grad_max: float = 0.0
    #: Largest absolute and relative (to the finite difference) disagreement.
    abs_error: float = 0.0
    rel_error: float = 0.0
    failure: str | None = None
    #: The failure is certain: in the outputs, or where the function is
    #: differentiable (else the point may be a kink or a discontinuity).
    certain: bool = False


def _verify(layer, session, names, values, seeded, cotangents, picks, tol, expected) -> _Check:
    """The module's outputs and gradients at ``values`` against onnxruntime inference."""
    import torch

    reference = session.run(None, dict(zip(names, values)))
    inputs = [torch.from_numpy(np.array(v, copy=True)).requires_grad_() for v in values]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = layer(*inputs)
    except _REFUSALS() as exc:
        raise _Refused(_first_line(exc, 600)) from None
    out = list(out) if isinstance(out, tuple) else [out]
    got = [o.detach().numpy() for o in out]
    for i, (g, want) in enumerate(zip(got, reference)):
        if _close(g, want, tol.rtol, tol.atol):
            continue
        # onnxruntime's kernel may differ from the spec where the engine does
        # not (a masked score as -inf or as float32's lowest): onnx's own
        # expected output decides then.
        if expected is not None and i < len(expected) and _close(g, expected[i], 1e-3, 1e-5):
            continue
        name = layer.output_names[i]
        return _Check(
            failure=f"output {name!r} differs from onnxruntime inference: {_diff(g, want)}",
            certain=True,
        )
    # Infinite or saturated outputs have no derivative: no cotangent there.
    weights = []
    for i, r in zip(seeded, cotangents):
        keep = _regular(reference[i]) & _regular(got[i])
        weights.append(np.where(keep, r, 0.0))
    pairs = [(out[i], w) for i, w in zip(seeded, weights) if out[i].requires_grad]
    grads = [None] * len(inputs)
    if pairs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad(
                [t for t, _ in pairs],
                inputs,
                [torch.from_numpy(w).to(t.dtype) for t, w in pairs],
                allow_unused=True,
            )
    grads = [
        np.zeros(v.shape) if g is None else g.detach().numpy().astype(np.float64)
        for g, v in zip(grads, values)
    ]
    for name, g, v in zip(names, grads, values):
        if g.shape != v.shape:
            return _Check(
                failure=f"the gradient of {name!r} has shape {g.shape} instead of {v.shape}",
                certain=True,
            )
    return _finite_differences(
        session, names, values, seeded, weights, reference, picks, grads, tol
    )


def _regular(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.isfinite(a) & (np.abs(a) < _SATURATED)


def _finite_differences(session, names, values, seeded, weights, base, picks, grads, tol):
    """Central finite differences of ``sum(out_i * w_i)`` against the module's gradients."""
    check = _Check()
    feeds = dict(zip(names, values))

    def derivative(name, value, j, step):
        """Central, left and right differences and their rounding noise at element j."""
        flat = value.reshape(-1)
        x = flat[j]
        h = step * max(1.0, abs(float(x)))
        plus, minus = flat.copy(), flat.copy()
        plus[j] = x + h
        minus[j] = x - h
        d_plus, d_minus = float(plus[j]) - float(x), float(x) - float(minus[j])
        out_p = session.run(None, {**feeds, name: plus.reshape(value.shape)})
        out_m = session.run(None, {**feeds, name: minus.reshape(value.shape)})
        right = _directional(out_p, base, seeded, weights) / d_plus
        left = _directional(base, out_m, seeded, weights) / d_minus
        central = (right * d_plus + left * d_minus) / (d_plus + d_minus)
        noise = _rounding(out_p, out_m, base, seeded, weights, tol.eps) / min(d_plus, d_minus)
        return central, left, right, noise

    for name, value, pick, grad in zip(names, values, picks, grads):
        for j in pick:
            x = float(value.reshape(-1)[j])
            if not np.isfinite(x):
                continue
            central, left, right, noise = derivative(name, value, j, tol.step)
            if not (np.isfinite(right) and np.isfinite(left)):
                continue
            got = float(grad.reshape(-1)[j])
            allowed = tol.atol + tol.rtol * abs(central) + 4 * noise
            check.checked += 1
            check.grad_max = max(check.grad_max, abs(central))
            error = abs(got - central)
            check.abs_error = max(check.abs_error, error)
            check.rel_error = max(check.rel_error, error / max(abs(central), tol.atol))
            if error <= allowed:
                check.max_error = max(check.max_error, error / allowed)
                continue
            # A kink: left and right derivatives differ, any value between them is a subgradient.
            kink = abs(right - left) > allowed
            if kink and min(left, right) - allowed <= got <= max(left, right) + allowed:
                continue
            # Is the function differentiable here? Then a quarter of the step
            # gives the same derivative, and a disagreement is certain.
            quarter, left4, right4, noise4 = derivative(name, value, j, tol.step / 4)
            allowed4 = tol.atol + tol.rtol * abs(central) + 4 * (noise + noise4)
            smooth = not kink and abs(quarter - central) <= allowed4
            smooth = smooth and abs(right4 - left4) <= allowed4
            check.failure = (
                f"{name}[{j}] (x={x:.6g}): gradient {got:.8g}, finite differences "
                f"{central:.8g} (one-sided {left:.6g} / {right:.6g}; at a quarter of the step "
                f"{quarter:.6g}), tolerance {allowed:.3g}"
            )
            check.certain = smooth
            return check
    return check


def _directional(after, before, seeded, weights) -> float:
    """``sum_i w_i * (after_i - before_i)``, differences taken elementwise (no cancellation)."""
    total = 0.0
    for i, w in zip(seeded, weights):
        a, b = np.asarray(after[i]), np.asarray(before[i])
        if a.shape != b.shape:
            return math.nan
        d = _delta(a, b)
        with np.errstate(invalid="ignore"):
            total += float(np.sum(np.where(w != 0.0, d * w, 0.0)))
    return total


def _rounding(out_p, out_m, base, seeded, weights, eps) -> float:
    """Rounding noise of a loss difference: eps times the terms that changed."""
    total = 0.0
    for i, w in zip(seeded, weights):
        p = np.asarray(out_p[i], dtype=np.float64)
        m = np.asarray(out_m[i], dtype=np.float64)
        b = np.asarray(base[i], dtype=np.float64)
        if p.shape != m.shape or p.shape != b.shape:
            continue
        moved = ((p != b) | (m != b)) & (w != 0.0)
        if moved.any():
            with np.errstate(invalid="ignore", over="ignore"):
                terms = np.abs(w) * (np.abs(p) + np.abs(m) + np.abs(b))
            total += float(np.nansum(terms[moved]))
    return total * eps


def _pick(size: int, samples: int, rng) -> np.ndarray:
    if size <= samples:
        return np.arange(size)
    return np.sort(rng.choice(size, samples, replace=False))


def _perturb(value: np.ndarray, rng) -> np.ndarray:
    """``value`` moved by 1-2% (at least 0.005-0.01): well beyond any finite-difference step."""
    size = rng.uniform(0.5, 1.0, value.shape) * rng.choice([-1.0, 1.0], value.shape)
    noise = size * 2e-2 * (np.abs(value) + 0.5)
    with np.errstate(invalid="ignore"):
        moved = np.where(np.isfinite(value), value + noise, value)
    return moved.astype(value.dtype)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def _close(got, want, rtol: float, atol: float) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if got.dtype.kind not in "fc" or want.dtype.kind not in "fc":
        return bool(np.array_equal(got, want))
    got, want = got.astype(np.float64), want.astype(np.float64)
    # Saturated values of one sign are equal: -inf, float32's and float64's lowest.
    with np.errstate(invalid="ignore"):
        saturated = (np.abs(got) >= _SATURATED) & (np.abs(want) >= _SATURATED)
        saturated &= np.sign(got) == np.sign(want)
    got, want = np.where(saturated, 0.0, got), np.where(saturated, 0.0, want)
    regular = want[np.isfinite(want)]
    scale = np.max(np.abs(regular), initial=0.0)
    return bool(np.allclose(got, want, rtol=rtol, atol=atol * (1 + scale), equal_nan=True))


def _diff(got, want) -> str:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} instead of {want.shape}"
    if got.dtype.kind not in "fc":
        return f"{int(np.sum(got != want))} element(s) differ"
    err = _delta(got, want)
    where = int(np.nanargmax(np.abs(err))) if np.isfinite(err).any() else 0
    return (
        f"max abs difference {np.nanmax(np.abs(err)):.3g} (element {where}: "
        f"{got.reshape(-1)[where]:.6g} instead of {want.reshape(-1)[where]:.6g})"
    )


def _delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a - b`` with equal entries (equal infinities included) giving 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(a == b, 0.0, a.astype(np.float64) - b.astype(np.float64))
