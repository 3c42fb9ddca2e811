"""dipc: compile large multimodal models into modality-aware, dynamically scheduled training pipelines.

Implements DIP (Xue et al., ASPLOS 2026, arXiv 2504.14145; first titled PipeWeaver).  See README.md and
DESIGN.md for the architecture; ``dipc.compile`` is the entry point.
"""
from .batch import BatchError, Instances, LossReduction
from .capture import CaptureError
from .compiler import CompiledPipeline, Program, compile
from .plan import Action, Plan, PlanError, TensorSpec
from .validation import validate
from .passes.partition import PartitionError
from . import launch
from .sim import DeviceProfile, SimResult, simulate_plan
from .api import simulate
from .codegen.templates import schedules
from .runtime import StepReport, prefetch

__all__ = ["compile", "CompiledPipeline", "Program", "Instances", "LossReduction", "BatchError", "CaptureError",
           "PartitionError", "Plan", "Action", "TensorSpec", "PlanError", "validate", "launch", "simulate",
           "simulate_plan", "SimResult", "DeviceProfile", "schedules", "prefetch", "StepReport"]
__version__ = "0.1.0"
