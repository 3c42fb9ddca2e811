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
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    args = []
    for n in c.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in c.state_targets:
            kind, target = c.state_targets[n.name]
            args.append(params[target] if kind == "parameter" else buffers[target] if kind == "buffer"
                        else c.constants[target])
        elif n.name in c.input_keys:
            args.append(batch[c.input_keys[n.name]])
        else:
            args.append(c.value_inputs[n.name])
    model.zero_grad(set_to_none=True)
    loss = c.graph_module(*args)[0]
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

    def forward(self, x, gate):
        return x + self.scale * self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))) * gate


class IndexedBlock(Block):
    """Reads its layer index in the forward: every layer traces differently."""

    def forward(self, x, gate):
        y = super().forward(x, gate)
        return y * 0.5 if self.layer_idx % 2 else y


class Stack(nn.Module):
    """Blocks fed the running activation and a per-layer gate: layer ``full`` gets another gate tensor of the same
    shape (as Qwen2.5-VL feeds its full-attention blocks ``cu_seqlens`` and the others the window's)."""

    def __init__(self, block=Block, n=5, dim=8, full=3, scales=None):
        super().__init__()
        self.layers = nn.ModuleList(block(dim, i, scale=(scales or [1.0] * n)[i]) for i in range(n))
        self.full = full
        self.head = nn.Linear(dim, 1)

    def forward(self, x, target):
        gate_window, gate_full = torch.sigmoid(x), torch.tanh(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, gate_full if i == self.full else gate_window)
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), target)


def _batch(seed=0, rows=6, dim=8):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, dim, generator=g), "target": torch.randn(rows, generator=g)}


def test_each_layer_reads_its_own_parameters_and_inputs():
    """Layers 1..4 are copies of layer 0's trace; layer 3 reads the other gate; loss and every gradient (each
    layer's own) equal the eager model, for two batch sizes."""
    torch.manual_seed(0)
    model = Stack()
    for seed, rows in ((0, 6), (1, 9)):
        b = _batch(seed, rows)
        c = capture(model, b)
        assert c.reused_layers == 4
        _assert_equals_eager(c, model, b)


class NoGradStack(Stack):
    """Layer 2 runs under ``torch.no_grad()`` (its parameters get no gradient, as in eager)."""

    def forward(self, x, target):
        gate = torch.sigmoid(x)
        for i, layer in enumerate(self.layers):
            if i == 2:
                with torch.no_grad():
                    x = x + layer(x, gate)
            else:
                x = layer(x, gate)
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), target)


@pytest.mark.parametrize("case", ["layer index read in forward", "attribute differs", "hook reads inside",
                                  "called under no_grad"])
def test_layers_that_differ_are_traced(case):
    """A layer that reads its index, has another attribute value, has a hook recording a value inside it (read by
    the loss), or runs under another grad mode is never a copy of another: the graph still equals the model."""
    torch.manual_seed(0)
    recorded = []
    if case == "called under no_grad":
        model, reused = NoGradStack(), 3
    elif case == "layer index read in forward":
        model, reused = Stack(block=IndexedBlock), 0
    elif case == "attribute differs":  # layers 0, 2, 4 share scale 1.0; 1 and 3 share 2.0
        model, reused = Stack(scales=[1.0, 2.0, 1.0, 2.0, 1.0]), 3
    else:
        model, reused = Stack(), 0
        for layer in model.layers:
            layer.fc1.register_forward_hook(lambda m, a, out: recorded.append(out))
        inner = model.forward

        def forward(x, target):
            recorded.clear()
            return inner(x, target) + 1e-3 * sum(r.square().mean() for r in recorded)

        model.forward = forward
    b = _batch()
    c = capture(model, b)
    assert c.reused_layers == reused
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
