"""The Gantt chart and Chrome trace of a step (dipc.sim.trace): sends, receives and waits as categories of their
own, and labels only where they fit (issue "The house").  The measured events of a real 2-rank step are checked in
tests/runtime/test_async_planning.py (``_check_measured_trace``, on the run that already gathers them)."""
import itertools

import pytest

from dipc.sim.trace import category, chrome_trace, gantt_figure, gantt_png

pytest.importorskip("matplotlib")


def _events():
    """Two ranks: wide and narrow compute bars (F and B, two modalities), sends, receives and waits; times in s."""
    ev = []
    t = {0: 0.0, 1: 0.0}
    widths = [0.02, 0.0004, 0.004, 0.0015, 0.03, 0.00005, 0.01]
    for i, (r, w) in enumerate(itertools.product((0, 1), widths)):
        kind = "F" if i % 2 else "B"
        for k, d in (("RECV_F", 0.0003), ("WAIT", 0.002 * (i % 3)), (kind, w), ("SEND_F", 0.0005)):
            name = f"{r}{kind}{i}.{i % 4}" if k in ("F", "B") else f"{k.lower()} {i}"
            ev.append({"rank": r, "start": t[r], "end": t[r] + d, "name": name, "kind": k,
                       "modality": "vision" if i % 3 else "text"})
            t[r] += d
    return ev


def test_categories_and_the_chrome_trace():
    assert [category(k) for k in ("F", "B", "SEND_F", "SEND_B", "RECV_F", "RECV_B", "WAIT", "?")] == \
        ["compute", "compute", "send", "send", "recv", "recv", "wait", "other"]
    ev = _events()
    xs = [x for x in chrome_trace(ev)["traceEvents"] if x["ph"] == "X"]
    assert len(xs) == len(ev) and {x["cat"] for x in xs} == {"compute", "send", "recv", "wait"}
    assert all(x["dur"] >= 0 and x["args"]["kind"] for x in xs)


def test_gantt_labels_fit_their_bars_and_do_not_overlap(tmp_path):
    ev = _events()
    fig = gantt_figure(ev, "test")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    labels = {t.get_text(): t for t in ax.texts}
    compute = {e["name"]: e for e in ev if category(e["kind"]) == "compute"}
    assert labels and set(labels) < set(compute)  # some labelled, the narrowest not
    assert "0F5.1" not in labels and "0B4.0" in labels  # 50 us: no room; 30 ms: room
    boxes = []
    for name, t in labels.items():
        e = compute[name]
        box = t.get_window_extent(renderer)
        (x0, _), (x1, _) = ax.transData.transform([(e["start"] * 1e3, 0), (e["end"] * 1e3, 0)])
        assert x0 <= box.x0 and box.x1 <= x1, (name, box, x0, x1)  # inside its bar
        boxes.append((name, box))
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), (a, b)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"text", "vision", "forward", "backward", "send (posting)", "receive (posting)",
            "waiting for data"} == set(legend)
    path = gantt_png(ev, str(tmp_path / "g.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert not gantt_figure(ev, label=False).axes[0].texts
