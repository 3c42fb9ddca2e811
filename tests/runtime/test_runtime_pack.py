"""Messages travel as one packed buffer (dipc.runtime.messages._pack / _unpack): every dtype and shape comes back exactly."""
import torch

from dipc.plan import TensorSpec
from dipc.runtime.messages import _layout, _pack, _unpack


def _spec(name, t):
    return TensorSpec(name, tuple(t.shape), str(t.dtype).replace("torch.", ""))


def test_pack_round_trip_mixed_dtypes_and_shapes():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "h": torch.randn(3, 5, generator=g),
        "ids": torch.randint(0, 100, (7,), generator=g),
        "mask": torch.rand(2, 3, generator=g) > 0.5,
        "bf": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 8),
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }
    specs = [_spec(k, v) for k, v in tensors.items()]
    buf = _pack(list(tensors.values()), specs, torch.device("cpu"))
    offsets, total = _layout(specs)
    assert buf.dtype == torch.uint8 and buf.numel() == total and int(buf[-8:].view(torch.int64)) == 0
    assert all(o % 64 == 0 for o in offsets)
    received = torch.empty(total, dtype=torch.uint8)
    received.copy_(buf)
    out = _unpack(received, specs)
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert torch.equal(out[k], v), k


def test_every_message_ends_with_a_status_word_and_abort_messages_carry_the_failing_rank():
    """The status word (0: data; r + 1: rank r failed first, no data) is how a failure reaches a peer blocked in a
    receive (Executor.run drains the plan with abort messages); it costs a copy of single-tensor messages, which
    were sent without one before."""
    from dipc.runtime.messages import _status
    t = torch.randn(4, 4)
    spec = [_spec("h", t)]
    buf = _pack([t], spec, torch.device("cpu"))
    assert buf.numel() == t.numel() * 4 + 8 and int(_status(buf).item()) == 0
    assert torch.equal(_unpack(buf.clone(), spec)["h"], t)
    odd = [_spec("b", torch.zeros(3, dtype=torch.bool))]  # 3 bytes: the status word is 8-byte aligned
    abort = _pack([], odd, torch.device("cpu"), status=3)
    assert abort.numel() == _layout(odd)[1] == 16 and int(_status(abort).item()) == 3
    assert not abort[:8].any()  # no data, no stale memory
