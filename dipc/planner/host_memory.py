"""Host memory and the host link for offloaded activations in the per-rank memory ILP (DESIGN.md "Memory"; issue
"Memory strategies" §2): a rank's offloaded bytes, counted from each pair's forward to its backward in the rank's
order, stay within the host memory its GPU may fill (``Stage.host_limit``), and its copies' seconds on the host link
(an offloading option's sixth figure) within the rank's compute seconds, which they must hide behind (each pair's
own cost assumes its copies overlap compute: without this bound the choice could offload more than the link
carries).  The ILP of :mod:`dipc.planner.memory` has one resource, device memory; the two bounds enter it as a price
per host byte on the offloading candidates (a Lagrange multiplier), searched until the choice fits.  Pure: no
process group.
"""
from __future__ import annotations

from ..plan import forward_key

__all__ = ["within_host"]


def _host_peak(ks, at_pair, tabs, js_all) -> float:
    """Most bytes of offloaded activations a rank's ``ks`` order holds at once with each pair at its chosen
    candidate (a pair's host bytes count from its forward to its backward)."""
    level = top = 0.0
    for k in ks:
        i = at_pair.get(k if k[0] == "F" else forward_key(k))
        o = tabs[i].opts[js_all[i]]
        if len(o) > 4 and o[4]:
            level += o[4] if k[0] == "F" else -o[4]
            top = max(top, level)
    return top


def _link_seconds(tabs, js_all) -> float:
    """Seconds of host-link copies (out and back) of the chosen candidates."""
    return sum(o[5] for t, j in zip(tabs, js_all) for o in (t.opts[j],) if len(o) > 5)


def _priced(fwd, tabs, lam: float, table):
    """The pairs' candidates with every offloading option's extra seconds raised by ``lam`` per host byte, as the
    solver sees them: pruned again from each forward's options at those figures (an option the offloading one
    dominated, "recompute" beside "offload", may be the pick now).  Pairs without an offloading option keep
    their ``tabs``."""
    out = []
    for st, t in zip(fwd, tabs):
        full = tuple(st.options) or t.opts
        if not any(len(o) > 4 and o[4] for o in full):
            out.append(t)
            continue
        opts = tuple((o[0], o[1], o[2] + lam * o[4], *o[3:]) if len(o) > 4 and o[4] else o for o in full)
        out.append(table(opts))
    return out


def within_host(ks, at_pair, fwd, tabs, js_all, host_M: float, busy_s: float, choose, table):
    """Keep a rank's offloaded bytes within its host memory ``host_M`` and its copies' link seconds within its
    compute seconds ``busy_s`` (module docstring): when the chosen candidates hold more at some point of its order
    (:func:`_host_peak`) or copy longer, the offloading candidates are priced per host byte (a Lagrange multiplier on the host-memory constraint: raised until the choice fits, then bisected
    five times towards the cheapest price that fits) and the rank solved again (``choose(tabs)``: each pair's
    index into its candidates, or None; ``table(options)``: the candidates of an options tuple).  Returns each
    pair's chosen option at its own figures (a list; None: the solver found none).  ``ks``: the rank's order;
    ``at_pair``: forward key -> pair index; ``fwd``: the pairs' forward stages; ``tabs``/``js_all``: the
    candidates and the choice made without a price."""
    def own(priced, got):
        out = []
        for st, p, j in zip(fwd, priced, got):
            name = p.opts[j][0]
            out.append(next((o for o in (tuple(st.options) or p.opts) if o[0] == name), p.opts[j]))
        return out

    def fits(tabs, js) -> bool:
        return (_host_peak(ks, at_pair, tabs, js) <= host_M * (1 + 1e-9)
                and _link_seconds(tabs, js) <= busy_s * (1 + 1e-9))

    if fits(tabs, js_all):
        return [t.opts[j] for t, j in zip(tabs, js_all)]
    top_extra = max((o[2] for st in fwd for o in st.options), default=0.0)
    top_host = max((o[4] for st in fwd for o in st.options if len(o) > 4), default=0.0)
    lo, hi, best = 0.0, max(top_extra, 1e-9) / max(top_host, 1.0) * 1e-2, None
    for _ in range(40):  # find a price that fits
        priced = _priced(fwd, tabs, hi, table)
        got = choose(priced)
        if got is not None and fits(priced, got):
            best = (priced, got)
            break
        lo, hi = hi, hi * 4
    if best is None:
        return None
    for _ in range(5):
        mid = (lo + hi) / 2
        priced = _priced(fwd, tabs, mid, table)
        got = choose(priced)
        if got is not None and fits(priced, got):
            best, hi = (priced, got), mid
        else:
            lo = mid
    return own(*best)
