"""dipc.launch.spawn: ranks forked from the fork server see the caller's environment as it is at each call, agree
on string hashing (a forward that iterates a set of strings must trace alike on every rank), and a failing rank's
error reaches the caller."""
import os

import pytest

from dipc.launch import SpawnError, spawn


def _env_and_order(rank, world, name):
    import torch.distributed as dist

    return {"value": os.environ.get(name), "rank_env": os.environ["RANK"], "world": dist.get_world_size(),
            "order": list({f"layer_{i}" for i in range(16)}), "pid": os.getpid()}


def _fails_on(rank, world, bad):
    if rank == bad:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank


def test_ranks_take_the_callers_environment_at_each_call_and_hash_strings_alike(monkeypatch):
    name = "DIPC_TEST_LAUNCH_VALUE"
    monkeypatch.delenv(name, raising=False)
    first = spawn(_env_and_order, 2, (name,), timeout=120)  # starts the fork server if no test did
    assert [o["value"] for o in first] == [None, None]
    monkeypatch.setenv(name, "set after the server started")
    second = spawn(_env_and_order, 2, (name,), timeout=120)
    assert [o["value"] for o in second] == ["set after the server started"] * 2
    assert [o["rank_env"] for o in second] == ["0", "1"] and {o["world"] for o in second} == {2}
    assert second[0]["order"] == second[1]["order"] == first[0]["order"]
    assert len({o["pid"] for o in first + second}) == 4  # a fresh process per rank and call
    monkeypatch.delenv(name)
    assert [o["value"] for o in spawn(_env_and_order, 2, (name,), timeout=120)] == [None, None]


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(SpawnError, match=r"rank 1 failed:\nValueError: rank 1 fails on purpose(.|\n)*_fails_on"):
        spawn(_fails_on, 2, (1,), timeout=120)


def _sum_all(rank, world, tensors):
    import torch

    return torch.stack([t.sum() for t in tensors]).sum() + rank


def test_hundreds_of_tensor_arguments_reach_every_rank():
    """Issue 39 §3: 400 tensors in ``args`` used to fail in the fork server with "too many fds" (each tensor
    travelled as a shared-memory descriptor); they now reach every rank by value."""
    import torch

    tensors = [torch.full((3,), float(i)) for i in range(400)]
    want = float(sum(3 * i for i in range(400)))
    assert [float(x) for x in spawn(_sum_all, 2, (tensors,), timeout=120)] == [want, want + 1]
    with pytest.raises(ValueError, match=r"spawn's args must be picklable"):
        spawn(_sum_all, 2, (lambda: 0,), timeout=120)


def _store_listens_on(rank, world):
    import subprocess

    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    dist.barrier()
    return out.split()[3] if rank == 0 and out.strip() else ""


@pytest.mark.skipif(not os.path.exists("/usr/bin/ss") and not os.path.exists("/bin/ss"), reason="needs ss")
def test_the_rendezvous_store_listens_on_the_loopback_address_only():
    """Issue 39 §4: spawn's store served on every interface; now on 127.0.0.1 alone."""
    assert spawn(_store_listens_on, 2, (), timeout=120)[0].startswith("127.0.0.1:")


def _exits(rank, world):
    import time

    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    dist.barrier()  # waits on the dead rank: its peer's error


def test_spawn_refuses_bad_arguments_and_names_a_rank_that_exited_silently():
    """A rank that calls os._exit shows in the error with its exit code, next to what its peer saw; a timeout below
    1 s, a non-number and an unpicklable fn are refused before any process starts."""
    with pytest.raises(SpawnError, match=r"exit codes \[3\]|ranks \[1\] exited without reporting \(exit codes \[3\]\)"):
        spawn(_exits, 2, (), timeout=30)
    for bad in (0.5, float("nan"), True, "9"):
        with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds >= 1"):
            spawn(_sum_all, 2, ([],), timeout=bad)
    with pytest.raises(ValueError, match=r"spawn's fn must be a module-level function"):
        spawn(lambda rank, world: rank, 2)
