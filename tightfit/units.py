"""Memory sizes: parse what users write ("4GiB", "11GB", "512MiB") into bytes, and format bytes.

Inside tightfit every size is an ``int`` of bytes; GiB appear only when displaying.
"""

from __future__ import annotations

import math

import re
from decimal import Decimal

from .errors import TightfitError

# IEC (binary) and SI (decimal) units, as in IEC 80000-13. "GB" is decimal on purpose:
# a card sold as "11 GB" is written that way by users, and the difference is 7%.
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
# 4, 3.5, .5, 1e9, 2.5E9 (an exponent: how bytes are often written, as in 4e9)
_SIZE_RE = re.compile(r"^\s*([+-]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

GiB = 2**30
MiB = 2**20
# The largest unit-less --budget read as GiB or GB forgotten: 1024 (1 TiB), past any card's memory.
_MAX_MEANT_GIB = 1024


# A fraction of a byte from here on is whole bytes mistyped (4294967296.5), not GiB without a unit
# (4.5): the hint then names the whole bytes, not a size of billions of GiB.
_WHOLE_BYTES_HINT = 1024


def parse_size(text: str | int | float) -> int:
    """Parse a memory size into bytes.

    Args:
        text: e.g. ``"4GiB"``, ``"11GB"``, ``"3.5 GiB"``, ``".5GiB"``, ``"512MiB"``, ``"2048"`` or ``"2.5e9"``
            (bytes; an exponent reads as ``float`` does, and the bytes must be whole),
            or a number of bytes (an int, or a float holding a whole number such as ``4e9``).
            Bare ``K/M/G/T`` are binary (as in ``nvidia-smi``'s MiB).

    Returns:
        The size in bytes (int; a fraction of a unit is rounded down to whole bytes).

    Raises:
        TightfitError: not a number followed by a known unit; zero, negative, inf or NaN (also a size
            past a float, ``"1e999"``); a fraction of a byte (``4.5``, ``"4.5"`` or ``"1.5e0"`` without a unit).
    """
    if isinstance(text, bool):
        raise TightfitError(f"cannot read memory size {text!r}: write a number and a unit, e.g. 4GiB, 11GB, 512MiB")
    if isinstance(text, (int, float)):
        if isinstance(text, float) and not math.isfinite(text):
            raise TightfitError(f"memory size must be a finite number of bytes, got {text!r}")
        if text <= 0:
            raise TightfitError(f"memory size must be positive, got {text!r}")
        if isinstance(text, float) and not text.is_integer():
            raise TightfitError(f"memory size {text!r} is a fraction of a byte: give whole bytes, "
                                + (f"e.g. {int(text)}" if text >= _WHOLE_BYTES_HINT else
                                   f"or a string with a unit, e.g. \"{text:g}GiB\""))
        return int(text)
    m = _SIZE_RE.match(str(text))
    if m and len(m.group(2)) == 2 and m.group(2)[0].isupper() and m.group(2)[1] == "b":  # 4Gb, 512Mb: bits
        raise TightfitError(f"cannot read memory size {text!r}: a lower-case b is bits; write bytes, e.g. "
                            f"{m.group(1)}{m.group(2)[:-1].upper()}B or {m.group(1)}{m.group(2)[:-1].upper()}iB")
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise TightfitError(
            f"cannot read memory size {text!r}: write a number and a unit, e.g. 4GiB, 11GB, 512MiB")
    number = float(m.group(1))
    if not math.isfinite(number * _UNITS[unit]):  # 1e999, or 400 digits: past a float, int() would raise
        raise TightfitError(f"memory size must be a finite number of bytes, got {text!r}")
    if number <= 0:
        rounded = number == 0 and Decimal(m.group(1)) != 0  # 1e-400: no 0 as written, but a float holds it as one
        raise TightfitError(f"memory size must be positive, got {text!r}" + (" (it rounds to 0)" if rounded else ""))
    if _UNITS[unit] == 1 and not number.is_integer():
        raise TightfitError(f"memory size {text!r} is a fraction of a byte: "
                            + (f"give whole bytes, e.g. {int(number)}" if number >= _WHOLE_BYTES_HINT else
                               f"write a unit, e.g. {_as_written(m.group(1))}GiB"))
    value = int(number * _UNITS[unit])
    if value <= 0:
        raise TightfitError(f"memory size must be positive, got {text!r}")
    return value


def _as_written(number: str) -> str:
    """A matched number to suggest with a unit: as the user wrote it, or without its exponent
    (``"1.5e0"`` -> ``"1.5"``, not ``"1.5e0GiB"``)."""
    return f"{float(number):g}" if "e" in number.lower() else number


def parse_budget(text: str | int | float) -> int:
    """A GPU memory budget in bytes: :func:`parse_size`, except that a number written without a
    unit below 1 MiB is refused (``--budget 4`` is 4 bytes, where 4 GiB was surely meant).

    Raises:
        TightfitError: as :func:`parse_size`, or a budget below 1 MiB (a unit-less number is told to
            give a unit).
    """
    value = parse_size(text)
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if m is not None and not m.group(2) and value < MiB:
        said = f"--budget {text.strip()} is {value} byte{'s' if value != 1 else ''}"
        if value <= _MAX_MEANT_GIB:  # a card's memory in GiB or GB, written without its unit
            shown = _as_written(m.group(1))
            raise TightfitError(f"{said}: give a unit, e.g. {shown}GiB or {shown}GB")
        # a number this large was not meant as GiB: suggesting "1048575GiB" would be absurd
        raise TightfitError(f"{said}, under the smallest budget of 1 MiB ({MiB} bytes): give at least {MiB} bytes, "
                            "or a unit, e.g. 6GiB or 512MiB")
    if value < MiB:  # 1KiB: the same floor whatever the unit
        raise TightfitError(f"--budget {format_bytes(value)} is under the smallest budget of 1 MiB: e.g. 6GiB or 512MiB")
    return value


def format_bytes(n: int | float | None) -> str:
    """Format bytes for display: ``format_bytes(3 * 2**30) == "3.00 GiB"``; None gives "-"."""
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_bytes_pair(a: int | float, b: int | float) -> tuple[str, str]:
    """Two sizes (bytes) that one message compares ("X is over the Y"), each as :func:`format_bytes`
    shows it, unless they differ but would read the same: then both in bytes, whole where they are
    (``(2692128, 2692127.1)`` -> ``("2,692,128 B", "2,692,127.1 B")``, not "2.57 MiB is over the
    2.57 MiB")."""
    shown = format_bytes(a), format_bytes(b)
    if shown[0] != shown[1] or a == b:
        return shown
    exact = tuple(f"{int(n):,} B" if float(n).is_integer() else f"{n:,.1f} B" for n in (a, b))
    return exact if exact[0] != exact[1] else tuple(f"{float(n):,.3f} B" for n in (a, b))


def format_seconds(seconds: float) -> str:
    """A short duration for display with three significant digits: ``"1.25 s"``, ``"675 ms"``,
    ``"0.0421 ms"`` (``:.2f`` seconds would print a fraction of a millisecond as "0.00 s")."""
    seconds = float(f"{seconds:.3g}")  # rounded first: 0.9996 s is "1 s", not 999.6 ms shown as "1e+03 ms"
    if abs(seconds) >= 100:
        return f"{seconds:.0f} s"
    if abs(seconds) >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms"


def format_rate(per_s: float) -> str:
    """A rate (samples/s) for display: whole numbers from 100 up, three significant digits below
    (a 1.3B model's 1.77 and 1.78 samples/s would both read "2")."""
    return f"{per_s:.0f}" if abs(per_s) >= 100 else f"{per_s:.3g}"


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in the number that agrees with it: ``count_of(1, "row") == "1 row"``,
    ``count_of(3, "row") == "3 rows"`` (``plural``: where adding ``s`` is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
