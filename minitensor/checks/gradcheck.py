"""Finite-difference gradient checking in float64, after Chainer's check_backward.

For a function y = f(inputs, params) and a fixed random upstream gradient dy, the scalar
L = sum(y * dy) has dL/da = what backward returns (inputs) or accumulates (params) when fed dy.
Each entry is compared with the fourth-order central difference
(-L(a + 2h) + 8 L(a + h) - 8 L(a - h) + L(a - 2h)) / 12h, whose O(h^4) truncation error lets h be
large (1e-4), which keeps float64 rounding noise (~1e-16 |L| / h) near 1e-12. For large
tensors, `directions=k` compares k random directional derivatives <g, u> instead of every entry.

    report = check_gradients(forward, backward, inputs={"x": x}, params={"W": (W, dW)}, dy=dy)
    assert report.max_rel_error < 1e-6, report

forward() reads the arrays in place (perturbations are written into them and restored), returns
y; backward(dy) returns a dict {input name: gradient} and accumulates into the param gradients.
"""

from dataclasses import dataclass, field

import numpy as np

from minitensor.device import array_module, to_numpy


@dataclass
class Mismatch:
    name: str
    index: tuple  # an entry, or ("direction", k) in directional mode
    analytic: float
    numeric: float
    abs_error: float
    rel_error: float


@dataclass
class GradReport:
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    worst: Mismatch | None = None
    checked: dict = field(default_factory=dict)  # name -> number of comparisons

    def __str__(self):
        w = self.worst
        where = f" at {w.name}{list(w.index)}: analytic {w.analytic:.6e} vs numeric {w.numeric:.6e}" if w else ""
        return f"max abs error {self.max_abs_error:.3e}, max rel error {self.max_rel_error:.3e}{where}"


def _scalar(y, dy):
    xp = array_module(y)
    if np.isscalar(y) or getattr(y, "ndim", 1) == 0:
        return float(to_numpy(y)) * float(to_numpy(dy))
    return float(to_numpy(xp.sum(y * dy)))


def check_gradients(forward, backward, inputs, params, dy, eps=1e-4, directions=None, floor=1e-3, atol=1e-8, seed=0):
    """Compares backward's gradients with central differences; returns a GradReport.

    inputs: {name: array} whose gradient backward returns; params: {name: (array, grad_array)}
    whose gradient backward accumulates (zeroed here first).
    rel error = |a - n| / max(|a|, |n|, floor * max|g|, atol), max|g| over all analytic gradients: an
    entry whose true gradient is ~0 is judged against a thousandth of the largest gradient,
    since float64 differences of L carry ~1e-12 |L| of rounding noise. A wrong backward is off by
    the order of the gradient itself, far above that.
    """
    for _, g in params.values():
        g[...] = 0
    analytic = dict(backward(dy))
    for name, (_, g) in params.items():
        analytic[name] = g.copy()
    arrays = {**inputs, **{n: a for n, (a, _) in params.items()}}
    missing = set(arrays) - set(analytic)
    if missing:
        raise ValueError(f"backward returned no gradient for {sorted(missing)}")

    rng = np.random.default_rng(seed)
    report = GradReport()
    biggest = max((float(np.abs(to_numpy(analytic[n])).max(initial=0.0)) for n in arrays), default=0.0)
    scale = max(floor * biggest, atol)
    for name, a in arrays.items():
        if a.dtype != np.float64:
            raise TypeError(f"gradient checks run in float64; {name} is {a.dtype}")
        g = to_numpy(analytic[name]).reshape(a.shape)
        if directions is None:
            probes = [(np.unravel_index(i, a.shape), None) for i in range(a.size)]
        else:
            probes = [(("direction", k), rng.standard_normal(a.shape)) for k in range(directions)]
        for index, u in probes:
            numeric = _central_difference(forward, a, index, u, dy, eps)
            exact = float(g[index]) if u is None else float(np.sum(g * u))
            _record(report, name, index, exact, numeric, scale)
        report.checked[name] = len(probes)
    return report


def _central_difference(forward, a, index, u, dy, eps):
    """dL/da along one entry e (u is None) or along a direction u, by a 4th-order central difference."""
    xp = array_module(a)
    direction = None if u is None else xp.asarray(u)
    saved = a[index].copy() if u is None else a.copy()
    values = {}
    for k in (2, 1, -1, -2):
        if u is None:
            a[index] = saved + k * eps
        else:
            a[...] = saved + (k * eps) * direction
        values[k] = _scalar(forward(), dy)
    a[index if u is None else ...] = saved
    return (-values[2] + 8 * values[1] - 8 * values[-1] + values[-2]) / (12 * eps)


def _record(report, name, index, exact, numeric, scale):
    abs_err = abs(exact - numeric)
    rel_err = abs_err / max(abs(exact), abs(numeric), scale)
    if rel_err > report.max_rel_error or report.worst is None:
        report.worst = Mismatch(name, tuple(int(i) if not isinstance(i, str) else i for i in index),
                                exact, numeric, abs_err, rel_err)
    report.max_abs_error = max(report.max_abs_error, abs_err)
    report.max_rel_error = max(report.max_rel_error, rel_err)
