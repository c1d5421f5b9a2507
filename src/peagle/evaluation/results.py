"""Writing a benchmark's results: the JSON every `peagle bench` mode writes and its PNG plot."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out, save (PNG, 110 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json_and_plot(
    results: dict[str, Any], out_dir: str | Path, stem: str, plot: Callable[[Any, Path], Path]
) -> tuple[Path, Path]:
    """Write `results` to `out_dir/<stem>.json` and `plot(results["summary"], out_dir/<stem>.png)`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"{stem}.json"
    js.write_text(json.dumps(results, indent=2))
    return js, plot(results["summary"], out / f"{stem}.png")


def repeated_ngram_share(tokens: Sequence[int], n: int = 8) -> float | None:
    """The share of `tokens`' n-token windows that already occurred earlier in them (0: no window repeats, near 1: a
    loop); None when there are fewer than n + 1 tokens. A drafter drafts a repeating output far better than fresh
    text, so a speedup measured on one says little about the other."""
    windows = len(tokens) - n + 1
    if windows < 2:
        return None
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(windows):
        window = tuple(tokens[i : i + n])
        repeated += window in seen
        seen.add(window)
    return repeated / windows


__all__ = ["repeated_ngram_share", "save_figure", "write_json_and_plot"]
