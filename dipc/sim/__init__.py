"""The simulator's layer (DIP §2.6): device profiles (:mod:`dipc.sim.device`), operator microbenchmarks and the fits
that calibrate a profile (:mod:`dipc.sim.microbench`), the plan simulator (:mod:`dipc.sim.simulate`) and traces and
Gantt charts of simulated or measured steps (:mod:`dipc.sim.trace`).

It sits above the IR (plans, stage graphs) and below the planner, which prices its candidate schedules with it; it
never imports the planner, the runtime or the compiler (the ``layers`` contract in ``pyproject.toml``).
"""
from .device import DeviceProfile
from .simulate import SimResult, simulate_plan, simulate_workload

__all__ = ["DeviceProfile", "SimResult", "simulate_plan", "simulate_workload"]
