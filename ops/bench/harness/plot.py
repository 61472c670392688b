"""A PNG beside a benchmark's JSON where a plot says more: matplotlib is optional (not a dependency of
the service), so a run without it says so once and writes no PNG."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["pyplot", "save"]


def pyplot(hint: str = "") -> ModuleType | None:
    """`matplotlib.pyplot` on the Agg backend, or None (with a line on stderr) when not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no PNG{hint}", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, title: str, path: Path, dpi: int = 120) -> bool:
    """Title `fig`, lay it out, write it to `path` and close it; True (for `if save(...): print(...)`)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True
