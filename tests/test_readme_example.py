"""The README's complete example runs as written (``python example.py``: two processes through
``dipc.launch.spawn``) and every loss it prints equals the unsplit model trained the same way in this process."""
import os
import re
import subprocess
import sys

import pytest


def _example() -> str:
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    m = re.search(r"```python\n(# example\.py.*?)```", readme, re.S)
    assert m, "the README has no example.py block"
    return m.group(1)


@pytest.mark.timeout(400)
def test_the_readme_example_runs_as_written_and_equals_the_unsplit_model(tmp_path):
    import torch

    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.data import vlm_batches

    path = tmp_path / "example.py"
    path.write_text(_example())
    env = dict(os.environ, DIPC_CHECK="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=360,
                         env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = {int(k): float(v) for k, v in re.findall(r"step (\d+) loss ([-\d.]+)", out.stdout)}
    assert sorted(got) == [0, 1, 2, 3], out.stdout
    torch.manual_seed(0)
    cfg = VLMConfig.tiny()
    model = ReferenceVLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, batch in enumerate(vlm_batches(cfg, 4, 8, seed=0)):
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert got[step] == pytest.approx(loss.detach().item(), rel=1e-5, abs=2e-6), f"step {step}"
