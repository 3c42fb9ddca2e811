"""Debug checks: the captured graph and the partitioned pipeline against the eager model, in one process.

``dipc.compile(..., check=True)`` (default: on when the environment variable ``DIPC_CHECK=1``, which the test suite
sets) makes every silently-wrong-result bug of capture, partition or codegen loud, before any training step:

1. :func:`check_capture` runs each new capture's graph (before any pass) on the batch it was traced with and
   compares its loss and every parameter gradient with the eager ``model(**batch)``;
2. :func:`check_pipeline` runs the partitioned chunk modules of the example batch in this process
   (:func:`dipc.runtime.run_local`, three uneven microbatches where the batch allows, one instance per
   sub-microbatch) and compares loss and gradients again: a loss whose microbatch weights dipc cannot derive, or an
   encoder that mixes a sample's images, differs there.

Both run the model and the graph under the same RNG seed, leave every ``.grad`` as it was, and are skipped for a
model on the meta device (nothing to run).  Tolerances: float32 ``|a - b| <= 1e-6 + 1e-4 * max|b|`` per tensor
(the graph runs the same ATen ops as eager; the pipeline sums microbatch gradients in another order), 16-bit
floats ``2e-2``.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .capture import is_meta  # noqa: F401  (kept importable here)

__all__ = ["check_capture", "check_pipeline", "is_meta", "loss_of"]


def loss_of(out: Any, loss_key: str = "loss") -> torch.Tensor:
    """The loss in a model's output: the tensor itself, the first of a tuple, or ``out[loss_key]`` of a mapping /
    ``ModelOutput``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out[loss_key]


def _tol(t: torch.Tensor) -> tuple[float, float]:
    if t.dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    return 1e-6, 1e-4


def _first_mismatch(got: Mapping[str, torch.Tensor | None], want: Mapping[str, torch.Tensor | None]):
    """``(name, max error, allowed)`` of the first parameter (in model order) whose gradients differ, else None.
    A gradient present on one side and ``None`` on the other differs (an optimizer skips ``None`` but applies weight
    decay and momentum to zeros)."""
    for name, w in want.items():
        g = got.get(name)
        if g is None and w is None:
            continue
        if g is None or w is None:
            return name, "missing" if g is None else "present (the eager model gives none)", 0.0
        atol, rtol = _tol(w)
        scale = float(w.detach().abs().max()) if w.numel() else 0.0
        err = float((g.detach().float() - w.detach().float()).abs().max()) if w.numel() else 0.0
        if not err <= atol + rtol * scale:  # also catches NaN
            return name, err, atol + rtol * scale
    return None


def _eager(model: torch.nn.Module, batch: Mapping[str, Any], loss_key: str, seed: int):
    """Loss and gradients of the eager model by ``loss.backward()`` (reentrant checkpoints support only that), with
    every ``.grad`` restored after."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = {id(p): p.grad for _, p in params}
    try:
        for _, p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.enable_grad():
                loss = loss_of(model(**batch), loss_key)
                if loss.requires_grad:
                    loss.backward()
        grads = {n: p.grad for n, p in params}
    finally:
        for _, p in params:
            p.grad = saved[id(p)]
    return loss.detach(), grads


def _compare(what: str, loss, want_loss, grads, want_grads, error, hint: str):
    atol, rtol = _tol(want_loss)
    if not float((loss.float() - want_loss.float()).abs()) <= atol + rtol * float(want_loss.float().abs()):
        raise error(f"{what}: loss {float(loss)!r} but the eager model gives {float(want_loss)!r}; {hint}")
    bad = _first_mismatch(grads, want_grads)
    if bad is not None:
        name, err, allowed = bad
        detail = f"is {err}" if isinstance(err, str) else f"differs by {err:.3g} (allowed {allowed:.3g})"
        raise error(f"{what}: the gradient of parameter {name!r} {detail} against the eager model; {hint}")


def check_capture(model: torch.nn.Module, cap, batch: Mapping[str, Any], *, loss_key: str = "loss",
                  seed: int = 0) -> None:
    """Run ``cap``'s graph (a :class:`dipc.capture.Capture`, before any pass) on ``batch`` and compare its loss and
    every parameter gradient with the eager model's.

    Raises:
        dipc.capture.CaptureError: the loss or a gradient differs (the message names the first parameter that
            differs, in model order), e.g. a write the trace lost or a data-dependent branch traced one way.
    """
    from .capture import CaptureError

    args = cap.arguments(model, batch)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.enable_grad():
            out = cap.graph_module(*args)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True) if loss.requires_grad else \
        [None] * len(params)
    want_loss, want = _eager(model, batch, loss_key, seed)
    shapes = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    _compare(f"the captured graph of {type(model).__name__} on a batch of shapes {shapes}", loss.detach(),
             want_loss, dict(zip((n for n, _ in params), grads)), want, CaptureError,
             "the trace does not compute the model's function (is the forward deterministic, with no dropout?)")


def check_pipeline(compiled, batch: Mapping[str, Any], *, seed: int = 0) -> None:
    """Run ``compiled``'s chunk modules on ``batch`` in this process (three uneven microbatches when the batch has
    three samples or more, one instance per sub-microbatch) and compare loss and gradients with the eager model;
    every ``.grad`` is restored after.

    Raises:
        dipc.codegen.stage.CodegenError: the partitioned pipeline's loss or a gradient differs from the eager
            model's (names the first parameter that differs).
    """
    from .codegen.stage import CodegenError
    from .runtime import run_local

    import dataclasses

    model = compiled.model
    spec = compiled.batch_spec
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = {id(p): p.grad for _, p in params}
    instances = spec.instances
    try:
        for _, p in params:
            p.grad = None
        B = spec.batch_size(spec.normalize(batch))
        # an uneven split and one instance per sub-microbatch: loss weights and encoders that are not separable
        # (a loss of several reductions, images of a sample mixed in the encoder) show here
        spec.instances = [dataclasses.replace(i, sub_microbatch_size=1) for i in instances]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            loss, _ = run_local(compiled, batch, 3 if B >= 3 else min(2, B))
        grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in params}
    finally:
        spec.instances = instances
        for _, p in params:
            p.grad = saved[id(p)]
    want_loss, want = _eager(model, compiled.batch_spec.eager_view(batch), compiled.loss_key, seed)
    _compare(f"the {compiled.pp_size}-rank pipeline of {type(model).__name__} run in one process",
             loss.detach(), want_loss, grads, want, CodegenError,
             "either the forward is not a pure function of the batch and the parameters (dropout, Python state that "
             "changes between calls) or partition/codegen changed the function (then please report this model)")
