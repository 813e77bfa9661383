"""How far a kernel's result may be from the float64 reference: one rule for the tests, the GPU
checks and the grader.

flash-attention's own tests set the rule: a correct kernel may add in another order (tiles of
any size, exp2 instead of exp, either loop order), so its error against a float64 reference may
be a few times the error of plain attention computed in the same dtype, plus a small floor for
the dtype (plain attention can be almost exact by luck on a small case):

    error(kernel) <= factor * error(plain attention in the same dtype) + floor(dtype)

with ``factor`` 2 for the output and 3 for the gradients (FORWARD, GRADIENT). The grader takes
the larger of the two terms instead of their sum (``floor_is_minimum=True``) and a factor of 4.
"""

from __future__ import annotations

# Smallest error allowed, by dtype: about 100 units in the last place of an output near 1
# (float64: far above rounding, far below any bug).
FLOOR = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
FORWARD = 2.0  # factor for the output O (and L)
GRADIENT = 3.0  # factor for dQ, dK, dV


def dtype_name(dtype) -> str:
    """'float32' for torch.float32, np.float32, np.dtype('float32') or 'float32'."""
    name = str(getattr(dtype, "name", None) or dtype)
    name = name.removeprefix("torch.")
    if name.startswith("<class 'numpy."):  # a NumPy scalar type: np.float32
        name = name[len("<class 'numpy."):-2]
    if name not in FLOOR:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(FLOOR)}")
    return name


def floor(dtype) -> float:
    """The smallest error allowed for results in ``dtype``."""
    return FLOOR[dtype_name(dtype)]


def allowed_error(dtype, baseline: float = 0.0, *, factor: float = FORWARD,
                  floor_scale: float = 1.0, floor_is_minimum: bool = False) -> float:
    """The largest error a correct kernel may have.

    ``baseline`` is the error of plain attention in the same dtype against the same reference
    (0 when there is none). The allowance is ``factor * baseline + floor_scale * floor(dtype)``,
    or with ``floor_is_minimum`` the larger of the two terms."""
    lowest = floor_scale * floor(dtype)
    if floor_is_minimum:
        return max(lowest, factor * baseline)
    return factor * baseline + lowest


def max_error(got, ref) -> float:
    """Largest absolute difference, computed in float64 (torch tensors or NumPy arrays)."""
    if hasattr(got, "detach"):
        return (got.detach().double() - ref.detach().double().to(got.device)).abs().max().item()
    import numpy as np

    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))))


def check(got, ref, plain, *, dtype=None, factor: float = FORWARD, floor_scale: float = 1.0,
          name: str = "output") -> tuple[float, float, float]:
    """(error, plain attention's error, allowed error) of ``got`` against the float64 ``ref``;
    raises AssertionError naming ``name`` when the error is over the allowance."""
    dtype = dtype if dtype is not None else got.dtype
    err, base = max_error(got, ref), max_error(plain, ref)
    limit = allowed_error(dtype, base, factor=factor, floor_scale=floor_scale)
    if not err <= limit:
        raise AssertionError(f"{name} error {err:.3g} > allowed {limit:.3g} "
                             f"(plain attention in {dtype_name(dtype)}: {base:.3g})")
    return err, base, limit
