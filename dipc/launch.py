"""Launch a function on ``nprocs`` local processes with a gloo (CPU) or NCCL process group.

``torchrun`` is the production launcher (every dipc entry point also works under it: it reads the usual
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` variables).  :func:`spawn` is the small in-Python launcher used by tests,
benchmarks and the main job: it picks a free port, starts the processes, sets one intra-op thread per rank, joins
with a timeout (killing every process when it runs out), and re-raises the first rank's exception with its traceback
in the parent.

Ranks start from multiprocessing's ``forkserver`` (where the platform has it; ``spawn`` elsewhere): a clean server
process, started by the first call, imports torch and dipc once and forks every later rank from that state, so a
rank starts in a fraction of a second instead of importing torch again (4-5 s per rank on a 2-core machine, paid by
every multi-process test).  The server has run no torch op when it forks, unlike the caller, which may hold torch's
thread pools; each rank takes the caller's environment as it is at the call (not the server's, fixed at its start).
"""
from __future__ import annotations

import datetime
import io
import os
import pickle
import socket
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .wire import MIN_TIMEOUT

__all__ = ["spawn", "pin_rank", "check_cpus", "free_port", "init_from_env", "SpawnError"]


class SpawnError(RuntimeError):
    """A spawned rank failed or the group ran past its timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None, timeout: float = 300.0) -> None:
    """Initialise the default process group from torchrun's environment variables (no-op if already done)."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


#: what the fork server imports once, before it forks any rank
_PRELOAD = ["torch", "torch.distributed", "dipc"]


def _context():
    """multiprocessing's ``forkserver`` context (preloading :data:`_PRELOAD`), or ``spawn`` where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call); a no-op after
    return ctx


def check_cpus(cpus, name: str) -> list[int]:
    """``cpus`` as a list of this host's CPU numbers (ints from 0 to ``os.cpu_count() - 1``, in the given order).

    Raises:
        ValueError: ``cpus`` is not a non-empty iterable of them, naming ``name`` and the value.
    """
    try:
        out = list(cpus)
    except TypeError:
        out = []
    n = os.cpu_count() or 1
    if isinstance(cpus, (str, bytes)) or not out or any(
            isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n for c in out):
        raise ValueError(f"{name} must be a non-empty list or set of CPU numbers (ints from 0 to {n - 1}), got "
                         f"{cpus!r}")
    return out


def pin_rank(rank: int, cpus: Sequence[int] | None = None) -> int:
    """Pin this process (every thread it has; threads started later inherit it) to one CPU: ``cpus[rank %
    len(cpus)]``, ``cpus`` by default the CPUs this process may run on now.  Under torchrun:
    ``dipc.launch.pin_rank(int(os.environ["LOCAL_RANK"]))`` before the process group starts.

    Where every core runs a rank (2 CPU ranks on 2 cores), pinning keeps each rank's caches and lets rank 0's
    background planner (:class:`dipc.planner.background.BackgroundPlanner`) take the other cores, which idle while
    the pipeline fills, the time it plans (DIP §2.2 plans on idle cores): ``python bench/async_planning.py --pin``.
    The CPUs the ranks are pinned among are kept in the environment variable ``DIPC_PINNED_CPUS`` (read by
    :func:`dipc.planner.background.planner_cpus`).

    Returns:
        the CPU.

    Raises:
        ValueError: ``rank`` is not an int >= 0, or ``cpus`` is not a non-empty list of this host's CPU numbers.
        OSError: the platform has no ``os.sched_setaffinity`` (not Linux) or refuses the CPU.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("pinning needs os.sched_setaffinity (Linux)")
    allowed = sorted(os.sched_getaffinity(0)) if cpus is None else check_cpus(cpus, "cpus")
    cpu = allowed[rank % len(allowed)]
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        raise OSError(f"cannot pin rank {rank} to CPU {cpu} (not one this process may use?): {e}") from None
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that just ended
            pass
    # the CPUs the ranks were pinned among: rank 0's background planner takes the others (planner_cpus)
    os.environ["DIPC_PINNED_CPUS"] = ",".join(map(str, sorted(set(allowed))))
    return cpu


_listening: list[socket.socket] = []  # rank 0's store socket: it must outlive the store that serves on it


def _loopback_store(rank: int, world: int, port: int, timeout: float):
    """The rendezvous store of a :func:`spawn` group, served by rank 0 on the loopback address only (torch's
    ``TCPStore`` listens on every interface when it opens its own socket)."""
    wait = datetime.timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, wait)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(max(world, 16))
    _listening.append(sock)
    return dist.TCPStore("127.0.0.1", port, world, True, wait, master_listen_fd=sock.fileno())


def _worker(rank: int, world: int, port: int, backend: str, timeout: float, threads: int, fn, args, queue,
            env=None, cpus=None):
    try:
        if env is not None:  # the caller's environment now, not the fork server's from when it started
            os.environ.clear()
            os.environ.update(env)
        if cpus is not None:
            pin_rank(rank, cpus)
        torch.set_num_threads(threads)
        args = pickle.loads(args)  # pickled by value in the parent (see spawn)
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
        dist.init_process_group(backend, store=_loopback_store(rank, world, port, timeout), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        buf = io.BytesIO()  # plain bytes: tensors sent through a queue would live in this process's shared memory
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # report everything, including assertion failures in tests
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout: float = 300.0,
          backend: str = "gloo", threads_per_rank: int = 1, pin_cpus: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes that share a process group.

    Args:
        fn: a picklable (module-level) function.
        nprocs: number of ranks.
        args: extra picklable arguments (copied to every rank by value, tensors included: any number of them).
        timeout: seconds for the whole group; also the process group's collective timeout.
        backend: "gloo" (CPU) or "nccl".
        threads_per_rank: torch intra-op threads per process.
        pin_cpus: pin rank r to the r-th (modulo their count) of the CPUs this process may run on
            (:func:`pin_rank`), before its process group starts.

    Returns:
        the per-rank return values of ``fn`` in rank order: tensors, numbers, strings, None and lists, tuples and
        dicts of them (read back with ``torch.load(weights_only=True)``, so a rank's result cannot run code in the
        parent).

    Raises:
        SpawnError: a rank raised (message holds its traceback, and the exit codes of ranks that died without a
            word) or the group did not finish within ``timeout``.
        ValueError: ``timeout`` is not a finite number >= 1, ``nprocs`` not an int >= 1, ``pin_cpus`` not a bool,
            or ``fn`` or ``args`` cannot be pickled.
        OSError: ``pin_cpus`` on a platform without ``os.sched_setaffinity`` (not Linux).
    """
    if not isinstance(pin_cpus, bool):
        raise ValueError(f"pin_cpus must be a bool, got {pin_cpus!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not MIN_TIMEOUT <= timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds >= {MIN_TIMEOUT:g}, got {timeout!r} (it is also "
                         "the process group's collective timeout)")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"spawn's fn must be a module-level function (the ranks import it by name), got {fn!r}: "
                         f"{type(e).__name__}: {e}") from None
    cpus = sorted(os.sched_getaffinity(0)) if pin_cpus and hasattr(os, "sched_getaffinity") else None
    if pin_cpus and cpus is None:
        raise OSError("pin_cpus needs os.sched_setaffinity (Linux)")
    # every rank must trace the model alike: a forward that iterates a set of strings (Hugging Face Gemma3's
    # set(config.layer_types)) follows the hash seed, so all ranks get the same one
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # the arguments travel as one bytes object pickled by value: multiprocessing would hand each tensor over as a
    # shared-memory file descriptor through the fork server, which refuses a few hundred ("too many fds")
    try:
        packed = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise ValueError(f"spawn's args must be picklable (module-level functions, tensors, plain values): "
                         f"{type(e).__name__}: {e}") from e
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, backend, timeout, threads_per_rank, fn, packed,
                                               queue, env, cpus), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as _q
    import time
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SpawnError(f"ranks {sorted(set(range(nprocs)) - set(results) - set(errors))} did not finish "
                                 f"within {timeout} s" + (f"; errors: {errors}" if errors else ""))
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
                if dead and all(not p.is_alive() for p in procs):
                    raise SpawnError(f"ranks {dead} exited without reporting (exit codes "
                                     f"{[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                # tensors, numbers, strings and containers only: a rank cannot make the parent run code
                results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
            else:
                errors[rank] = payload
                # the others will fail on their timeouts; stop them now
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        # ranks that died on their own without a word (os._exit, a signal): their exit codes, before any kill below
        silent = {r: p.exitcode for r, p in enumerate(procs)
                  if not p.is_alive() and p.exitcode not in (None, 0) and r not in results and r not in errors}
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        r = min(errors)
        also = (f"\n(ranks {sorted(silent)} exited without reporting, exit codes {[silent[k] for k in sorted(silent)]}: "
                "the error above may be what their peers saw of it)" if silent else "")
        raise SpawnError(f"rank {r} failed:\n{errors[r]}{also}")
    return [results[r] for r in range(nprocs)]
