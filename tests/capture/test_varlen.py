"""dipc's custom ops for patch-packed VLMs (dipc/varlen.py): packed attention equals the model's attention run per
segment, in values and gradients, for any segment lengths; metadata ops keep their output shape symbolic under
torch.export and compute values per call; the cost model prices packed attention per segment."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dipc import varlen

pytestmark = pytest.mark.hf  # the attention functions are Hugging Face's (sdpa / eager)


def _per_segment(q, k, v, lengths, scale, impl):
    """What Qwen2-VL's vision attention does: split by lengths, attend per piece, concatenate."""
    outs = []
    for a, b, c in zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v))):
        if impl == "sdpa":
            o = torch.nn.functional.scaled_dot_product_attention(a, b, c, scale=scale).transpose(1, 2)
        else:
            w = torch.softmax(a @ b.transpose(2, 3) * scale, dim=-1, dtype=torch.float32).to(a.dtype)
            o = (w @ c).transpose(1, 2)
        outs.append(o.contiguous())
    return torch.cat(outs, dim=1)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), impl=st.sampled_from(["sdpa", "eager"]),
       seed=st.integers(0, 2 ** 16))
def test_packed_attention_equals_per_segment_attention_with_gradients(lengths, impl, seed):
    g = torch.Generator().manual_seed(seed)
    P, H, D = sum(lengths), 2, 4
    qkv = [torch.randn(1, H, P, D, generator=g, requires_grad=True) for _ in range(3)]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    out = varlen.packed_attention(*qkv, seg, D ** -0.5, impl)
    ref_in = [t.detach().clone().requires_grad_(True) for t in qkv]
    ref = _per_segment(*ref_in, lengths, D ** -0.5, impl)
    assert out.shape == (1, P, H, D)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, qkv, grad)
    want = torch.autograd.grad(ref, ref_in, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert varlen.run_lengths(seg) == lengths


def test_metadata_is_symbolic_in_export_and_computed_per_call():
    """A registered metadata function (here: the row's image index from a grid) is one graph node whose output
    size follows its inputs' sizes: one export serves 2 and 3 images, and each call reads its own values."""
    def owner(grid, rows):
        return torch.repeat_interleave(torch.arange(grid.shape[0]), grid.prod(-1))

    name = varlen.register_metadata("test.owner", owner,
                                    lambda grid, rows: torch.empty(rows.shape[0], dtype=torch.long))

    class M(torch.nn.Module):
        def forward(self, rows, grid):
            return rows.sum(-1) * varlen.metadata(name, [grid, rows])

    rows, grid = torch.ones(12, 2), torch.tensor([[1, 2, 3], [1, 3, 2]])
    ep = torch.export.export(M(), (rows, grid), dynamic_shapes=({0: torch.export.Dim("P")},
                                                                 {0: torch.export.Dim("N")}))
    assert sum(n.target is torch.ops.dipc.metadata.default for n in ep.graph.nodes) == 1
    mod = ep.module()
    grid3 = torch.tensor([[1, 1, 2], [1, 2, 1], [1, 1, 4]])
    assert mod(torch.ones(8, 2), grid3).tolist() == [0, 0, 2, 2, 4, 4, 4, 4]
    assert mod(rows, grid).tolist() == [0.0] * 6 + [2.0] * 6
    assert mod(torch.ones(3, 2), torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1]])).tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(RuntimeError, match=r"'test.nowhere' is not registered"):
        varlen.metadata("test.nowhere", [grid])


def test_packed_attention_is_priced_per_segment():
    """The cost pass prices attention over N segments of P / N rows (not one P x P attention), and keeps q, k, v
    and the segment ids for the backward, which recomputes the attention."""
    from dipc.passes.symcost import annotate_symbolic_cost

    def seg_of(grid, rows):
        return torch.repeat_interleave(torch.arange(grid.shape[0]), grid.prod(-1))

    name = varlen.register_metadata("test.segments", seg_of,
                                    lambda grid, rows: torch.empty(rows.shape[0], dtype=torch.long))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, rows, grid):
            q, k, v = self.qkv(rows).reshape(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
            out = varlen.packed_attention(q, k, v, varlen.metadata(name, [grid, rows]), 0.5, "sdpa")
            return out.sum()

    ep = torch.export.export(M(), (torch.randn(12, 8), torch.tensor([[1, 2, 3], [1, 2, 3]])),
                             dynamic_shapes=({0: torch.export.Dim("P")}, {0: torch.export.Dim("N")}))
    annotate_symbolic_cost(ep.graph)
    node = next(n for n in ep.graph.nodes if n.target is torch.ops.dipc.packed_attention.default)
    cost = node.meta["dipc_symcost"]
    P, N = (next(iter(n.meta["val"].shape[0].node.expr.free_symbols)) for n in ep.graph.nodes
            if n.op == "placeholder" and n.name in ("rows", "grid"))
    f = float(cost.flops_fwd.subs({P: 12, N: 2}))
    assert f == 2 * 2 * 12 * 6 * 4 * 2, f  # 2 heads, 12 query rows, 6 keys each, D = 4, QK^T and PV
    assert float(cost.flops_bwd.subs({P: 12, N: 2})) == f + 2 * 2 * 12 * 6 * (3 * 4 + 2 * 4)
    assert {k for k, _ in cost.saved} >= {"metadata"}
