"""PNG timeline: one row per rank (compute coloured by chunk, forwards light, backwards dark),
a thin row beneath each for pipeline sends and host copies (offload / reload), and one for data-parallel
collectives."""
from __future__ import annotations

from typing import Sequence

from ..schedule.ops import OpKind
from .simulator import SimulationResult


_LANE_COLORS = {"p2p": "grey", "dp": "red", "d2h": "tab:purple", "h2d": "tab:green"}
"""Colours of the thin rows: pipeline sends, data-parallel collectives, host offloads and reloads
(copies share the sends' row: both are per-rank transfers beside the compute)."""


def plot_timelines(results: Sequence[SimulationResult], path: str, titles: Sequence[str] = ()) -> None:
    """Draw one panel per result (e.g. the schedule next to depth-first and breadth-first)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from error
    cmap = plt.get_cmap("tab10")
    span = max(r.iteration_s for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(14, 1.0 + 1.1 * sum(r.config.pp for r in results) / len(results) * len(results) * 0.6 + 0.6 * len(results)), squeeze=False)
    for panel, result in enumerate(results):
        ax = axes[panel][0]
        p = result.config.pp
        for rank in range(p):
            y = (p - 1 - rank) * 1.0
            for e in result.timeline.compute[rank]:
                color = cmap(e.op.chunk % 10)
                alpha = 0.55 if e.op.kind is OpKind.FORWARD else 1.0
                ax.broken_barh([(e.start, e.end - e.start)], (y + 0.3, 0.6), facecolors=color, alpha=alpha, edgecolor="black", linewidth=0.3)
                if result.config.microbatches * result.config.vpp <= 48:
                    ax.text(e.start + (e.end - e.start) / 2, y + 0.6, str(e.op), ha="center", va="center", fontsize=5)
        for c in result.timeline.comms:
            y = (p - 1 - c.src) * 1.0
            color = _LANE_COLORS.get(c.lane, "red")
            row = 0.16 if c.lane in ("p2p", "d2h", "h2d") else 0.02
            ax.broken_barh([(c.start, max(c.end - c.start, span * 1e-4))], (y + row, 0.12), facecolors=color, alpha=0.7)
        ax.set_yticks([(p - 1 - r) + 0.5 for r in range(p)])
        ax.set_yticklabels([f"rank {r}" for r in range(p)])
        ax.set_xlim(0, span * 1.01)
        title = titles[panel] if panel < len(titles) else result.config.describe()
        ax.set_title(f"{title}: {result.iteration_s * 1e3:.1f} ms, idle {100 * result.idle_fraction:.1f}%", fontsize=9)
    axes[-1][0].set_xlabel("time (s)")
    chunks = max(r.config.vpp for r in results)
    handles = [Patch(color=cmap(c % 10), label=f"chunk {c}") for c in range(chunks)]
    handles += [Patch(color="grey", alpha=0.7, label="pipeline send"), Patch(color="red", alpha=0.7, label="data-parallel")]
    if any(c.lane in ("d2h", "h2d") for r in results for c in r.timeline.comms):
        handles += [Patch(color=_LANE_COLORS[lane], alpha=0.7, label=label)
                    for lane, label in (("d2h", "offload"), ("h2d", "reload"))]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130)
    plt.close(fig)
