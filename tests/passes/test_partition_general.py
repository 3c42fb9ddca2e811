"""Partition any model, not only numbered layer lists (issue 7 §2-3), in one process against the eager model.

Cuts at module boundaries in graph order, balance against a brute-force best contiguous cut, user split points, a
compile-time cycle check, the note for a model no modality rule matches, higher-order ops (torch.cond) carried
into their chunk, and data-dependent sizes computed from the batch."""
import itertools

import pytest
import torch

import dipc
from dipc.testing import local_check
from dipc.passes.partition import PartitionError


class Skewed(torch.nn.Module):
    """Named blocks of very different widths (costs 1x .. 100x): ``embed``, ``b0`` .. ``b5``, ``head``."""

    WIDTHS = [4, 40, 4, 4, 28, 4, 4]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        for i, w in enumerate(self.WIDTHS[:-1]):
            setattr(self, f"b{i}", torch.nn.Sequential(torch.nn.Linear(8, 8 * w), torch.nn.Tanh(),
                                                       torch.nn.Linear(8 * w, 8)))
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        x = self.embed(x)
        for i in range(len(self.WIDTHS) - 1):
            x = x + getattr(self, f"b{i}")(x)
        return ((self.head(x) - y) ** 2).mean()


def _batch(B=4, S=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, S, 8, generator=g), "y": torch.randn(B, S, 8, generator=g)}


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_blocks_of_100x_different_cost_are_balanced_near_the_best_contiguous_cut(pp):
    """The largest chunk is within 1.25x of the best cut between the model's top-level modules (brute force)."""
    torch.manual_seed(0)
    model = Skewed()
    c = dipc.compile(model, _batch(), pp, check=True)
    g = c.program.capture.graph
    nodes = [n for n in g.nodes if n.op == "call_function"]
    cost = {n: _lat(n) for n in nodes}  # the nominal cost the partition balanced (no device profile)
    per_chunk = [sum(cost[n] for n in nodes if n.meta["dipc_chunk"] == ch.index) for ch in c.partition.chunks]
    # the model's top-level modules in graph order and their costs
    tops = []
    for n in nodes:
        stack = n.meta.get("nn_module_stack") or {}
        top = next((v[0].split(".")[0] for v in stack.values() if v[0]), "(glue)")
        if not tops or tops[-1][0] != top:
            tops.append([top, 0.0])
        tops[-1][1] += cost[n]
    costs = [t[1] for t in tops]
    assert max(costs) > 50 * min(x for x in costs if x > 0)  # the blocks really differ by ~100x
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (len(costs),)))
               for cut in itertools.combinations(range(1, len(costs)), pp - 1))
    assert max(per_chunk) <= 1.25 * best, (per_chunk, best)
    local_check(model, c, _batch(4, 7, 1))


def _lat(n):
    from dipc.passes.cost import node_latency
    return node_latency(n.meta["dipc_cost"])


def test_user_split_points_cut_before_the_named_modules():
    torch.manual_seed(0)
    model = Skewed()
    c = dipc.compile(model, _batch(), 2, split_points={"text": ["b2"]}, check=True)
    first, second = (c.partition.chunk_blocks(ch.index) for ch in c.partition.chunks)
    assert first[-1] == "b1" and second[0] == "b2", (first, second)
    with pytest.raises(PartitionError, match=r"split point 'b9' is not a module called in modality 'text'"):
        dipc.compile(model, _batch(), 2, split_points={"text": ["b9"]})
    with pytest.raises(PartitionError, match=r"the split points of modality 'text' \(\[.*\]\) give 3 chunks, not a multiple of pp_size=2"):
        dipc.compile(model, _batch(), 2, split_points={"text": ["b1", "b3"]})


def test_a_model_no_rule_matches_gets_one_modality_and_a_note():
    torch.manual_seed(0)
    c = dipc.compile(Skewed(), _batch(), 2)
    assert c.partition.modalities == ["text"]
    assert "no modality rule matched any module" in c.describe()


class TwoWay(torch.nn.Module):
    """``dec.0`` feeds ``enc``, whose output ``dec.1`` reads: with ``dec.0`` and ``dec.1`` in one chunk, that chunk
    both feeds and waits for the encoder."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.dec = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x, y):
        h = self.dec[0](x)
        e = self.enc[1](self.enc[0](h))
        return ((self.dec[2](self.dec[1](e)) - y) ** 2).mean()


def test_modules_that_feed_each_other_are_a_compile_time_error_naming_the_values():
    torch.manual_seed(0)
    with pytest.raises(PartitionError, match=r"the chunks form a cycle.*chunk \d+ \((enc|dec)\) -> chunk \d+ "
                                             r"\((enc|dec)\) via \['linear"):
        dipc.compile(TwoWay(), _batch(), 2, modalities={"enc": ["enc"], "dec": ["dec"]},
                     split_points={"dec": ["dec.2"]})


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):  # the branch depends on a parameter, not on the batch: per-sample separable
        return torch.cond(self.a.weight.sum() > 0, lambda x: self.a(x), lambda x: self.b(x), (x,))


class CondModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Gated() for _ in range(4)])

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def test_higher_order_op_subgraphs_travel_with_their_chunk():
    torch.manual_seed(0)
    model = CondModel()
    c = dipc.compile(model, _batch(), 2, check=True)
    assert [n for n in c.program.capture.graph.nodes if n.op == "get_attr"]  # torch.cond's branch subgraphs
    local_check(model, c, _batch(4, 6, 2))


class RealRows(torch.nn.Module):
    """Selects the rows of ``x`` that are not all zero (a data-dependent count, as Idefics3 drops padding images),
    encodes them in one module and scatters them back in another."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.dec = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x, y):
        flat = x.reshape(-1, 8)
        real = flat.abs().sum(-1) != 0
        h = flat[real]
        for layer in self.enc:
            h = torch.tanh(layer(h))
        out = torch.zeros_like(flat).index_put((real,), h)
        out = out.reshape(x.shape)
        for layer in self.dec:
            out = torch.tanh(layer(out))
        return ((out - y) ** 2).mean()


def test_a_data_dependent_size_crosses_chunks_computed_from_the_batch():
    torch.manual_seed(0)
    model = RealRows()
    ex = _batch()
    ex["x"][0, :2] = 0
    c = dipc.compile(model, ex, 2, modalities={"vision": ["enc"], "text": ["dec"]}, check=True)
    assert c.program.sizes is not None and c.program.sizes.symbols
    b = _batch(4, 6, 3)
    b["x"][1, 1:4] = 0
    b["x"][3, 0] = 0
    local_check(model, c, b)
