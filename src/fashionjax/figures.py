"""How figures are written for people: cut to the digits shown, never rounded up."""

from __future__ import annotations

import math


def _cut(value: float, digits: int) -> float:
    """`value` cut (not rounded) to `digits` decimals. The tiny allowance keeps a value that binary
    floating point holds just under its decimal from losing a digit: an exact count such as 9,437 of
    10,000 is 94.36999... percent."""
    return math.floor(value * 10**digits + 1e-6) / 10**digits


def percent(fraction: float, digits: int = 2) -> str:
    """A fraction as a percentage cut to `digits` decimals: 0.94256 -> '94.25%'."""
    return f"{_cut(100 * fraction, digits):.{digits}f}%"


def points(spread: float, digits: int = 2) -> str:
    """A spread of fractions (a standard deviation of accuracies) in percentage points, cut like
    percent: 0.000573 -> '0.05'."""
    return f"{_cut(100 * spread, digits):.{digits}f}"


def tta_name(document: dict) -> str:
    """The test-time augmentation a summary's (or speedrun.json's) headline figure was scored with,
    when its "tta" is on; documents written before shifted views existed have no "tta_shift"."""
    shift = document.get("tta_shift", 0)
    return f"flip and {shift}-pixel shift TTA" if shift else "flip TTA"


def rate(value: float) -> str:
    """A speed (examples or tokens a second) as a whole number cut: 959.99 -> '959'."""
    return number(value)


def number(value: float, digits: int = 0) -> str:
    """A measured quantity (seconds, TFLOP, a speed) with thousands separators, cut toward zero to
    `digits` decimals: 137.2628 s -> '137.2', where rounding would print 137.3."""
    return f"{math.copysign(_cut(abs(value), digits), value):,.{digits}f}"
