"""Exponent tags: what the units of one collective say about a parameter's exponents, in one int64.

Reproducible mode's reduce-scatter (``parts.partition.core.exact_grads``) sends, beside each
parameter's quantized grad, a tag per unit that is summed like the data: ``[1, k, k*k, nonfinite]``
with ``k = e / GRID + K_OFFSET`` (``k`` in ``[0, 128)`` for every exponent ``unit_exponent``
gives), or zeros for an all-zero grad. From the sums over the units every rank sees how many units
had a nonzero grad, whether one was not finite, and whether all had one exponent
(``units * sum(k*k) == sum(k) ** 2``, equality in Cauchy-Schwarz) and which.

Summed over at most ``world`` units, the four fields fit one int64 in bit fields of
``b = world.bit_length()``, ``b``, ``b + 7`` and ``b + 14`` bits while ``4 * b + 21 <= 63``
(a world below 1024); larger worlds send the four fields as four words. Pure arithmetic.
"""

from __future__ import annotations

from typing import Optional

from parts.base.fixed_point import GRID

K_OFFSET = 64
"""``k = e / GRID + K_OFFSET``: exponents lie in ``[-976, 960]``, so ``k`` in ``[3, 124]``."""
_K_BITS = 7


def _widths(world: int) -> Optional[list[int]]:
    """Bit widths of the fields ``[units, nonfinite, sum k, sum k*k]`` over ``world`` units, or None
    if they do not fit one int64."""
    b = max(1, world).bit_length()
    widths = [b, b, b + _K_BITS, b + 2 * _K_BITS]
    return widths if sum(widths) <= 63 else None


def tag_words(world: int) -> int:
    """int64 words per parameter in a collective over ``world`` units: 1, or 4 for a world of 1024 or more."""
    return 1 if _widths(world) else 4


def tag(exponent: Optional[int], nonfinite: bool, world: int) -> list[int]:
    """One unit's ``tag_words(world)`` words for a parameter quantized at ``exponent`` (None: all zeros)."""
    if exponent is None:
        fields = [0, int(nonfinite), 0, 0]
    else:
        k = exponent // GRID + K_OFFSET
        if exponent % GRID or not 0 <= k < 1 << _K_BITS:
            raise ValueError(f"tag: exponent {exponent} is not a multiple of {GRID} in [-976, 960]")
        fields = [1, 0, k, k * k]
    widths = _widths(world)
    if widths is None:
        return fields
    word, shift = 0, 0
    for value, width in zip(fields, widths):
        word, shift = word | value << shift, shift + width
    return [word]


def untag(words: list[int], world: int) -> tuple[int, bool, Optional[int]]:
    """``(units with a nonzero grad, any nonfinite, their one exponent or None if several or none)``
    from a parameter's tag words summed over at most ``world`` units."""
    widths = _widths(world)
    if widths is None:
        units, bad, first, second = words
    else:
        fields, word = [], words[0]
        for width in widths:
            fields.append(word & ((1 << width) - 1))
            word >>= width
        units, bad, first, second = fields
    one = units > 0 and units * second == first * first
    return units, bad > 0, (first // units - K_OFFSET) * GRID if one else None
