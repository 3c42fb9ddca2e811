"""The user guide's complete training script (model, batches, AdamW, LR warm-up, global clipping, evaluation every 4
steps, DCP checkpoint and resume) runs as written under torchrun on 2 CPU ranks: 4 steps, then a second launch to 6
that resumes from the checkpoint; every printed training loss, gradient norm and eval loss equals the unsplit model
trained the same way in this process (the script in docs/user_guide.md, run from there as written)."""
import os
import re
import subprocess
import sys

import pytest


def _script() -> str:
    guide = open(os.path.join(os.path.dirname(__file__), "..", "docs", "user_guide.md")).read()
    m = re.search(r"```python\n(# train_loop\.py.*?)```", guide, re.S)
    assert m, "the user guide has no train_loop.py block"
    return m.group(1)


def _launch(path, steps, ckpt, port):
    env = dict(os.environ, PYTHONHASHSEED="0", DIPC_CHECK="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), path, str(steps), ckpt],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _reference(steps):
    """The unsplit model through the same loop: {step: (loss, norm)}, {step: eval loss}."""
    import torch

    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.data import vlm_batches

    torch.manual_seed(0)
    cfg = VLMConfig.tiny()
    model = ReferenceVLM(cfg)
    train = list(vlm_batches(cfg, steps, 8, seed=0))
    held_out = list(vlm_batches(cfg, 2, 8, seed=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    losses, evals = {}, {}
    for i, batch in enumerate(train[:steps]):
        loss = model(**batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses[i + 1] = (float(loss.detach()), float(norm))
        if (i + 1) % 4 == 0 or i + 1 == steps:
            with torch.no_grad():
                evals[i + 1] = sum(float(model(**b)) for b in held_out) / len(held_out)
    return losses, evals


@pytest.mark.timeout(600)
def test_the_readme_training_script_runs_and_resumes_as_the_unsplit_model(tmp_path):
    from dipc.launch import free_port

    path = tmp_path / "train_loop.py"
    path.write_text(_script())
    ckpt = str(tmp_path / "ckpt")
    first = _launch(str(path), 4, ckpt, free_port())
    second = _launch(str(path), 6, ckpt, free_port())
    got_loss, got_eval = {}, {}
    for text in (first, second):
        for k, loss, norm in re.findall(r"step (\d+) loss ([-\d.]+) norm ([-\d.]+)", text):
            assert int(k) not in got_loss, f"step {k} ran twice: the second launch did not resume"
            got_loss[int(k)] = (float(loss), float(norm))
        for k, ev in re.findall(r"step (\d+) eval ([-\d.]+)", text):
            got_eval[int(k)] = float(ev)
    assert sorted(got_loss) == [1, 2, 3, 4, 5, 6], (first, second)
    assert sorted(got_eval) == [4, 6]
    want_loss, want_eval = _reference(6)
    for k, (loss, norm) in got_loss.items():
        assert loss == pytest.approx(want_loss[k][0], rel=1e-5, abs=2e-6), f"step {k}: loss"
        assert norm == pytest.approx(want_loss[k][1], rel=1e-4, abs=2e-6), f"step {k}: gradient norm"
    for k, ev in got_eval.items():
        assert ev == pytest.approx(want_eval[k], rel=1e-5, abs=2e-6), f"step {k}: eval loss"
