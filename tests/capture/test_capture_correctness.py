"""Silent-wrong-result regressions of capture (issue 7 §1), checked in one process against the eager model.

* in-place writes into views (``mask[:, -2:] = 0``, ``index_put_``, ``masked_fill_``, ``copy_`` into a slice) have
  no users in torch.export's training IR; capture makes such graphs functional so no pass can drop them;
* the debug check (``dipc.compile(check=True)``, on in this suite through ``DIPC_CHECK=1``) names the first
  parameter whose gradient differs when a trace does not compute the model's function;
* a capture made for one set of batch keys is never reused for a batch with other keys.
"""
import pytest
import torch

import dipc
from dipc.testing import local_check


class _Layer(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class MaskWrites(torch.nn.Module):
    """Four layers and the in-place writes Hugging Face code is full of."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(4)])

    def forward(self, x, y):
        B, S, _ = x.shape
        mask = torch.ones(B, S, 1)
        if self.kind == "slice":
            mask[:, -2:] = 0
        elif self.kind == "index_put":
            mask.index_put_((torch.arange(B), torch.zeros(B, dtype=torch.long)), torch.tensor(0.0))
        elif self.kind == "masked_fill":
            mask.masked_fill_(torch.arange(S).view(1, S, 1) >= S - 1, 0.5)
        elif self.kind == "copy":
            mask[:, :1].copy_(torch.full((B, 1, 1), 3.0))
        pos = torch.zeros(B, S)
        pos[:, 1:] = torch.arange(1, S)  # position_ids[:, b] = ... style
        x = x + pos.unsqueeze(-1) * 0.01
        for layer in self.layers:
            x = layer(x) * mask
        return ((x - y) ** 2).mean()


def _batch(B=4, S=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, S, 8, generator=g), "y": torch.randn(B, S, 8, generator=g)}


@pytest.mark.parametrize("kind", ["slice", "index_put", "masked_fill", "copy"])
def test_in_place_writes_are_kept(kind):
    torch.manual_seed(0)
    model = MaskWrites(kind)
    c = dipc.compile(model, _batch(), 2, check=True)
    assert c.program.capture.functionalized
    for seed, n_mb in ((1, 2), (2, 4)):
        local_check(model, c, _batch(4, 5 + seed, seed), n_mb)


def test_check_names_the_first_parameter_a_lost_write_changes(monkeypatch):
    """With functionalization disabled (the bug as it was), the debug check refuses the capture and names the
    parameter whose gradient is wrong."""
    import dipc.capture as capmod

    monkeypatch.setattr(capmod, "_mutating_ops", lambda graph: [])
    torch.manual_seed(0)
    with pytest.raises(dipc.CaptureError, match=r"gradient of parameter 'layers\.0\.lin\.(weight|bias)'|loss "):
        dipc.compile(MaskWrites("slice"), _batch(), 2, check=True)


class CallCounter(torch.nn.Module):
    """A forward that depends on Python state the trace freezes: the trace is not the model's function."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(2)])
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        for layer in self.layers:
            x = layer(x) * float(self.calls)
        return ((x - y) ** 2).mean()


def test_check_catches_a_trace_that_is_not_the_model():
    """torch.export restores the counter after tracing, so the capture itself matches the next eager call; the
    pipeline check (the following call) catches it."""
    from dipc.codegen.stage import CodegenError

    torch.manual_seed(0)
    with pytest.raises(CodegenError, match=r"the 2-rank pipeline of CallCounter run in one process: loss .* but the "
                                           r"eager model gives .*not a pure function"):
        dipc.compile(CallCounter(), _batch(), 2, check=True)
    torch.manual_seed(0)
    dipc.compile(CallCounter(), _batch(), 2, check=False)  # without the check it compiles (and would be wrong)


class OptionalExtra(torch.nn.Module):
    """Takes an optional per-sample key; a capture without it must not serve a batch with it."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(2)])
        self.extra = torch.nn.Linear(8, 8)

    def forward(self, x, y, extra=None):
        if extra is not None:
            x = x + self.extra(extra)
        for layer in self.layers:
            x = layer(x)
        return ((x - y) ** 2).mean()


def test_capture_without_a_key_is_not_reused_for_a_batch_with_it():
    torch.manual_seed(0)
    model = OptionalExtra()
    c = dipc.compile(model, _batch(), 2, check=True)
    assert c.program.capture.keys == frozenset({"x", "y"})
    with_extra = dict(_batch(4, 6, 3), extra=torch.randn(4, 6, 8))
    assert not c.program.capture.fits(with_extra)
    assert c.program.capture.fits(_batch(4, 7, 3))
