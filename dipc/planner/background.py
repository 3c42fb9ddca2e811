"""Asynchronous planning: the plan of step t+1 is made in a background process while step t runs (DIP §2.2).

One :class:`BackgroundPlanner` per pipeline lives in the pipeline's rank 0.  It forks a planning process the first
time it is given a batch (the fork inherits the compiled pipeline: its captures, cost models and partition, so
nothing of it is serialised), then sends it each next batch as a frame of JSON metadata and the raw bytes of its
integer tensors (floating-point ones as shape and dtype only: planning reads their shapes, not their values), and
reads back the plan as JSON text.  Nothing is pickled on either side.  The process plans exactly as
the synchronous path would (:func:`dipc.planner.split_for`, :func:`dipc.planner.build_workload`,
:func:`dipc.planner.make_plan`, validated) and, unless the runtime says not to (``simulate_steps=False``), also
simulates the plan, so that the step report's bubble ratio, its causes and the peak memory cost the training
process nothing.

The planning process runs at the lowest CPU priority (Linux ``SCHED_IDLE``, else ``nice`` 19): it plans on the cores
the training processes leave idle.  It runs on the CPUs the runtime's ``planner_cpus`` names; by default, when
:func:`dipc.launch.pin_rank` pinned rank 0 to its CPU, on the other CPUs the ranks were pinned among
(:func:`planner_cpus`).  It sends the plan first and then, when asked and unless the next batch already
waits, the simulated figures of the step report.  The runtime asks for a step's plan with
:meth:`BackgroundPlanner.take` and a deadline: a plan that is late, made for another batch, or that failed, or a
planning process that died, gives ``None`` and the reason; the runtime then plans the step with its fallback
template and says so (the planning process is restarted for the next batch when it died).  When several batches
are queued, the process skips to the newest (older ones would be late anyway).

Testing knobs, read by the planning process when it starts: ``DIPC_PLANNER_DELAY_S`` (seconds it sleeps before each
plan: a planner slowed on purpose) and ``DIPC_PLANNER_FAIL`` (non-empty: each plan raises).
"""
from __future__ import annotations

import gc
import logging
import multiprocessing as mp  # Pipe only: framed bytes, no pickle
import os
import queue
import struct
import threading
import time
import warnings
from typing import Any, Mapping

import torch

from ..errors import NeedsCapture
from ..wire import decode_json, encode_json

__all__ = ["BackgroundPlanner", "encode_batch", "decode_batch", "planner_cpus", "simulated_summary"]

log = logging.getLogger("dipc")


def encode_batch(header: Mapping[str, Any], batch: Mapping[str, Any], float_values: bool = True) -> bytes:
    """One frame: an 8-byte length, the JSON ``header`` with the batch's layout, then the tensors' raw bytes.

    Tensors (any device: copied to the CPU) travel as bytes with their dtype and shape; other values must be JSON
    (``TypeError`` otherwise).  With ``float_values=False`` floating-point tensors travel as dtype and shape only
    (:func:`decode_batch` gives zeros of that shape): the planner's stage graph, costs and digest read the shapes of
    pixel values, latents and the like, never their values, and leaving them out makes the frame of a reference-VLM
    batch 18 KB instead of 427 KB."""
    layout, values, blobs, off = [], {}, [], 0
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            if not float_values and v.is_floating_point():
                layout.append([k, str(v.dtype).removeprefix("torch."), list(v.shape), off, -1])
                continue
            t = v.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            layout.append([k, str(t.dtype).removeprefix("torch."), list(t.shape), off, len(raw)])
            blobs.append(raw)
            off += len(raw)
        else:
            values[k] = v
    head = encode_json({"header": dict(header), "tensors": layout, "values": values})
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def decode_batch(frame: bytes) -> tuple[dict, dict]:
    """The inverse of :func:`encode_batch`: ``(header, batch)`` (tensors on the CPU; a tensor sent without its
    values is zeros of its shape and dtype, one element broadcast: no memory of its own)."""
    (n,) = struct.unpack_from("<Q", frame, 0)
    meta = decode_json(frame[8:8 + n])
    base = 8 + n
    data = bytearray(frame[base:])
    batch: dict[str, Any] = dict(meta["values"])
    for k, dtype, shape, off, size in meta["tensors"]:
        dt = getattr(torch, dtype)
        if size < 0:
            t = torch.zeros((), dtype=dt).expand(shape)
        elif size:
            t = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=off).view(dt).reshape(shape).clone()
        else:
            t = torch.empty(shape, dtype=dt)
        batch[k] = t
    return meta["header"], batch


def simulated_summary(compiled, w, plan, static_bytes) -> dict:
    """The simulated step of ``plan`` as the step report shows it (JSON)."""
    from ..sim.simulate import simulate_workload
    from .planning import with_plan_strategies

    res = simulate_workload(compiled, with_plan_strategies(w, plan), plan, static_bytes=static_bytes)
    return {"iteration_time": res.iteration_time, "bound": res.bound, "bubble_ratio": res.bubble_ratio,
            "bubble_causes": res.bubble_causes(), "peak_memory": list(res.peak_memory)}


def planner_cpus(cpus=None) -> set[int] | None:
    """The CPUs the planning process runs on: ``cpus`` when given; else, when :func:`dipc.launch.pin_rank` pinned
    the training process, the other CPUs of those the ranks were pinned among (a planner that inherited rank 0's
    CPU would take it from rank 0, whose forwards the whole pipeline waits for while it fills; the other ranks'
    cores idle then, and the scheduler puts the planner wherever a core idles); None (the training process's CPUs,
    the scheduler's choice) when dipc did not pin it (a ``taskset`` or ``numactl`` restriction is kept), or no
    other CPU is left."""
    if cpus is not None:
        return set(cpus)
    pinned = os.environ.get("DIPC_PINNED_CPUS")
    if not pinned or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        among = {int(c) for c in pinned.split(",")}
    except ValueError:
        return None
    mine = os.sched_getaffinity(0)
    if len(mine) != 1 or not mine <= among:  # re-pinned or widened since: not dipc's pinning any more
        return None
    return (among - mine) or None


def _serve(conn, compiled, options: dict) -> None:
    """The planning process's loop (runs after the fork; never returns)."""
    from ..validation import validate
    from .planning import make_plan
    from .workload import build_workload, split_for, step_digest
    from .options import set_recompute

    code = 0
    try:
        torch.set_num_threads(1)  # as DataLoader workers do: the parent's thread pool is not the child's
        # what the fork inherited (the compiled pipeline, its captures) outlives every plan: out of the collector's
        # reach, a generation-2 collection here passes over the plans' own objects only (and touches no inherited
        # page, which copy-on-write would then copy)
        gc.freeze()
        # a new capture (torch.export, seconds) is the training process's to make: it needs it to run the step
        # anyway; the planner says so at once and is forked again, with the capture, for the next batch
        compiled.allow_capture = False
        try:  # DIP plans on idle CPU cores: SCHED_IDLE yields the core at once to a training process that wakes
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):  # not Linux: the lowest nice level instead
            try:
                os.nice(19)
            except (OSError, AttributeError):
                pass
        cpus = planner_cpus(options.get("cpus"))
        if cpus is not None:
            try:
                os.sched_setaffinity(0, cpus)
            except (OSError, OverflowError, ValueError) as e:  # none of them this container's: the training process's
                log.warning("dipc: the background planner cannot run on CPUs %s (%s); it runs on the training "
                            "process's CPUs %s", sorted(cpus), e, sorted(os.sched_getaffinity(0)))
        delay = float(os.environ.get("DIPC_PLANNER_DELAY_S", "0") or 0)
        fail = bool(os.environ.get("DIPC_PLANNER_FAIL"))
        static = compiled.rank_state_bytes(options.get("optimizer_states", 2))
        while True:
            try:
                frame = conn.recv_bytes()
                while conn.poll(0):  # several queued: only the newest can still be in time
                    frame = conn.recv_bytes()
            except (EOFError, OSError):
                break
            head, batch = decode_batch(frame)
            t0, c0 = time.perf_counter(), time.process_time()
            reply: dict[str, Any] = {"step": head["step"], "seq": head.get("seq", -1)}
            try:
                if delay:
                    time.sleep(delay)
                if fail:
                    raise RuntimeError("DIPC_PLANNER_FAIL is set: the planner fails on purpose")
                mbs = split_for(compiled, batch, head["n_microbatches"], head["schedule"])
                amp = tuple(head["amp"]) if head.get("amp") else None
                w = build_workload(compiled, mbs, amp)
                if options.get("recompute"):
                    set_recompute(w, True)
                plan = make_plan(compiled, w, head["step"], memory_limit=options.get("memory_limit"),
                                 schedule=head["schedule"], budget_s=head["budget_s"], seed=head["seed"],
                                 check=False)
                # as make_plan's check, whose digest would write the JSON text a second time; the field types are
                # checked where the text is read (Plan.from_json, on every rank before the plan runs)
                validate(plan, types=False)
                text = plan.to_json()
                reply.update(digest=step_digest(compiled, w), plan=text, schedule=head["schedule"],
                             n_microbatches=head["n_microbatches"], amp=head.get("amp"))
            except Exception as e:  # the runtime falls back; the process goes on with the next batch
                reply["error"] = f"{type(e).__name__}: {e}"
                reply["needs_capture"] = isinstance(e, NeedsCapture)
                plan = None
            reply["seconds"] = time.perf_counter() - t0  # wall: includes waiting for an idle core
            reply["cpu_seconds"] = time.process_time() - c0
            try:
                conn.send_bytes(encode_json(reply))
                # then, when asked and unless the next batch waits, the report's figures
                if plan is not None and head.get("simulate", True) and not conn.poll(0):
                    conn.send_bytes(encode_json({"step": head["step"],
                                                 "simulation": simulated_summary(compiled, w, plan, static)}))
            except (BrokenPipeError, OSError):
                break
    except BaseException:  # noqa: BLE001 - a dying planner must not run the parent's atexit handlers
        code = 1
    finally:
        os._exit(code)


def _close_inherited_sockets(keep: int) -> None:
    """In the forked planner: close the training process's sockets (gloo pairs, the rendezvous store) it inherited,
    so that a peer sees this rank's connections drop as soon as the training process dies, not when the planner
    does.  ``keep``: the planner's own pipe."""
    import stat

    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: nothing to find them by
        return
    for fd in fds:
        if fd == keep or fd < 3:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass


class BackgroundPlanner:
    """A planning process for one pipeline (lives in its rank 0; DIP §2.2 asynchronous planning).

    Args:
        compiled: the :class:`dipc.CompiledPipeline` (inherited by the forked process, not serialised).
        options: the runtime's planning options: ``memory_limit`` (bytes or None), ``recompute`` (bool),
            ``optimizer_states`` (int), ``cpus`` (the CPUs the process runs on, :func:`planner_cpus`).
        serve: a stand-in for the process's loop, ``serve(conn)`` reading frames and answering replies as the
            planner does (``bench/async_planning.py``'s ``handover`` mode answers with plans made beforehand, to
            measure the handover without the planning); None (the default) plans.

    The process is started by the first :meth:`submit` and restarted by the next one after it died.
    """

    def __init__(self, compiled, options: Mapping[str, Any], serve=None):
        self.compiled = compiled
        self.options = dict(options)
        self.serve = serve  # the process's loop, ``serve(conn)`` (default: plan each batch; a benchmark's stand-in)
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.programs_at_fork = 0
        self.conn = None
        self.starts = 0
        self.submitted: int | None = None  # step of the newest batch sent
        self.inbox: dict[int, dict] = {}  # request sequence number -> plan reply
        self.seq = 0  # of the newest request
        self.simulations: dict[int, dict] = {}  # step -> the simulated figures of its plan
        self._sender = None
        self._outbox = None

    def _start(self) -> None:
        # os.fork, not multiprocessing.Process: the compiled pipeline is inherited, never pickled, and a rank that
        # is itself a daemonic process (dipc.launch.spawn, pytest workers) may still have this child
        parent, child = mp.Pipe(duplex=True)
        with warnings.catch_warnings():  # Python >= 3.12 warns on fork with threads (gloo's): the child runs
            warnings.simplefilter("ignore", DeprecationWarning)  # only pure planning code, no thread it lacks
            pid = os.fork()
        if pid == 0:  # the planning process
            parent.close()
            _close_inherited_sockets(keep=child.fileno())
            if self.serve is not None:
                try:
                    self.serve(child)
                finally:
                    os._exit(0)
            _serve(child, self.compiled, self.options)
        child.close()
        self.pid, self.exitcode = pid, None
        self.programs_at_fork = len(self.compiled.programs)
        self.conn = parent
        self.starts += 1

    def _reap(self, block: bool = False) -> None:
        if self.pid is None or self.exitcode is not None:
            return
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            self.exitcode = -1
            return
        if pid:
            self.exitcode = os.waitstatus_to_exitcode(status)

    def _kill(self) -> None:
        """Stop the planning process now (SIGKILL; no wait for its current plan)."""
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self._reap(block=True)
        self.exitcode = -9

    def alive(self) -> bool:
        """Whether the planning process runs."""
        self._reap()
        return self.pid is not None and self.exitcode is None

    def submit(self, step: int, batch: Mapping[str, Any], n_microbatches: int, schedule: str, budget_s: float,
               seed: int, amp: tuple[str, str] | None = None, simulate: bool = True) -> None:
        """Send step ``step``'s batch to the planning process (starting or restarting it first).  The frame is
        written by a sender thread, so the training thread does not wait for the planner to read it.  With
        ``simulate`` the process also simulates the plan for the step report, after sending it.

        Raises:
            TypeError: a non-tensor value of ``batch`` is not JSON.
        """
        self.seq += 1  # a retried step (after a failure) sends its look-ahead again: only the newest counts
        frame = encode_batch({"step": step, "seq": self.seq, "n_microbatches": n_microbatches, "schedule": schedule,
                              "budget_s": budget_s, "seed": seed, "amp": list(amp) if amp else None,
                              "simulate": bool(simulate)}, batch, float_values=False)
        if self.alive() and len(self.compiled.programs) != self.programs_at_fork:
            self._kill()  # this process captured since the fork: a new fork inherits the captures
        if not self.alive():
            if self.pid is not None and self.exitcode not in (None, -9):
                log.warning("dipc: the background planner exited (code %s); restarting it", self.exitcode)
            self.close()
            self._start()
        if self._sender is None or not self._sender.is_alive():
            self._outbox = queue.Queue()
            self._sender = threading.Thread(target=self._send_loop, args=(self.conn, self._outbox), daemon=True,
                                            name="dipc-planner-sender")
            self._sender.start()
        self._outbox.put(frame)
        self.submitted = step

    @staticmethod
    def _send_loop(conn, outbox) -> None:
        while True:
            frame = outbox.get()
            if frame is None:
                return
            try:
                conn.send_bytes(frame)
            except Exception:  # noqa: BLE001 - the planner died or was closed: take() says so
                return

    def _read(self, timeout: float) -> bool:
        """Read one message within ``timeout`` seconds into the inbox; False when none came.

        Raises:
            EOFError, OSError: the planning process closed its end (died)."""
        if not self.conn.poll(max(timeout, 0.0)):
            return False
        msg = decode_json(self.conn.recv_bytes())
        if "simulation" in msg and "plan" not in msg:
            self.simulations[msg["step"]] = msg["simulation"]
        else:
            self.inbox[msg.get("seq", -1)] = msg
        return True

    def take(self, step: int, wait_s: float) -> tuple[dict | None, str]:
        """The planner's reply for ``step`` (``{"step", "digest", "plan", "seconds"}``), waiting at most ``wait_s``
        seconds; ``(None, reason)`` when it is not there in time, failed or the process died."""
        if self.submitted != step or self.conn is None:
            return None, "no batch for this step was given to the planner"
        deadline = time.monotonic() + max(wait_s, 0.0)
        while self.seq not in self.inbox:
            try:
                if not self._read(deadline - time.monotonic()):
                    self.submitted = None
                    return None, f"the plan was not ready {wait_s:g} s after the step began (deadline missed)"
            except (EOFError, OSError):
                self.submitted = None
                for _ in range(100):  # it closed its end: collect its exit status (within 1 s)
                    if not self.alive():
                        break
                    time.sleep(0.01)
                return None, f"the planner process died (exit code {self.exitcode})"
        reply = self.inbox.pop(self.seq)
        self.submitted = None  # consumed: a retry of this step (after a failure) plans synchronously
        self.inbox.clear()  # replies to older requests
        for old in [s for s in self.simulations if s < step - 1]:  # reports nobody read
            del self.simulations[old]
        if reply.get("needs_capture"):
            return None, f"the look-ahead needs a capture the planner does not have ({reply['error']})"
        if "error" in reply:
            return None, f"the planner failed: {reply['error']}"
        return reply, ""

    def simulation(self, step: int) -> dict | None:
        """The simulated figures of step ``step``'s plan if they arrived (never waits)."""
        try:
            while self.conn is not None and self._read(0.0):
                pass
        except (EOFError, OSError):
            pass
        for old in [s for s in self.simulations if s < step]:
            del self.simulations[old]
        return self.simulations.pop(step, None)

    def close(self) -> None:
        """Stop the planning process (it also exits when this process does: its pipe closes)."""
        if self._outbox is not None:
            self._outbox.put(None)
            self._sender = None
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        if self.pid is not None and self.alive():
            for _ in range(50):  # it exits on the closed pipe once its current plan is done
                if not self.alive():
                    break
                time.sleep(0.01)
            if self.alive():
                import signal

                os.kill(self.pid, signal.SIGKILL)
                self._reap(block=True)
        self.pid = None
        self.conn = None
