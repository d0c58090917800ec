"""Numbers for people: the one byte formatter of logs, reports and the CLI (standard library only)."""
from __future__ import annotations

__all__ = ["human_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float, sep: str = " ") -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"9.9 MiB"``, ``"1.5 TiB"``.

    Args:
      n: a byte count (negative counts keep their sign).
      sep: between the number and the unit (``""`` for a compact progress line: ``"9.9MiB"``).
    """
    k = next(k for k in range(len(_UNITS) - 1, -1, -1) if abs(n) >= 1024 ** k or k == 0)
    return f"{n:.0f}{sep}B" if k == 0 else f"{n / 1024 ** k:.1f}{sep}{_UNITS[k]}"
