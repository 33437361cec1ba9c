"""How figures are written for people: cut to the digits shown, never rounded up."""

from __future__ import annotations

import math


def percent(fraction: float, digits: int = 2) -> str:
    """A fraction as a percentage cut (not rounded) to `digits` decimals: 0.94256 -> '94.25%'. The tiny
    allowance keeps an exact count such as 9,437 of 10,000 from reading as 94.36% (0.9437 * 1e4 is
    9436.999... in binary floating point)."""
    scale = 10 ** (digits + 2)
    return f"{math.floor(fraction * scale + 1e-6) / 10 ** digits:.{digits}f}%"


def rate(value: float) -> str:
    """A speed (examples or tokens a second) as a whole number cut, not rounded: 959.99 -> '959'."""
    return f"{math.floor(value + 1e-9):,}"
