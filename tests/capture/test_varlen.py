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


def test_a_capture_runs_with_an_instance_kind_fed_as_zero_instances():
    """Sizes divided by sizes (a reshape's ``-1`` worked out by the trace, ``rows // (rows // 4)``) are defined at 0
    rows in the captured graph (``dipc.capture.size_floordiv``), in the message shapes (``codegen.stage._size``) and
    in the cost model (``symcost``'s fallback), each taking a quotient by a 0 size as 0; the graph's loss at 0 rows
    is the eager function's with that input's term absent."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    from dipc.capture import capture, size_floordiv, size_mod
    from dipc.codegen.stage import _size
    from dipc.passes.symcost.compiled import at_zero

    class Windows(torch.nn.Module):  # rows grouped 4 at a time, as Qwen2.5-VL's window permutation
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(3, 3)

        def forward(self, rows, other):
            n = rows.shape[0]
            x = self.w(rows).reshape(n // 4, 4, -1).flip(0).reshape(n // 4 * (n // (n // 4)), -1)
            return {"loss": x.sum() + other.sum()}

    model = Windows()
    cap = capture(model, {"rows": torch.randn(20, 3), "other": torch.randn(5)})
    empty = {"rows": torch.zeros(0, 3), "other": torch.randn(5)}
    out = cap.graph_module(*cap.arguments(model, empty))
    assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, empty["other"].sum())
    assert size_floordiv(7, 0) == 0 and size_floordiv(7, 2) == 3 and size_mod(7, 0) == 0 and size_mod(7, 4) == 3
    s = sympy.Symbol("s", integer=True, positive=True)
    rows = FloorDiv(s, 4) * FloorDiv(s, FloorDiv(s, 4))
    assert _size(rows, {s: 0}) == 0 and _size(rows, {s: 20}) == 20
    n = sympy.Symbol("n", integer=True, positive=True)
    flops = s ** 2 / n + 3 * s + 7  # attention over n runs of s / n rows, plus terms that stay
    assert at_zero(flops, {s: 0, n: 0}) == 7.0 and at_zero(flops, {s: 8, n: 2}) == 63.0


def test_anyres_bilinear_taps_are_torchs_own():
    """LLaVA-OneVision's anyres_max down-scaling as the anyres recipe computes it (dipc.recipes_anyres): each
    output position's two source rows/columns and weights, applied in torch's kernel order, give
    ``F.interpolate(..., mode="bilinear")``'s values within float32 rounding (its vectorised kernel rounds some
    positions one ulp apart)."""
    from dipc.recipes_anyres import _linear_taps

    g = torch.Generator().manual_seed(0)
    for h, w, oh, ow in ((8, 12, 5, 7), (6, 6, 2, 3), (9, 4, 4, 3)):
        x = torch.randn(1, 5, h, w, generator=g)
        want = torch.nn.functional.interpolate(x, [oh, ow], mode="bilinear")
        ya, yb, hy0, hy1 = _linear_taps(h, oh)
        xa, xb, wx0, wx1 = _linear_taps(w, ow)
        hy0, hy1, wx0, wx1 = hy0[:, None], hy1[:, None], wx0[None, :], wx1[None, :]
        got = hy0 * (wx0 * x[..., ya[:, None], xa[None, :]] + wx1 * x[..., ya[:, None], xb[None, :]]) \
            + hy1 * (wx0 * x[..., yb[:, None], xa[None, :]] + wx1 * x[..., yb[:, None], xb[None, :]])
        torch.testing.assert_close(got, want)
