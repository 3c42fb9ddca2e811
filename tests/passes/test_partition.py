"""Balanced contiguous cuts and the DIP K_i rule (dipc.passes.partition)."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from dipc.passes.partition import PartitionError, balanced_cuts, chunks_per_rank_rule


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.floats(0, 100), min_size=1, max_size=9), data=st.data())
def test_cuts_cover_every_block_once_and_are_optimal(costs, data):
    n = data.draw(st.integers(1, len(costs)))
    cuts = balanced_cuts(costs, n)
    assert len(cuts) == n
    assert cuts[0][0] == 0 and cuts[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in cuts)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    got = max(sum(costs[lo:hi]) for lo, hi in cuts)
    # brute force over all cut positions
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + c, c + (len(costs),)))
               for c in itertools.combinations(range(1, len(costs)), n - 1))
    assert got == pytest.approx(best, rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.floats(0, 100), min_size=1, max_size=8), data=st.data())
def test_cuts_under_a_weight_cap_are_optimal_or_refused(costs, data):
    """A balance under memory (nnScaler*'s time balance at 80 GB): every chunk's weight (parameter bytes) stays
    under the cap, the largest cost is the brute-force optimum among the cuts that do, and no such cut is an error."""
    n = data.draw(st.integers(1, len(costs)))
    weights = data.draw(st.lists(st.floats(0, 10), min_size=len(costs), max_size=len(costs)))
    cap = data.draw(st.floats(0, 40))
    # balanced_cuts allows the cap its rounding (1e-12 of cap + total weight): its prefix sums round otherwise
    limit = cap + 1e-12 * (cap + sum(weights))
    feasible = [c for c in itertools.combinations(range(1, len(costs)), n - 1)
                if all(sum(weights[a:b]) <= limit for a, b in zip((0,) + c, c + (len(costs),)))]
    if not feasible:
        with pytest.raises(PartitionError, match="keeps every chunk under"):
            balanced_cuts(costs, n, weights, cap)
        return
    cuts = balanced_cuts(costs, n, weights, cap)
    assert all(sum(weights[lo:hi]) <= limit + 1e-12 * (cap + sum(weights)) for lo, hi in cuts)
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + c, c + (len(costs),))) for c in feasible)
    assert max(sum(costs[lo:hi]) for lo, hi in cuts) == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_uneven_layers_are_not_lost():
    cuts = balanced_cuts([1.0] * 7, 4)
    assert sorted(b for lo, hi in cuts for b in range(lo, hi)) == list(range(7))
    assert sorted(hi - lo for lo, hi in cuts) == [1, 2, 2, 2]


def test_too_many_chunks_is_an_error():
    with pytest.raises(PartitionError, match="cannot cut 3 blocks into 4 chunks"):
        balanced_cuts([1.0, 1.0, 1.0], 4)


def test_k_rule_floor_of_latency_ratio():
    """DIP §2.1: K_i = floor(T_i / T_1), T_1 the fastest module."""
    assert chunks_per_rank_rule({"vision": 6.75, "text": 10.5}) == {"vision": 1, "text": 1}
    assert chunks_per_rank_rule({"vision": 1.0, "text": 2.9, "dit": 4.0}) == {"vision": 1, "text": 2, "dit": 4}


def test_blocks_balanced_by_device_seconds():
    """With per-node seconds (the compiler passes forward + backward on its device profile), the cuts balance those
    and not the nominal estimate: making the first text layer 30x heavier moves the cut into that layer (its
    sub-modules are candidates), and the two chunks are balanced within the 10% tolerance."""
    import torch
    import pipeline_cases as pc
    from dipc.capture import capture
    from dipc.passes.cost import annotate_cost
    from dipc.passes.modality import DEFAULT_RULES, annotate_modality, module_path
    from dipc.passes.partition import partition

    torch.manual_seed(0)
    cap = capture(pc.vlm(text_layers=6), pc.vlm_batch([1, 1], 12, 0))
    annotate_modality(cap.graph, DEFAULT_RULES)
    annotate_cost(cap.graph)

    def text_layers(part):
        return [sorted({int(n.split(".")[2]) for n in part.chunk_blocks(c.index) if ".layers." in n})
                for c in part.chunks_of("text")]

    even = partition(cap.graph, 2, chunks_per_rank={"vision": 1, "text": 1})
    assert text_layers(even) == [[0, 1, 2], [3, 4, 5]]
    seconds = {}
    for n in cap.graph.nodes:
        if n.op == "call_function":
            heavy = any(p.startswith("language_model.layers.0") for p in module_path(n))
            seconds[n.name] = 1e-6 * (30 if heavy else 1)
    heavy = partition(cap.graph, 2, chunks_per_rank={"vision": 1, "text": 1}, node_seconds=seconds)
    first, second = text_layers(heavy)
    assert first == [0] and second[0] == 0, (first, second)  # layer 0 is cut inside
    text = [n for n in cap.graph.nodes if n.op == "call_function" and n.meta["dipc_modality"] == "text"]
    per_chunk = [sum(seconds[n.name] for n in text if n.meta["dipc_chunk"] == c.index) for c in heavy.chunks_of("text")]
    blocks = [0.0] * heavy.n_blocks["text"]
    for n in text:
        blocks[n.meta["dipc_block"]] += seconds[n.name]
    best = min(max(sum(blocks[:i]), sum(blocks[i:])) for i in range(1, len(blocks)))  # brute force over the blocks
    assert max(per_chunk) <= 1.05 * best
    layer0 = sum(seconds[n.name] for n in text if not any(".layers." in p and not p.startswith(
        "language_model.layers.0") for p in module_path(n)) and not any(p in ("language_model.norm", "lm_head")
                                                                       for p in module_path(n)))
    assert max(per_chunk) < 0.8 * layer0  # better than any cut between whole layers (layer 0 alone)
    name = next(iter(seconds))
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(PartitionError, match=f"node_seconds\\['{name}'\\] = {bad}: it must be a finite"):
            partition(cap.graph, 2, node_seconds={**seconds, name: bad})
