"""Regressions from a break-it pass, in one process against the eager model (dipc.testing.local_check): how the
loss reduces over a batch (read from the graph, not guessed from key names), graphs valid only for some sizes,
gradients that are None in eager, writes into slices of values that carry a gradient, ``**kwargs`` forwards, and
the errors for models dipc cannot train."""
import pytest
import torch
import torch.nn.functional as F

import dipc
from dipc.batch import BatchError
from dipc.passes.partition import PartitionError
from dipc.testing import local_check

V, D = 32, 8


class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D) for _ in range(4)])
        self.head = torch.nn.Linear(D, V)

    def hidden(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


class Classifier(Body):
    """``labels [B]``: a mean cross-entropy over samples (no shift: a token-mean guess would drop a sample)."""

    def forward(self, input_ids, labels):
        return F.cross_entropy(self.head(self.hidden(input_ids).mean(1)), labels)


class MaskedLM(Body):
    """BERT-style: labels not shifted, position 0 counted, padding ignored with id 0."""

    def forward(self, input_ids, targets):
        logits = self.head(self.hidden(input_ids))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=0)


def _tokens(B, S, seed, lo=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, V, (B, S), generator=g)


def test_classifier_labels_are_weighted_by_samples():
    torch.manual_seed(0)
    model = Classifier()
    ex = {"input_ids": _tokens(4, 5, 0), "labels": torch.tensor([1, 2, 3, 4])}
    c = dipc.compile(model, ex, 2, check=True)
    assert c.batch_spec.loss.kind == "token_mean" and not c.batch_spec.loss.shift
    for B, n_mb in ((5, 2), (7, 3), (3, 2)):  # uneven microbatches
        local_check(model, c, {"input_ids": _tokens(B, 6, B), "labels": torch.arange(B) % V}, n_mb)


def test_unshifted_targets_under_another_key_with_their_own_ignore_index():
    torch.manual_seed(0)
    model = MaskedLM()
    t = _tokens(4, 6, 1)
    t[:, 3:] = 0
    c = dipc.compile(model, {"input_ids": _tokens(4, 6, 0), "targets": t}, 2, check=True)
    lr = c.batch_spec.loss
    assert (lr.kind, lr.labels_key, lr.ignore_index, lr.shift) == ("token_mean", "targets", 0, False)
    t = _tokens(5, 7, 3)
    t[0, 1:] = 0  # sample 0 counts only its position 0
    t[3, :4] = 0
    local_check(model, c, {"input_ids": _tokens(5, 7, 2), "targets": t}, 2)


class SizeBranch(Body):
    """Valid for one side of a size only: ``seq > 8`` halves the hidden state."""

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        if input_ids.shape[1] > 8:
            h = h * 0.5
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def test_a_graph_is_not_reused_outside_the_sizes_it_was_traced_for():
    torch.manual_seed(0)
    model = SizeBranch()
    ids = _tokens(4, 6, 0)
    c = dipc.compile(model, {"input_ids": ids, "labels": ids}, 2, check=True)
    for S in (10, 5, 12):
        ids = _tokens(4, S, S)
        local_check(model, c, {"input_ids": ids, "labels": ids}, 2)
    assert len(c.programs) >= 2


class Detached(Body):
    """A layer behind .detach() and one under no_grad: the eager model gives their parameters no gradient (AdamW
    then skips them; a zero gradient would still decay them)."""

    def forward(self, input_ids, labels):
        h = self.layers[0](self.emb(input_ids))
        h = h + self.layers[1](h).detach()
        with torch.no_grad():
            t = self.layers[2](h)
        logits = self.head(self.layers[3](h + t))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def test_parameters_behind_detach_or_no_grad_get_no_gradient():
    torch.manual_seed(0)
    model = Detached()
    ids = _tokens(4, 6, 0)
    c = dipc.compile(model, {"input_ids": ids, "labels": ids}, 2, check=True)
    ids = _tokens(5, 7, 1)
    local_check(model, c, {"input_ids": ids, "labels": ids}, 2)  # None where eager has None, not zeros
    from dipc.runtime import run_local
    run_local(c, {"input_ids": ids, "labels": ids}, 2)
    assert model.layers[1].weight.grad is None and model.layers[2].weight.grad is None
    assert model.layers[0].weight.grad is not None


class SliceWrite(torch.nn.Module):
    """``h[:, 0] = h[:, 0] * 2`` on a value that carries a gradient (functionalized into a copy)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, y, **kwargs):  # extra batch keys land in **kwargs, as in Hugging Face forwards
        h = self.layers[1](self.layers[0](x))
        h[:, 0] = h[:, 0] * 2
        if "scale" in kwargs:
            h = h * kwargs["scale"][:, None]
        return F.mse_loss(self.layers[2](h), y)


def test_a_slice_write_of_a_gradient_carrying_value_and_kwargs_keys():
    torch.manual_seed(0)
    model = SliceWrite()
    g = torch.Generator().manual_seed(0)
    mk = lambda B: {"x": torch.randn(B, 4, generator=g), "y": torch.randn(B, 4, generator=g),  # noqa: E731
                    "scale": torch.rand(B, generator=g)}
    c = dipc.compile(model, mk(4), 2, check=True)
    local_check(model, c, mk(6), 3)


class TupleOut(Body):
    def forward(self, input_ids, labels):
        logits = self.head(self.hidden(input_ids))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)), logits


class VectorLoss(Body):
    def forward(self, input_ids, labels):
        return F.cross_entropy(self.head(self.hidden(input_ids)).transpose(1, 2), labels, reduction="none").mean(1)


class Autocast(Body):
    def forward(self, input_ids, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.head(self.hidden(input_ids))
        return F.cross_entropy(logits.float()[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def test_outputs_and_models_dipc_refuses():
    torch.manual_seed(0)
    ids = _tokens(4, 6, 0)
    batch = {"input_ids": ids, "labels": ids}
    model = TupleOut()
    c = dipc.compile(model, batch, 2, check=True)  # (loss, logits): the loss is the first
    local_check(model, c, {"input_ids": _tokens(4, 7, 1), "labels": _tokens(4, 7, 1)}, 2)
    with pytest.raises(dipc.CaptureError, match=r"the loss of VectorLoss has shape \[s\d+\]; dipc trains a model "
                                                r"whose forward returns the scalar batch loss"):
        dipc.compile(VectorLoss(), batch, 2)
    with pytest.raises(dipc.CaptureError, match=r"Autocast's forward runs a torch.autocast region"):
        dipc.compile(Autocast(), batch, 2)
    with pytest.raises(PartitionError, match=r"split_points\['text'\] must be a list of module paths, got 'layers.2'"):
        dipc.compile(Classifier(), {"input_ids": ids, "labels": torch.tensor([1, 2, 3, 4])}, 2,
                     split_points={"text": "layers.2"})


def test_runtime_and_compile_arguments_out_of_range_are_refused_before_any_communication():
    """No process group is needed to refuse them: each raises at construction, naming the value."""
    torch.manual_seed(0)
    ids = _tokens(4, 6, 0)
    c = dipc.compile(TupleOut(), {"input_ids": ids, "labels": ids}, 2)
    for kw, pat in [({"n_microbatches": 0}, r"n_microbatches must be an int >= 1, got 0"),
                    ({"n_microbatches": True}, r"n_microbatches must be an int >= 1, got True"),
                    ({"n_microbatches": 2.0}, r"n_microbatches must be an int >= 1, got 2.0"),
                    ({"timeout": 0}, r"timeout must be a finite number of seconds >= 1, got 0"),
                    ({"timeout": -5.0}, r"timeout must be a finite number of seconds >= 1, got -5.0"),
                    # issue 39 §3: a wait of a millisecond times out on a healthy pipeline and breaks the group
                    ({"timeout": 1e-3}, r"timeout must be a finite number of seconds >= 1, got 0.001"),
                    ({"plan_wait_s": -1}, r"plan_wait_s must be a finite number of seconds >= 0, got -1"),
                    ({"simulate_steps": "no"}, r"simulate_steps must be a bool, got 'no'"),
                    ({"fallback_schedule": "zigzag"}, r"zigzag")]:
        with pytest.raises(ValueError, match=pat):
            c.runtime(**kw)
    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.data import vlm_batches
    cfg = VLMConfig.tiny()
    b = next(iter(vlm_batches(cfg, 1, 4, 0)))
    with pytest.raises(ValueError, match=r"sub_microbatch_size for 'vision' must be an int >= 1, got 1.5"):
        dipc.compile(ReferenceVLM(cfg), b, 2, sub_microbatch_size={"vision": 1.5})


class BatchNormed(Body):
    """torch's BatchNorm1d in training mode updates its running statistics in the forward."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(D)

    def forward(self, input_ids, labels):
        h = self.norm(self.hidden(input_ids).transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(self.head(h)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def test_a_model_that_updates_buffers_in_training_is_refused_at_compile():
    """Per sub-microbatch the running statistics would update several times and num_batches_tracked not at all:
    refused, naming the buffers, instead of training silently otherwise than the unsplit model."""
    torch.manual_seed(0)
    ids = _tokens(4, 6, 0)
    with pytest.raises(dipc.CaptureError, match=r"mutates state in place .*norm\.running_mean.*BatchNorm"):
        dipc.compile(BatchNormed(), {"input_ids": ids, "labels": ids}, 2)
    model = BatchNormed().eval()  # eval-mode norms read their statistics only: accepted and exact
    c = dipc.compile(model, {"input_ids": ids, "labels": ids}, 2)
    local_check(model, c, {"input_ids": _tokens(4, 7, 1), "labels": _tokens(4, 7, 1)}, 2)


def test_split_points_as_one_list_and_misspelled_keys_are_named():
    """Issue 39 §3: ``split_points`` as one list of module paths (torch.distributed.pipelining's form) cuts like the
    per-modality dict; other forms are refused naming the forms taken; a batch with a misspelled key names it and
    the key it probably meant."""
    torch.manual_seed(0)
    ids = _tokens(4, 6, 0)
    batch = {"input_ids": ids, "labels": torch.tensor([1, 2, 3, 4])}
    model = Classifier()
    c = dipc.compile(model, batch, 2, split_points=["layers.2"])
    by_dict = dipc.compile(model, batch, 2, split_points={c.partition.modalities[0]: ["layers.2"]})
    assert [ch.blocks for ch in c.partition.chunks] == [ch.blocks for ch in by_dict.partition.chunks]
    local_check(model, c, {"input_ids": _tokens(4, 5, 1), "labels": torch.tensor([0, 3, 2, 1])}, 2)
    for bad, pat in (("layers.2", r"split_points='layers.2': split_points takes a list of module paths"),
                     ([2], r"split_points=\[2\]: split_points takes a list of module paths"),
                     (["layers.9"], r"split point 'layers.9' is not a module the model calls")):
        with pytest.raises(PartitionError, match=pat):
            dipc.compile(model, batch, 2, split_points=bad)
    with pytest.raises(BatchError, match=r"batch is missing key\(s\) \['labels'\] of the example batch; has "
                                         r"key\(s\) \['lables'\] that the example batch did not have \(did you "
                                         r"mean 'labels' for 'lables'\?\)"):
        c.batch_spec.split({"input_ids": ids, "lables": batch["labels"]}, 2)


class ScaledLM(Body):
    """Takes a Python float (``scale``) and a list of flags as batch values: constants of the trace."""

    def forward(self, input_ids, labels, scale, flags):
        logits = self.head(self.hidden(input_ids) * scale)
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def test_the_step_digest_covers_python_values():
    """Issue 39 §4: ranks given batches that differ only in a Python value (a shared float) used to run the step
    with each rank's own value (a loss mixing both); the digest every rank compares now covers Python values, as
    JSON, the form the background planner receives them in (a tuple and a list of the same items agree)."""
    from dipc.planner import build_workload, split_for, step_digest

    torch.manual_seed(0)
    ids = _tokens(4, 6, 0)
    c = dipc.compile(ScaledLM(), {"input_ids": ids, "labels": ids, "scale": 0.5, "flags": (1, 0)}, 2)

    def digest(**values):
        batch = dict({"input_ids": ids, "labels": ids, "scale": 0.5, "flags": (1, 0)}, **values)
        return step_digest(c, build_workload(c, split_for(c, batch, 2)))

    assert digest() != digest(scale=3.0)
    assert digest() == digest(flags=[1, 0]) != digest(flags=(0, 1))
