"""Pictures of a step: Chrome/Perfetto trace JSON and a Gantt chart PNG, for simulated and measured runs.

Both writers take the same events: dicts ``{"rank", "start", "end", "name", "kind", "modality"}`` with times in
seconds; :meth:`dipc.sim.simulate.SimResult.events` makes them from a simulation and
:meth:`dipc.runtime.PipelineRuntime.trace_events` from a measured step (every rank's executor records each
action's start and end, and where it waited on a message).  ``kind`` says what the rank did then
(:func:`category`):

* ``F`` / ``B``: a forward / backward (compute; a measured one starts once its messages are in);
* ``SEND_F`` / ``SEND_B``: posting a send (packing the tensors, ``isend``); ``RECV_F`` / ``RECV_B``: posting a
  receive (``irecv``);
* ``WAIT``: waiting for data: a receive's message had not arrived when the stage that reads it was due (or, at the
  end of a measured step, the rank waits for its sends to be delivered).

* :func:`chrome_trace` / :func:`write_chrome_trace`: the Trace Event Format (``"ph": "X"`` complete events, one
  process per rank, microseconds, ``cat`` = the category), readable by ``chrome://tracing`` and
  https://ui.perfetto.dev.
* :func:`gantt_png` (:func:`gantt_figure`): ranks by time; compute coloured by modality, forward solid and backward
  hatched; sends, receives and waits in colours of their own; a legend; each compute bar labelled with its action
  token (``3F1.2`` = chunk 3, microbatch 1, sub-microbatch 2) where the text fits inside the bar (measured with
  the renderer; along the bar, or across a narrow one), so that no two labels overlap.
"""
from __future__ import annotations

import json
from typing import Sequence

__all__ = ["WAIT", "category", "chrome_trace", "write_chrome_trace", "gantt_figure", "gantt_png"]

WAIT = "WAIT"
_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D"]
# not among the modalities' colours: sends dark, receives mid grey, waits a pale red (idle, but held up by data)
_STYLE = {"send": ("#2B2B2B", "send (posting)"), "recv": ("#9A9A9A", "receive (posting)"),
          "wait": ("#F6B8B8", "waiting for data")}


def category(kind: str) -> str:
    """``"compute"`` (F, B), ``"send"`` (SEND_*), ``"recv"`` (RECV_*), ``"wait"`` (WAIT), else ``"other"``."""
    if kind in ("F", "B"):
        return "compute"
    if kind.startswith("SEND"):
        return "send"
    if kind.startswith("RECV"):
        return "recv"
    return "wait" if kind == WAIT else "other"


def chrome_trace(events: Sequence[dict], title: str = "dipc step") -> dict:
    """Trace Event Format dict of ``events``: each a complete event whose ``cat`` is its :func:`category` and whose
    ``args`` hold its kind and modality."""
    out = []
    ranks = sorted({e["rank"] for e in events})
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
    for e in events:
        kind = e.get("kind", "")
        out.append({"ph": "X", "name": e["name"], "cat": category(kind), "pid": e["rank"], "tid": 0,
                    "ts": e["start"] * 1e6, "dur": max(e["end"] - e["start"], 0.0) * 1e6,
                    "args": {"modality": e.get("modality", ""), "kind": kind}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(events: Sequence[dict], path: str, title: str = "dipc step") -> str:
    """Write :func:`chrome_trace` to ``path`` (JSON) and return the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events, title), f)
    return path


def gantt_figure(events: Sequence[dict], title: str = "dipc step", label: bool = True, dpi: int = 130):
    """The Gantt chart of ``events`` as a matplotlib ``Figure`` (Agg canvas, no pyplot state); :func:`gantt_png`
    saves it.  A label is drawn only where its text, measured by the renderer at ``dpi``, fits inside its bar with
    a margin, along the bar or else across it (bars of one rank do not overlap in time, so neither do their labels;
    a label is also skipped if it would reach the previous one of its rank); bars narrower than a pixel are
    drawn one pixel wide for sends and receives, so that every posting shows.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.patches import Patch

    ranks = sorted({e["rank"] for e in events}) or [0]
    row = {r: i for i, r in enumerate(ranks)}
    by_cat: dict[str, list[dict]] = {}
    for e in events:
        by_cat.setdefault(category(e.get("kind", "")), []).append(e)
    compute = by_cat.get("compute", [])
    mods = sorted({e.get("modality", "") for e in compute})
    colour = {m: _COLOURS[i % len(_COLOURS)] for i, m in enumerate(mods)}
    t_end = max((e["end"] for e in events), default=0.0) or 1.0
    scale, unit = (1e3, "ms") if t_end < 10 else (1.0, "s")

    handles = [Patch(facecolor=colour[m], edgecolor="black", linewidth=0.4, label=m or "?") for m in mods]
    handles += [Patch(facecolor="white", edgecolor="black", linewidth=0.4, label="forward"),
                Patch(facecolor="white", edgecolor="black", linewidth=0.4, hatch="///", label="backward")]
    handles += [Patch(facecolor=c, edgecolor=c, label=text) for cat, (c, text) in _STYLE.items() if by_cat.get(cat)]
    ncol = min(len(handles), 7)
    legend_rows = -(-len(handles) // ncol)
    width = max(8.0, min(24.0, 0.15 * len(events) / len(ranks) + 6))
    height = 1.2 + 0.6 * len(ranks) + 0.25 * legend_rows
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlim(0, t_end * scale * 1.01)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ax.grid(axis="x", color="#E0E0E0", linewidth=0.5)
    ax.set_axisbelow(True)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.22 * legend_rows / height, 1, 1))
    px = ax.transData.transform((1.0, 0.0))[0] - ax.transData.transform((0.0, 0.0))[0]  # pixels per x unit
    h, bar_px = 0.8, abs(ax.transData.transform((0.0, 0.8))[1] - ax.transData.transform((0.0, 0.0))[1])

    def spans(evs, min_px: float = 0.0):
        out: dict[int, list] = {}
        for e in evs:
            s, d = e["start"] * scale, max(e["end"] - e["start"], 0.0) * scale
            out.setdefault(row[e["rank"]], []).append((s, max(d, min_px / px)))
        return out

    for cat in ("wait", "send", "recv"):
        c = _STYLE[cat][0]
        for y, xs in spans(by_cat.get(cat, []), 0.0 if cat == "wait" else 1.0).items():
            ax.broken_barh(xs, (y - h / 2, h), facecolors=c, edgecolors="none", linewidth=0)
    for (m, kind), evs in _group(compute).items():
        for y, xs in spans(evs).items():
            ax.broken_barh(xs, (y - h / 2, h), facecolors=colour[m], edgecolors="black", linewidth=0.4,
                           hatch="///" if kind == "B" else None, alpha=0.95 if kind == "F" else 0.75)
    if label:
        renderer = fig.canvas.get_renderer()
        font = FontProperties(size=6)
        pad = 2.0  # pixels each side
        box = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.7}
        right: dict[int, float] = {}  # per row, the right edge (pixels) of the last label placed
        for e in sorted(compute, key=lambda e: e["start"]):
            s, d = e["start"] * scale, (e["end"] - e["start"]) * scale
            tw, th, _ = renderer.get_text_width_height_descent(e["name"], font, ismath=False)
            if d * px >= tw + 2 * pad and bar_px >= th + 2 * pad:
                rot = 0  # along the bar
            elif d * px >= th + 2 * pad and bar_px >= tw + 2 * pad:
                rot, tw = 90, th  # across a narrow bar
            else:
                continue
            y = row[e["rank"]]
            left_px = (s + d / 2) * px - tw / 2
            if left_px < right.get(y, float("-inf")) + pad:
                continue
            ax.text(s + d / 2, y, e["name"], ha="center", va="center", rotation=rot, fontproperties=font,
                    clip_on=True, bbox=box)  # the box (inside the margin) keeps it readable on hatching
            right[y] = left_px + tw
    return fig


def _group(compute: Sequence[dict]) -> dict:
    out: dict[tuple[str, str], list[dict]] = {}
    for e in compute:
        out.setdefault((e.get("modality", ""), e["kind"]), []).append(e)
    return out


def gantt_png(events: Sequence[dict], path: str, title: str = "dipc step", label: bool = True) -> str:
    """Draw :func:`gantt_figure` of ``events`` to ``path`` (PNG); returns the path.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    fig = gantt_figure(events, title, label)
    fig.savefig(path, dpi=fig.dpi)
    return path
