"""Sweep plots: output tok/s and TTFT p50 against concurrency, one line per sweep file."""

from __future__ import annotations

import os
from collections.abc import Sequence

from met.bench.sweep import SweepResult


def plot_sweeps(results: Sequence[SweepResult], path: str | os.PathLike[str]) -> None:
    """Write a PNG with two panels (throughput, time to first token) to ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot: needs matplotlib (pip install 'met-engine[bench]')") from None

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        for res in results:
            conc = [r.concurrency for r in res.rungs]
            ax_tps.plot(conc, [r.output_tok_s for r in res.rungs], marker="o", label=res.label)
            ttft = [(r.concurrency, r.ttft_p50_ms) for r in res.rungs
                    if r.ttft_p50_ms is not None]
            ax_ttft.plot([c for c, _ in ttft], [t for _, t in ttft], marker="o",
                         label=res.label)
        ticks = sorted({r.concurrency for res in results for r in res.rungs})
        for ax, title, ylabel in ((ax_tps, "output throughput", "output tok/s"),
                                  (ax_ttft, "time to first token (p50)", "TTFT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        first = results[0].settings if results else None
        if first is not None:
            fig.suptitle(f"isl≈{first.isl}, osl {first.osl}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
