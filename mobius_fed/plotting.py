"""The one way figures are finished and written (matplotlib: the optional ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path, *axes: Any, dpi: int = 120) -> Path:
    """Legend and light grid on ``axes``, tight layout, write ``path``, free the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
