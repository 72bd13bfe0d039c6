"""Pictures of runs: matplotlib on a file-only backend, and small committed PNGs.

Used by ``tools/plot_metrics.py`` and ``tools/loss_compare.py``; matplotlib is imported only
when a picture is drawn (it is in the ``plot`` extra).
"""

from __future__ import annotations

from pathlib import Path


def pyplot(tool: str):
    """matplotlib's pyplot on the file-only Agg backend, or exit with how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{tool}: drawing needs matplotlib: pip install 'matplotlib>=3.8' "
                         "(it is in requirements.txt)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_small(fig, path: Path) -> None:
    """Write ``fig`` as a PNG with a 256-colour palette: a plot of a few line colours looks
    the same and the file is 2-3x smaller (these pictures are committed)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(256).save(path, optimize=True)
