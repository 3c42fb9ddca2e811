"""Op-selective recompute (issue "Memory strategies" §1, §3, §5): the executor runs a "selective" forward as one
activation checkpoint keeping its matmul, attention and convolution outputs; the loss and every gradient equal the
unsplit model's, beside the other strategies ("keep", per-layer "recompute:k" and "recompute:k/g"); the bytes each
forward really keeps (measured: dipc.runtime.selective.kept_bytes) are within 10% of the cost model's figure for
every strategy; the planner offers selective to every pair and chooses it
under a memory limit."""
import dataclasses

import pytest
import torch

import dipc
import pipeline_cases as pc
from dipc.planner.options import memory_options
from dipc.runtime import run_local


def _check(model, c, batch, n_microbatches=2, turn=0):
    def strategy(a, n):  # every strategy side by side, on every chunk
        return ["selective", "keep", "recompute:1", f"recompute:{n}", f"recompute:{n}/{n}",
                f"recompute:{n}/{min(2, n)}"][(a.chunk + 3 * a.mb + turn) % 6]

    w, measured = pc.run_with_strategies(model, c, batch, n_microbatches, strategy)
    seen = set()
    for fk, (how, got) in sorted(measured.items()):
        opts = {o[0]: o for o in memory_options(w, fk)}
        assert "selective" in opts and opts["selective"][1] < opts["keep"][1], (fk, list(opts))
        # it recomputes the cheap ops only: less than the whole forward again
        assert 0 < opts["selective"][2] < w.graph.stages[fk].latency, (fk, opts["selective"])
        want_bytes = opts[how][1]
        # every strategy within 10%, the per-layer ones too (a storage several layers save counts at the last)
        assert abs(got - want_bytes) <= 0.10 * want_bytes, (fk, how, got, want_bytes)
        seen.add(how.split("/")[0].rstrip("0123456789"))
    return seen


def _every_strategy(model, batches, turns):
    """Compile ``model`` for 2 ranks on the H800 profile and check it on batches 2 (a text-only microbatch first)
    and 1 (one last) in turn, the strategies shifted by ``turns`` (:func:`_check`); the strategy kinds seen."""
    torch.manual_seed(0)
    c = dipc.compile(model, batches[0], 2, check=False, device="h800")
    seen = set()
    for turn in range(turns):
        seen |= _check(model, c, batches[2 - turn % 2], turn=3 * turn)
    return seen


def test_selective_recompute_on_the_reference_vlm():
    torch.manual_seed(0)
    seen = _every_strategy(pc.vlm(), pc.vlm_batches_mixed(), 2)
    assert seen == {"keep", "selective", "recompute:"}, seen


@pytest.mark.hf
@pytest.mark.slow
def test_selective_recompute_on_hugging_face_llava():
    torch.manual_seed(0)
    seen = _every_strategy(pc.llava(), pc.llava_batches_mixed(), 2)
    assert {"keep", "selective"} <= seen, seen


def test_the_planner_chooses_selective_recompute_under_a_memory_limit():
    """Under a limit between the plan's free peak and its static state, the DIP plan gives some pairs the
    selective strategy, and the step still equals the unsplit model (on a profile without a host link: with one,
    offload is the cheaper choice at this limit, test_offload.py)."""
    from dipc.sim.device import DeviceProfile
    torch.manual_seed(0)
    model = pc.vlm()
    batches = pc.vlm_batches_mixed()
    dev = dataclasses.replace(DeviceProfile.load("h800"), host_bandwidth=None)
    c = dipc.compile(model, batches[0], 2, check=False, device=dev)
    free, _ = dipc.simulate(c, batches[2], 4)
    static = max(c.rank_state_bytes())
    limit = static + 0.6 * (max(free.peak_memory) - static)
    sim, plan = dipc.simulate(c, batches[2], 4, memory_limit=limit)
    used = {a.strategy for _, a in plan.compute_actions()}
    assert "selective" in used and max(sim.peak_memory) <= limit, (used, sim.peak_memory, limit)
    model.zero_grad(set_to_none=True)
    ref = model(**batches[2])
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss, _ = run_local(c, batches[2], 4, plan)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for k, p in model.named_parameters():
        if k in want:
            torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.hf
@pytest.mark.slow  # 23 s: the default suite keeps selective on the reference VLM and under the planner
def test_selective_recompute_of_qwen2_vl_under_bf16_autocast():
    """Qwen2-VL's vision attention under autocast: q and k leave the fp32 rotary, v its bf16 projection; inside
    the selective checkpoint's (and the byte measurement's) dispatch mode autocast is off within dipc's packed
    attention, which must still run it in one dtype.  Loss and gradients equal the unsplit model under the same
    autocast, within bf16's tolerance, with every pair at "selective" and measured."""
    from dipc.models import hf_vlm
    from dipc.planner.planning import make_plan
    from dipc.planner.workload import autocast_state, build_workload, split_for

    torch.manual_seed(0)
    model = hf_vlm.tiny_qwen2_vl(0)
    b = hf_vlm.qwen2_vl_batch([1, 1, 2, 0], 64, 3, image_hw=((16, 16), (16, 24)), videos=[1, 0, 0, 1])
    c = dipc.compile(model, b, 2, check=False, device="h800")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(**b).loss
        ref.backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        w = build_workload(c, split_for(c, b, 2, "dip"), autocast_state(torch.device("cpu")))
        plan = make_plan(c, w, 0, check=False)
        plan.ranks = [[dataclasses.replace(a, strategy="selective") if a.kind in ("F", "B") else a for a in acts]
                      for acts in plan.ranks]
        measured = {}
        loss, _ = run_local(c, b, 2, plan, measure=measured)
    torch.testing.assert_close(loss.float(), ref.detach().float(), rtol=1e-2, atol=1e-2)
    for k, p in model.named_parameters():
        if k in want:
            torch.testing.assert_close(p.grad, want[k], rtol=1e-2, atol=1e-2, msg=lambda m: f"{k}: {m}")
    assert {v[0] for k, v in measured.items() if k != "workload"} == {"selective"}


def test_autocast_weight_copies_are_step_state_not_activations():
    """Under torch.autocast its cache holds a low-precision copy of each weight a matmul reads for the whole step:
    counted once per rank as step state (``rank_state_bytes(amp=)``, :meth:`autocast_copy_bytes`), and not as a
    forward's kept activations (``kept_bytes``)."""
    from dipc.runtime.selective import kept_bytes

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, out, _ = kept_bytes(lin, {"input": x})
    # the input (held by its gradient's accumulator) and its bf16 copy the linear saves; not the weight's copy
    assert out.dtype == torch.bfloat16 and kept == 8 * 64 * 4 + 8 * 64 * 2, kept
    c = dipc.compile(pc.vlm(), pc.vlm_batch([1, 1], 12, 0), 2, check=False, progress=False)
    copies = c.autocast_copy_bytes("bfloat16")
    for r in range(2):
        linear = {id(t): t for ch in c.partition.chunks if ch.rank == r
                  for n in c.program.chunks[ch.index].state_names for t in [c._state[n]]
                  if isinstance(t, torch.nn.Parameter) and ("proj" in n or "fc" in n or "mlp" in n or "head" in n
                                                            or "patch" in n)}
        assert 0 < copies[r] <= sum(t.numel() * 2 for t in linear.values()) + 1, (r, copies[r])
        assert c.rank_state_bytes(2, ("cpu", "bfloat16"))[r] == c.rank_state_bytes(2)[r] + copies[r]
    assert c.autocast_copy_bytes("float32") == [0.0, 0.0]
