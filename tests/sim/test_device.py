"""Device profiles (dipc.sim.device) and the calibration command (dipc.calibrate): DIP §2.6's roofline cost model."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dipc.calibrate import calibrate, fit_alpha, main
from dipc.sim.device import COMPUTE_FAMILIES, FAMILIES, DeviceProfile, available_profiles, op_name, shipped_profiles


@pytest.fixture(autouse=True)
def _isolated_profile_dir(tmp_path, monkeypatch):
    """Calibrated profiles of the machine running the tests must not shadow the shipped ones."""
    monkeypatch.setenv("DIPC_PROFILE_DIR", str(tmp_path / "user_profiles"))


# name: (dense BF16 FLOP/s, HBM bytes/s, NVLink bytes/s per direction, memory bytes)
DATASHEET = {
    "h100": (989.4e12, 3.35e12, 450e9, 80e9),
    "h800": (989.4e12, 3.35e12, 200e9, 80e9),
    "h200": (989.4e12, 4.8e12, 450e9, 141e9),
    "a100": (312e12, 2.039e12, 300e9, 80e9),
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_shipped_profiles_hold_datasheet_values(name):
    p = DeviceProfile.load(name)
    flops, mem, nvlink, cap = DATASHEET[name]
    assert p.name == name and p.dtype == "bfloat16" and not p.calibrated
    assert p.peak_flops == flops and p.mem_bandwidth == mem and p.p2p_bandwidth == nvlink
    assert p.memory_capacity == cap
    assert p.alpha == {f: 1.0 for f in FAMILIES} and p.op_alpha == {}
    assert "datasheet" in p.source and p.p2p_latency > 0
    assert name in shipped_profiles() and name in available_profiles()


def test_shipped_profiles_relations():
    h100, h800, h200, a100 = (DeviceProfile.load(n) for n in ("h100", "h800", "h200", "a100"))
    assert h800.p2p_bandwidth < h100.p2p_bandwidth == h200.p2p_bandwidth   # export-limited NVLink
    assert h200.mem_bandwidth > h100.mem_bandwidth > a100.mem_bandwidth
    assert h100.peak_flops == h800.peak_flops == h200.peak_flops > 3 * a100.peak_flops


def _toy(**kw):
    alpha = {"matmul": 2.0, "elementwise": 1.5, "p2p": 1.2, "other": 3.0}
    d = dict(name="toy", peak_flops=1e12, mem_bandwidth=1e11, p2p_bandwidth=1e10, p2p_latency=5e-6,
             alpha=alpha, launch_overhead=1e-6, dtype="float32")
    d.update(kw)
    return DeviceProfile(**d)


def test_op_latency_compute_bound():
    p = _toy()
    # 2 * 1e9 / 1e12 = 2 ms beats 2 * 1e6 / 1e11 = 20 us
    assert p.op_latency("matmul", 1e9, 1e6) == pytest.approx(1e-6 + 2e-3, rel=1e-12)


def test_op_latency_memory_bound():
    p = _toy()
    # 1.5 * 1e9 / 1e11 = 15 ms beats 1.5 * 1e6 / 1e12 = 1.5 us
    assert p.op_latency("elementwise", 1e6, 1e9) == pytest.approx(1e-6 + 1.5e-2, rel=1e-12)


def test_op_latency_network_bound():
    p = _toy()
    # network 1.2 * 1e9 / 1e10 = 0.12 s beats memory 1.5 * 1e6 / 1e11 = 15 us
    assert p.op_latency("elementwise", 0, 1e6, net_bytes=1e9) == pytest.approx(1e-6 + 0.12, rel=1e-12)
    # and loses to a larger compute term: 2 * 1e12 / 1e12 = 2 s
    assert p.op_latency("matmul", 1e12, 0, net_bytes=1e9) == pytest.approx(1e-6 + 2.0, rel=1e-12)


def test_op_latency_fallbacks_overrides_and_errors():
    p = _toy(op_alpha={"gelu_tanh": 7.0})
    # families missing from alpha use alpha["other"]
    assert p.op_latency("norm", 0, 1e8) == pytest.approx(1e-6 + 3.0 * 1e-3)
    # a per-operator factor wins when named; an unknown op name falls back to the family
    assert p.op_latency("elementwise", 0, 1e8, op="gelu_tanh") == pytest.approx(1e-6 + 7.0 * 1e-3)
    assert p.op_latency("elementwise", 0, 1e8, op="add") == pytest.approx(1e-6 + 1.5 * 1e-3)
    assert p.op_latency("matmul", 0, 0) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="unknown operator family"):
        p.op_latency("gemm", 1, 1)
    with pytest.raises(ValueError, match="non-negative"):
        p.op_latency("matmul", -1, 0)
    assert _toy(alpha={}).op_latency("norm", 0, 1e8) == pytest.approx(1e-6 + 1e-3)  # no "other": 1.0


def test_p2p_time():
    p = _toy()
    assert p.p2p_time(0) == pytest.approx(5e-6)
    assert p.p2p_time(1e8) == pytest.approx(5e-6 + 1.2 * 1e8 / 1e10)
    with pytest.raises(ValueError):
        p.p2p_time(-1)


def test_json_round_trip_and_load(tmp_path, monkeypatch):
    p = _toy(op_alpha={"silu": 1.7}, calibrated=True, source="unit test", memory_capacity=1e9,
             meta={"benchmarks": [{"name": "x", "seconds": 1.5e-6}]})
    q = DeviceProfile.from_json(p.to_json())
    assert q == p
    path = p.save(tmp_path / "sub" / "toy.json")
    assert DeviceProfile.load(path) == p and DeviceProfile.load(str(path)) == p
    # by name from the user profile folder, which shadows a shipped profile of the same name
    user = tmp_path / "user"
    monkeypatch.setenv("DIPC_PROFILE_DIR", str(user))
    p.save(user / "toy.json")
    assert DeviceProfile.load("toy") == p
    mine = DeviceProfile.load("h100")
    mine.calibrated, mine.source = True, "measured"
    mine.save(user / "h100.json")
    assert DeviceProfile.load("h100").calibrated
    assert not DeviceProfile.load("h100", user=False).calibrated
    assert "toy" in available_profiles()


def test_invalid_profiles_and_names(tmp_path):
    good = _toy().to_dict()
    with pytest.raises(ValueError, match="lacks required"):
        DeviceProfile.from_dict({k: v for k, v in good.items() if k != "peak_flops"})
    with pytest.raises(ValueError, match="unknown fields"):
        DeviceProfile.from_dict({**good, "tflops": 1})
    with pytest.raises(ValueError, match="mem_bandwidth"):
        DeviceProfile.from_dict({**good, "mem_bandwidth": 0})
    with pytest.raises(ValueError, match="p2p_latency"):
        DeviceProfile.from_dict({**good, "p2p_latency": -1})
    with pytest.raises(ValueError, match="unknown operator family"):
        DeviceProfile.from_dict({**good, "alpha": {"gemm": 1.0}})
    with pytest.raises(ValueError, match="alpha"):
        DeviceProfile.from_dict({**good, "alpha": {"matmul": float("nan")}})
    with pytest.raises(ValueError):
        DeviceProfile.from_json("not json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**good, "peak_flops": "fast"}))
    with pytest.raises(ValueError, match="bad.json"):
        DeviceProfile.load(bad)
    with pytest.raises(FileNotFoundError, match="known: .*h100"):
        DeviceProfile.load("tpu-v9")
    with pytest.raises(FileNotFoundError, match="dipc.calibrate"):
        DeviceProfile.load("cpu")
    with pytest.raises(FileNotFoundError):
        DeviceProfile.load(tmp_path / "missing.json")


def test_op_name():
    aten = torch.ops.aten
    assert op_name(aten.mm.default) == op_name("aten.mm.default") == op_name("aten::mm") == "mm"
    assert op_name(aten.add_.Tensor) == "add" and op_name(aten._softmax.default) == "_softmax"
    assert op_name(aten.gelu.default, {"approximate": "tanh"}) == "gelu_tanh"
    assert op_name(aten.gelu.default) == "gelu"
    assert set(COMPUTE_FAMILIES) | {"p2p"} == set(FAMILIES)


def test_view_family_costs_the_launch_overhead():
    p = _toy()
    assert p.op_latency("view", 0, 0) == pytest.approx(1e-6)


def test_cache_level():
    p = _toy(cache_bytes=2e6, cache_bandwidth=4e11)
    assert p.bandwidth_for(2e6) == 4e11 and p.bandwidth_for(2e6 + 1) == 1e11
    # 1.5 * 1e6 / 4e11 inside the cache, 1.5 * 4e6 / 1e11 outside
    assert p.op_latency("elementwise", 0, 1e6) == pytest.approx(1e-6 + 1.5 * 1e6 / 4e11)
    assert p.op_latency("elementwise", 0, 4e6) == pytest.approx(1e-6 + 1.5 * 4e6 / 1e11)
    with pytest.raises(ValueError, match="together"):
        _toy(cache_bytes=2e6)
    assert DeviceProfile.from_json(p.to_json()) == p


@pytest.mark.parametrize("cache", [False, True])
def test_op_latency_expr_matches_op_latency(cache):
    import sympy

    p = _toy(op_alpha={"silu": 1.7}, **(dict(cache_bytes=3e5, cache_bandwidth=4e11) if cache else {}))
    b, s = sympy.symbols("b s", positive=True, integer=True)
    cases = [("matmul", 2 * b * s * 64 * 256, 4 * (b * s * 64 + 64 * 256 + b * s * 256), 0, None),
             ("elementwise", 0, 8 * b * s * 64, 0, "silu"),
             ("elementwise", 0, 12 * b * s * 64, 4 * b * s * 64, None)]
    for fam, fl, by, net, op in cases:
        f = sympy.lambdify((b, s), p.op_latency_expr(fam, fl, by, net, op=op))
        for bb, ss in [(1, 8), (2, 128), (8, 4096)]:
            args = {b: bb, s: ss}
            want = p.op_latency(fam, float(sympy.sympify(fl).subs(args)), float(by.subs(args)),
                                float(sympy.sympify(net).subs(args)), op=op)
            assert f(bb, ss) == pytest.approx(want, rel=1e-12)


def test_fit_alpha_recovers_a_known_factor():
    pts = [(r, 2e-6 + 1.7 * r) for r in (1e-5, 1e-4, 1e-3, 1e-2)]
    assert fit_alpha(pts, 2e-6) == pytest.approx(1.7)
    # one outlier does not drag the fit (median-like in log space)
    assert fit_alpha(pts + [(1e-3, 50e-3)], 2e-6) == pytest.approx(1.7)
    assert fit_alpha([(0.0, 1e-6)], 2e-6) == 1.0


def _sane(p: DeviceProfile):
    assert p.calibrated and p.dtype == "float32" and p.name == "cpu"
    for v in (p.peak_flops, p.mem_bandwidth, p.p2p_bandwidth, p.p2p_latency, p.launch_overhead):
        assert math.isfinite(v) and v > 0
    if p.cache_bytes is not None:  # the CPU cache level, when sysfs names an L2 and it measured faster
        assert p.cache_bytes > 0 and p.cache_bandwidth > p.mem_bandwidth
    assert set(p.alpha) == set(FAMILIES)
    assert all(math.isfinite(a) and a > 0 for a in list(p.alpha.values()) + list(p.op_alpha.values()))
    benches = p.meta["benchmarks"]
    assert {b["family"] for b in benches} == set(COMPUTE_FAMILIES)
    for b in benches:
        assert math.isfinite(b["seconds"]) and b["seconds"] > 0
        pred = p.op_latency(b["family"], b["flops"], b["bytes"], op=b["op"])
        assert math.isfinite(pred) and pred > 0 and pred == pytest.approx(b["predicted"])
    for key in ("mean_accuracy", "median_accuracy", "mean_accuracy_family_alpha", "mean_accuracy_uncalibrated"):
        assert math.isfinite(p.meta[key]) and p.meta[key] <= 1.0
    assert p.meta["mean_accuracy"] > 0.0


def test_calibrate_quick_in_process():
    threads = torch.get_num_threads()
    cal = calibrate("cpu", quick=True, p2p=False, verbose=False)
    assert torch.get_num_threads() == threads  # restored
    _sane(cal.profile)
    assert cal.profile.cache_bytes is None  # DIP's single memory level
    assert "P2P not measured" in cal.profile.source and cal.p2p == []
    assert 0 < cal.accuracy <= 1 and cal.elapsed > 0
    assert all(b.seconds > 0 and b.predicted > 0 and b.accuracy <= 1 for b in cal.benches)


@pytest.mark.slow  # default-suite time: the calibration's Python API is tested in the default suite
def test_calibrate_command_quick_with_p2p(tmp_path):
    """`python -m dipc.calibrate --quick --cache-level --out X` (two gloo processes for P2P) writes a loadable
    profile."""
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "dipc.calibrate", "--quick", "--cache-level", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mean accuracy" in r.stdout and f"wrote {out}" in r.stdout
    p = DeviceProfile.load(out)
    _sane(p)
    assert p.meta["quick"] and p.meta["threads"] == 1
    assert len(p.meta["p2p"]) >= 3 and "gloo" in p.source
    assert p.p2p_time(1 << 20) > p.p2p_time(4) > 0


def test_calibrate_main_default_out_is_loadable_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("DIPC_PROFILE_DIR", str(tmp_path / "profiles"))
    import dipc.calibrate as cal_mod

    p = _toy(name="cpu", calibrated=True)
    monkeypatch.setattr(cal_mod, "calibrate", lambda *a, **k: cal_mod.Calibration(p, [], [], 1.0, 1.0, 1.0, 0.0))
    assert main(["--no-p2p"]) is p
    assert DeviceProfile.load("cpu") == p
    with pytest.raises(SystemExit):
        main(["--device", "tpu"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_cuda_quick():
    cal = calibrate("cuda", quick=True, p2p=torch.cuda.device_count() >= 2, verbose=False)
    p = cal.profile
    assert p.calibrated and p.dtype == "bfloat16" and p.peak_flops > 1e12 and p.mem_bandwidth > 1e11


def test_executor_overheads_post_time_and_allreduce():
    p = _toy(backward_overhead=3e-6, p2p_post_overhead=2e-5, p2p_post_per_byte=1e-9, step_overhead=1e-3)
    assert p.overhead() == 1e-6 and p.overhead(backward=True) == 3e-6
    assert _toy().overhead(backward=True) == 1e-6  # falls back to launch_overhead
    assert p.post_time(1000) == pytest.approx(2e-5 + 1e-6)
    with pytest.raises(ValueError, match="non-negative size, got -5"):
        p.post_time(-5)
    # ring all-reduce: 2 (n - 1) latencies + 2 (n - 1) / n of the bytes at alpha_p2p / bandwidth
    assert p.allreduce_time(1e6, 4) == pytest.approx(6 * 5e-6 + 1.5 * 1.2 * 1e6 / 1e10)
    assert p.allreduce_time(1e6, 1) == 0.0
    with pytest.raises(ValueError, match="n_ranks >= 1"):
        p.allreduce_time(10, 0)
    assert DeviceProfile.from_json(p.to_json()) == p
    for field in ("backward_overhead", "p2p_post_overhead", "p2p_post_per_byte", "step_overhead"):
        with pytest.raises(ValueError, match=field):
            _toy(**{field: -1.0})
    import sympy
    e = p.op_latency_expr("matmul", sympy.Integer(0), sympy.Integer(0), backward=True)
    assert float(e) == pytest.approx(3e-6)
