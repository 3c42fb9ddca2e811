"""Each repeated layer traced once (dipc.repeated, issue 35 §5): the completed graph equals the model, layer by
layer, and a layer that differs from the first in anything the trace could see is traced itself.

Every check runs the captured graph (its loss and every parameter gradient) against the eager model on the same
batch; the hazards below are the ways a copied layer could be silently wrong."""
import os

import pytest
import torch
import torch.nn as nn

from dipc.capture import capture


def _graph_loss_and_grads(c, model, batch):
    model.zero_grad(set_to_none=True)
    loss = c.graph_module(*c.arguments(model, batch))[0]
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _eager_loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else out["loss"]
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_equals_eager(c, model, batch):
    loss, grads = _graph_loss_and_grads(c, model, batch)
    ref_loss, ref_grads = _eager_loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


class Block(nn.Module):
    def __init__(self, dim, layer_idx, scale=1.0):
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.0)

    def forward(self, x, gate, ctx=None):
        y = self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))
        if ctx is not None:
            ctx.inputs.append(x) if ctx.collect else None
            y = y * ctx.scale
        return x + self.scale * y * gate * (2.0 if x.requires_grad else 1.0)


class IndexedBlock(Block):
    """Reads its layer index in the forward: every layer traces differently."""

    def forward(self, x, gate, ctx=None):
        y = super().forward(x, gate, ctx)
        return y * 0.5 if self.layer_idx % 2 else y


class Ctx:
    def __init__(self, collect=False):
        self.collect, self.scale, self.inputs = collect, 1.0, []


class Stack(nn.Module):
    """Blocks fed the running activation and a per-layer gate: layer ``full`` gets another gate tensor of the same
    shape (as Qwen2.5-VL feeds its full-attention blocks ``cu_seqlens`` and the others the window's).  ``case``
    adds one hazard (:func:`test_layers_that_differ_are_traced`)."""

    def __init__(self, block=Block, n=5, dim=8, full=3, scales=None, case=None):
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(block(dim, i, scale=(scales or [1.0] * n)[i]) for i in range(n))
        self.full, self.case = full, case
        self.head = nn.Linear(dim, 1)
        self.ctx = Ctx(collect=case == "input handed to a collector")

    def forward(self, x, target):
        x = self.pre(x)
        gate_window, gate_full = torch.sigmoid(x), torch.tanh(x)
        self.ctx.inputs.clear()
        for i, layer in enumerate(self.layers):
            gate = gate_full if i == self.full else gate_window
            if self.case == "called under no_grad" and i == 2:
                with torch.no_grad():
                    x = x + layer(x, gate)
            elif self.case == "input detached" and i == 2:
                x = layer(x.detach(), gate)
            elif self.case == "parent sets an attribute":
                layer.scale = 1.0 + i
                x = layer(x, gate)
            elif self.case in ("mutable argument", "input handed to a collector"):
                self.ctx.scale = 1.0 + i
                x = layer(x, gate, self.ctx)
            else:
                x = layer(x, gate)
        extra = sum(t.square().mean() for t in self.ctx.inputs) if self.ctx.inputs else 0.0
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), target) + 1e-2 * extra


def _batch(seed=0, rows=6, dim=8):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, dim, generator=g), "target": torch.randn(rows, generator=g)}


def test_each_layer_reads_its_own_parameters_and_inputs(monkeypatch):
    """Layers 1..4 are copies of layer 0's trace; layer 3 reads the other gate; loss and every gradient (each
    layer's own) equal the eager model, for two batch sizes."""
    monkeypatch.setenv("DIPC_REUSE_BLOCKS", "all")  # these layers' class is the test's own (not trusted)
    torch.manual_seed(0)
    model = Stack()
    for seed, rows in ((0, 6), (1, 9)):
        b = _batch(seed, rows)
        c = capture(model, b)
        assert c.reused_layers == 4
        _assert_equals_eager(c, model, b)


def test_layers_of_untrusted_classes_are_traced_by_default():
    """By default only layer classes from torch.nn, transformers, diffusers, timm and dipc.models (pure forwards:
    activation checkpointing re-runs them) are copied; a model's own class is traced unless the user opts in."""
    torch.manual_seed(0)
    model, b = Stack(), _batch()
    c = capture(model, b)
    assert c.reused_layers == 0
    _assert_equals_eager(c, model, b)


def _hook_per_layer(model, recorded):
    for i, layer in enumerate(model.layers):
        layer.fc1.register_forward_hook(lambda m, a, out, i=i: recorded.append(out * (1.0 + i)))


CASES = {  # case -> (model, layers copied)
    "layer index read in forward": (lambda: Stack(block=IndexedBlock), 0),
    "attribute differs": (lambda: Stack(scales=[1.0, 2.0, 1.0, 2.0, 1.0]), 3),  # 0, 2, 4 alike; 1, 3 alike
    "called under no_grad": (lambda: Stack(case="called under no_grad"), 2),  # 3 gets a no-grad input
    "input detached": (lambda: Stack(case="input detached"), 3),  # the layer branches on requires_grad
    "parent sets an attribute": (lambda: Stack(case="parent sets an attribute"), 0),
    "mutable argument": (lambda: Stack(case="mutable argument"), 0),
    "input handed to a collector": (lambda: Stack(case="input handed to a collector"), 0),
    "one layer in eval mode": (lambda: Stack(), 3),
    "hook reads inside": (lambda: Stack(), 0),
    "hook with a per-layer value": (lambda: Stack(), 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layers_that_differ_are_traced(case, monkeypatch):
    """A layer that differs from the first in anything its trace could depend on is traced itself (the helper
    sweep's hazards): its index read in the forward, another attribute value, another grad mode, an input that does
    not require grad, an attribute or argument object the parent changes between layers, an input the layer hands
    to the parent, eval mode, a hook reading inside it or a hook holding a per-layer value.  Loss and every
    gradient equal eager."""
    monkeypatch.setenv("DIPC_REUSE_BLOCKS", "all")
    torch.manual_seed(0)
    make, reused = CASES[case]
    model = make()
    recorded = []
    if case == "one layer in eval mode":
        for layer in model.layers:
            layer.drop.p = 0.5
        model.layers[2].eval()
    if case in ("hook reads inside", "hook with a per-layer value"):
        if case == "hook reads inside":
            for layer in model.layers:
                layer.fc1.register_forward_hook(lambda m, a, out: recorded.append(out))
        else:
            _hook_per_layer(model, recorded)
        inner = model.forward

        def forward(x, target):
            recorded.clear()
            return inner(x, target) + 1e-3 * sum(r.square().mean() for r in recorded)

        model.forward = forward
    b = _batch()
    torch.manual_seed(1)  # dropout: the graph and eager draw the same masks
    c = capture(model, b)
    assert c.reused_layers == reused
    torch.manual_seed(2)
    loss, grads = _graph_loss_and_grads(c, model, b)
    torch.manual_seed(2)
    ref_loss, ref_grads = _eager_loss_and_grads(model, b)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


def test_layers_tied_to_another_list_are_traced(monkeypatch):
    """Two lists tied layer by layer (``dec[i].fc1.weight is enc[i].fc1.weight``): torch.export names each tied
    weight after one of its modules (here ``dec``), so a copy of either list's first layer would read layer 0's
    weight: both lists are traced."""
    monkeypatch.setenv("DIPC_REUSE_BLOCKS", "all")
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = Stack(n=4), Stack(n=4)
            for a, b in zip(self.enc.layers, self.dec.layers):
                b.fc1.weight = a.fc1.weight

        def forward(self, x, target):
            return self.enc(x, target) + self.dec(x * 2, target)

    model, b = Tied(), _batch()
    c = capture(model, b)
    assert c.reused_layers == 0  # neither list: torch.export may name the tied weights after either
    _assert_equals_eager(c, model, b)


def test_reference_vlm_partitions_and_trains_alike_with_and_without_reuse():
    """The reference VLM (4 vision + 4 text layers) compiles to the same chunks (each chunk's parameters) with and
    without reuse, and its partitioned pipeline equals the unsplit model (dipc.compile's check, on in the tests)."""
    import pipeline_cases as pc

    import dipc

    torch.manual_seed(0)
    model = pc.vlm()
    batch = pc.vlm_batch([1, 2, 0, 1], 16, 0)
    chunks = {}
    for reuse in ("1", "0"):
        os.environ["DIPC_REUSE_BLOCKS"] = reuse
        try:
            c = dipc.compile(model, batch, 2, check=True)
        finally:
            os.environ.pop("DIPC_REUSE_BLOCKS")
        prog = c.programs[0]
        assert prog.capture.reused_layers == (6 if reuse == "1" else 0)
        chunks[reuse] = {k: sorted(n for n, _ in prog.module(k).named_parameters()) for k in prog.chunks}
    assert chunks["1"] == chunks["0"]


def test_a_list_at_fault_is_traced_and_the_others_still_copied(monkeypatch):
    """Two lists; a hook reads inside the first's layers (its copies would not feed it): the capture is made again
    with that list traced and the second list's layers still copied; equal to eager."""
    monkeypatch.setenv("DIPC_REUSE_BLOCKS", "all")
    torch.manual_seed(0)
    recorded = []

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = Stack(n=4), Stack(n=4)
            for layer in self.enc.layers:
                layer.fc1.register_forward_hook(lambda m, a, out: recorded.append(out))

        def forward(self, x, target):
            recorded.clear()
            loss = self.enc(x, target) + self.dec(x * 2, target)
            return loss + 1e-3 * sum(r.square().mean() for r in recorded)

    model, b = Two(), _batch()
    c = capture(model, b)
    assert c.reused_layers == 3  # dec's
    _assert_equals_eager(c, model, b)
