"""Check a pipeline against the unsplit model (the project's correctness rule, DESIGN.md "Numerics").

:func:`reference_check` runs inside each rank of a process group (e.g. under :func:`dipc.launch.spawn`): it
builds the model twice from the same seed, compiles one copy into a pipeline and keeps the other whole, then for
every batch compares the loss and every local parameter's gradient, applies one AdamW step to both and compares the
parameters.  At the end it gathers the pipeline's state dict under the original names, loads it into a fresh
unsplit model, checks every tensor arrived bit-exactly and that the fresh model's loss equals the pipeline's.  Everything is asserted in the rank, with the tolerance
given; the function returns the largest errors it saw, for reports.
"""
from __future__ import annotations

import copy
import importlib
import time
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["reference_check", "local_check", "resolve", "unsplit_loss"]


def resolve(path: str) -> Callable:
    """``"package.module:function"`` -> the function (so specs stay picklable across processes)."""
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


def unsplit_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], loss_key: str = "loss") -> torch.Tensor:
    """The loss of the whole model on ``batch`` (accepts a tensor or a mapping/ModelOutput output)."""
    from .check import loss_of
    return loss_of(model(**batch), loss_key)


def local_check(model: torch.nn.Module, compiled, batch: Mapping[str, Any], n_microbatches: int = 2,
                rtol: float = 1e-5, atol: float = 1e-6, loss_key: str = "loss", **run_kwargs) -> float:
    """Run one step of ``compiled`` for every rank in this process (:func:`dipc.runtime.run_local`, given
    ``run_kwargs`` such as ``schedule="1f1b"`` or ``memory_limit=``) and assert its
    loss and every parameter gradient equal the eager ``model``'s on ``batch`` (a parameter the eager model gives
    no gradient may get none or zeros).  Gradients are left cleared.  Returns the largest gradient difference.

    Raises:
        AssertionError: the loss or a gradient differs beyond ``rtol`` / ``atol``.
    """
    from .runtime import run_local

    model.zero_grad(set_to_none=True)
    ref = unsplit_loss(model, compiled.batch_spec.eager_view(batch), loss_key)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss, _ = run_local(compiled, batch, n_microbatches, **run_kwargs)
    torch.testing.assert_close(loss, ref.detach(), rtol=rtol, atol=atol)
    worst = 0.0
    for n, p in model.named_parameters():
        if n in want:
            assert p.grad is not None, f"gradient of {n} is missing"
            torch.testing.assert_close(p.grad, want[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
            worst = max(worst, _max_err(p.grad, want[n]))
        else:
            assert p.grad is None or not p.grad.any(), f"gradient of {n} is unexpected"
    model.zero_grad(set_to_none=True)
    return worst


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def reference_check(rank: int, world: int, model_fn: str, model_args: Sequence[Any], batches_fn: str,
                    batches_args: Sequence[Any], compile_kwargs: Mapping[str, Any] | None = None,
                    n_microbatches: int = 2, seed: int = 0, lr: float = 1e-3, rtol: float = 1e-5,
                    atol: float = 1e-6, param_atol: float = 1e-5, check_state_dict: bool = True,
                    runtime_kwargs: Mapping[str, Any] | None = None, prefetch: bool = False) -> dict:
    """Train a pipeline and the unsplit model side by side and assert they agree (see the module docstring).

    Args:
        rank, world: this rank and the pipeline size (the default process group).
        model_fn, model_args: ``"module:function"`` building the model (called after ``torch.manual_seed(seed)``).
        batches_fn, batches_args: ``"module:function"`` returning a list of batches; the first is the example
            batch for compilation, the rest are the training steps.
        compile_kwargs: extra arguments of :func:`dipc.compile`.
        runtime_kwargs: extra arguments of :meth:`dipc.CompiledPipeline.runtime` (e.g. ``recompute=True``).
        prefetch: iterate the steps through :func:`dipc.prefetch`, so each step's plan is made by the background
            planner while the previous step runs (asynchronous planning); the report's ``sources`` lists where each
            step's plan came from.
        n_microbatches: microbatches per step.
        lr: AdamW learning rate.
        rtol, atol: tolerance for losses and gradients (fp32; differences come only from summing microbatch
            gradients in another order than one big batch's matmuls).
        param_atol: tolerance for parameters after AdamW steps (Adam divides by sqrt(v): a gradient element near
            zero with a rounding-level difference can move its update by up to ``lr``, so parameters are compared
            with a looser absolute tolerance than gradients).  Over many steps the two runs drift apart this way and
            later gradients are computed on slightly different weights, so keep checks to a few steps (3-5).

    Returns:
        ``{"loss": [...], "grad_err": float, "param_err": float, "n_params": int, "timing": [...],
        "compile_s": seconds of dipc.compile, "n_programs": captures made by the end}``.

    Raises:
        AssertionError: a loss, gradient or parameter differs beyond tolerance.
    """
    import dipc

    batches = resolve(batches_fn)(*batches_args)
    torch.manual_seed(seed)
    model = resolve(model_fn)(*model_args)
    ref = copy.deepcopy(model)
    t0 = time.perf_counter()
    compiled = dipc.compile(model, batches[0], world, **dict(compile_kwargs or {}))
    compile_s = time.perf_counter() - t0
    pipe = compiled.runtime(n_microbatches=n_microbatches, **dict(runtime_kwargs or {}))
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    report = {"loss": [], "ref_loss": [], "grad_err": 0.0, "param_err": 0.0, "n_params": 0, "timing": [],
              "compile_s": compile_s, "n_programs": 0}
    report["sources"] = []
    steps = dipc.prefetch(batches[1:]) if prefetch else batches[1:]
    for i, batch in enumerate(steps):
        loss = pipe.step(batch)
        report["sources"].append(pipe.last_report.plan_source)
        ref_loss = unsplit_loss(ref, batch)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"rank {rank} step {i}: loss differs: {m}")
        report["loss"].append(float(loss))
        report["ref_loss"].append(float(ref_loss.detach()))
        report["timing"].append(dict(pipe.last_timing))
        for name, p in pipe.named_parameters():
            rp = ref_params[name]
            if rp.grad is None and p.grad is None:
                continue
            assert p.grad is not None and rp.grad is not None, \
                f"rank {rank} step {i}: gradient of {name} is {'missing' if p.grad is None else 'unexpected'}"
            torch.testing.assert_close(p.grad, rp.grad, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} step {i}: gradient of {name} differs: {m}")
            report["grad_err"] = max(report["grad_err"], _max_err(p.grad, rp.grad))
        report["n_params"] = len(pipe.named_parameters())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=param_atol,
                                       msg=lambda m: f"rank {rank} step {i}: parameter {name} differs: {m}")
            report["param_err"] = max(report["param_err"], _max_err(p, ref_params[name]))
    report["n_programs"] = len(compiled.programs)
    report["fallbacks"] = pipe.fallbacks
    if check_state_dict:
        sd = pipe.full_state_dict()
        torch.manual_seed(seed + 1)
        fresh = resolve(model_fn)(*model_args)
        missing, unexpected = fresh.load_state_dict(sd, strict=False)
        assert not unexpected, f"state dict has names the model does not know: {unexpected}"
        persistent_missing = [m for m in missing if m in fresh.state_dict()]
        assert not persistent_missing, f"state dict lacks {persistent_missing}"
        for name, t in fresh.state_dict().items():
            assert torch.equal(t, sd[name]), f"{name} did not load bit-exactly"
        with torch.no_grad():
            a = unsplit_loss(fresh, batches[-1])
        b = pipe.step(batches[-1])  # the pipeline's own loss with the same parameters (no optimizer step)
        opt.zero_grad()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                                   msg=lambda m: f"loaded state dict gives another loss than the pipeline: {m}")
        report["state_dict_loss"] = (float(a), float(b))
    pipe.close()
    return report
