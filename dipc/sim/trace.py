"""Pictures of a step: Chrome/Perfetto trace JSON and a Gantt chart PNG, for simulated and measured runs.

Both writers take the same events: dicts ``{"rank", "start", "end", "name", "kind", "modality"}`` with times in
seconds; :meth:`dipc.sim.simulate.SimResult.events` makes them from a simulation and
:meth:`dipc.runtime.PipelineRuntime.trace_events` from a measured step (every rank's executor records each
action's start and end).

* :func:`chrome_trace` / :func:`write_chrome_trace`: the Trace Event Format (``"ph": "X"`` complete events, one
  process per rank, microseconds), readable by ``chrome://tracing`` and https://ui.perfetto.dev.
* :func:`gantt_png`: ranks by time, coloured by modality, forward solid and backward hatched, each bar labelled
  with its action token (``3F1.2`` = chunk 3, microbatch 1, sub-microbatch 2).
"""
from __future__ import annotations

import json
from typing import Sequence

__all__ = ["chrome_trace", "write_chrome_trace", "gantt_png"]

_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D"]


def chrome_trace(events: Sequence[dict], title: str = "dipc step") -> dict:
    """Trace Event Format dict of ``events`` (compute actions; comm actions too if given)."""
    out = []
    ranks = sorted({e["rank"] for e in events})
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
    for e in events:
        out.append({"ph": "X", "name": e["name"], "cat": e.get("kind", ""), "pid": e["rank"], "tid": 0,
                    "ts": e["start"] * 1e6, "dur": max(e["end"] - e["start"], 0.0) * 1e6,
                    "args": {"modality": e.get("modality", ""), "kind": e.get("kind", "")}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(events: Sequence[dict], path: str, title: str = "dipc step") -> str:
    """Write :func:`chrome_trace` to ``path`` (JSON) and return the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events, title), f)
    return path


def gantt_png(events: Sequence[dict], path: str, title: str = "dipc step", label: bool = True) -> str:
    """Draw a Gantt chart of the compute events to ``path`` (PNG) with matplotlib; returns the path.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    compute = [e for e in events if e.get("kind") in ("F", "B")]
    ranks = sorted({e["rank"] for e in compute}) or [0]
    mods = sorted({e.get("modality", "") for e in compute})
    colour = {m: _COLOURS[i % len(_COLOURS)] for i, m in enumerate(mods)}
    t_end = max((e["end"] for e in compute), default=1.0)
    scale, unit = (1e3, "ms") if t_end < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * len(compute) / max(len(ranks), 1) + 6)),
                                    1.0 + 0.6 * len(ranks)))
    for e in compute:
        y = ranks.index(e["rank"])
        s, d = e["start"] * scale, (e["end"] - e["start"]) * scale
        ax.barh(y, d, left=s, height=0.8, color=colour[e.get("modality", "")], edgecolor="black", linewidth=0.4,
                hatch="///" if e["kind"] == "B" else None, alpha=0.95 if e["kind"] == "F" else 0.75)
        if label and d > 0:
            ax.text(s + d / 2, y, e["name"], ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    handles = [Patch(facecolor=colour[m], label=m or "?") for m in mods]
    handles += [Patch(facecolor="white", edgecolor="black", label="forward"),
                Patch(facecolor="white", edgecolor="black", hatch="///", label="backward")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45 if len(ranks) < 3 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
