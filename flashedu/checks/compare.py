"""Compare a learner's arrays to the float64 reference, fairly.

The tolerance follows flash-attention's own tests: a correct kernel may sum in any order (either
loop order, exp2 instead of exp, any block sizes), so its error is allowed to be a few times the
error of plain (naive) attention computed in the same dtype, plus a small floor. A wrong kernel
misses by far more than that.

Errors are normalized elementwise as |x - ref| / (1 + |ref|): absolute for outputs near 1, relative
for large ones (L reaches hundreds when logits do).
"""

from __future__ import annotations

import math

import numpy as np

NAIVE_FACTOR = 4.0


def error(got, ref) -> float:
    """Largest normalized error; inf where the -inf entries differ or anything is NaN."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if np.isnan(got).any():
        return math.inf
    inf_ref, inf_got = np.isinf(ref), np.isinf(got)
    if (inf_ref != inf_got).any() or (got[inf_ref] != ref[inf_ref]).any():
        return math.inf
    finite = ~inf_ref
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(got[finite] - ref[finite]) / (1.0 + np.abs(ref[finite]))))


def tolerance(dtype, naive_in_dtype, ref, floor_scale: float = 1.0) -> float:
    """Allowed error for one output: NAIVE_FACTOR x the error of correct computations in this
    dtype (naive attention, or a list of correct variants: the worst of them), or the floor of
    this dtype (times ``floor_scale``), whichever is larger."""
    from ..tolerance import allowed_error

    candidates = naive_in_dtype if isinstance(naive_in_dtype, list) else [naive_in_dtype]
    errors = [error(c, ref) for c in candidates if c is not None]
    errors = [e for e in errors if math.isfinite(e)]
    return allowed_error(np.dtype(dtype), max(errors, default=0.0), factor=NAIVE_FACTOR,
                         floor_scale=floor_scale, floor_is_minimum=True)


def bad_rows(got, ref, tol) -> np.ndarray:
    """Indices of the rows (first axis) with an error above tol, or NaN."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - ref) / (1.0 + np.abs(ref))
        diff = np.where(np.isinf(ref) & (got == ref), 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    per_row = diff.reshape(diff.shape[0], -1).max(axis=1) if diff.ndim else diff.reshape(1)
    return np.flatnonzero(per_row > tol)


def describe_rows(rows: np.ndarray, n: int) -> str:
    """'rows 36..36 of 37' style summary of which rows are wrong."""
    if len(rows) == n:
        return f"all {n} rows"
    shown = ", ".join(str(r) for r in rows[:8]) + (", ..." if len(rows) > 8 else "")
    return f"{len(rows)} of {n} rows ({shown})"
