"""Symbolic per-node cost pass: FLOPs, bytes and saved activations as sympy expressions in the input sizes.

DIP's simulator (shared/PAPER.md §2.6) prices every operator as
``max(alpha_f * N_fop / F, alpha_mem * N_mem / B_mem, alpha_net * N_net / B_net)`` and sizes activation memory from
the tensors autograd keeps.  The planner re-costs every (chunk, sub-microbatch shape) of every batch, so the costs
here are *symbolic*: each node of a :func:`dipc.capture.capture` graph gets a :class:`SymCost` whose fields are sympy
expressions in the capture's size symbols (the ``s72``, ``s99`` ... of the placeholders' fake tensors: batch,
sequence length, number of images, image height and width, ...).  They are derived from the node's symbolic shapes
by rules per *op family*, never per model, and a chunk's (or segment's) sum is compiled once with
``sympy.lambdify`` (:func:`compile_costs`) so that costing a new shape is a plain Python function call (a few
microseconds; a shape seen before is a dict lookup), with no re-trace and no ``subs``.

Units: FLOPs (a multiply-add counts 2, as ``torch.utils.flop_counter``), bytes (element count x dtype itemsize).

Families and rules (forward F; backward B; "rg" = the operand carries a gradient, see below):

============  ==========================================================  ==========================================
family        forward FLOPs                                               backward FLOPs
============  ==========================================================  ==========================================
matmul        ``linear``/``mm``/``addmm``/``matmul``/``bmm``/``baddbmm``/  F per operand that needs a gradient
              ``mv``/``dot``/``einsum``/``_scaled_mm``: 2*M*N*K, i.e.      (grad_input = grad_out @ W^T, grad_W =
              2 * numel(out) * K (bias adds not counted)                   x^T @ grad_out): 2F when both do, F for
                                                                          a layer whose input carries no gradient
attention     ``scaled_dot_product_attention`` and its ``_flash``/         flop_counter's flash-style count:
              ``_efficient``/``_cudnn``/``_for_cpu`` variants: Q K^T and   2*BH*Sq*Sk*(3*Dq + 2*Dv) (scores are
              P V = 2*BH*Sq*Sk*Dq + 2*BH*Sq*Sk*Dv (BH = batch x query     recomputed; dQ, dK, dV, dP), i.e. 2.5F
              heads; grouped KV heads broadcast)                          for Dq = Dv
conv          ``conv{1,2,3}d``/``convolution``/``conv_transpose*``:        F for grad_input (if rg) + F for grad_W
              2 * N * C_out * C_in/groups * kernel volume * output        (if rg)
              spatial size (input spatial size when transposed)
embedding     0 (a gather; bytes = indices + gathered rows)               0 (scatter-add)
elementwise,  0: these are memory-bound; their latency comes from the     0
reduction,    bytes term of the roofline.  This matches
norm,         ``torch.utils.flop_counter.FlopCounterMode``, which counts
softmax,      only matmul, convolution and attention FLOPs, and the MFU
loss, other   convention; a model of vector FLOP/s would be a separate
              field.
view          0, and 0 bytes: metadata only (view, reshape, transpose,    0
              expand, slice, getitem, sym_size, assertions...); a
              reshape/contiguous/cast that copies (the capture's fake
              tensors tell: e.g. the reshape of a GQA-expanded K) is
              "other" (or "elementwise" for a cast) and moves bytes
============  ==========================================================  ==========================================

Causal attention: flop_counter counts the dense ``Sq x Sk`` score matrix whether or not the attention is causal, and
so does this pass by default; ``annotate_symbolic_cost(graph, causal_fraction=0.5)`` counts the half a causal flash
kernel actually computes (the calibrated alpha of the "attention" family absorbs either choice).

Bytes: ``bytes_read`` = distinct elements of the tensor inputs (an expanded input counts its storage, a parameter
counts: weights are read from memory) x itemsize, except gathers (embedding, index, gather, index_select), which read
the indices and the gathered rows only; ``bytes_written`` = the outputs.  ``bytes_bwd`` (backward memory traffic) =
grad_out read once per operand gradient + the operand gradients written + the saved tensors read.

Activation bytes: what autograd keeps from forward to backward, per op (only when the node's output carries a
gradient): linear/matmul keep the operand the *other* operand's gradient needs (parameters are not activations);
attention keeps q, k, v, its mask or bias, out and the fp32 logsumexp (flash layout); norms keep their input and fp32 statistics;
softmax, exp, tanh, sigmoid, rsqrt, sqrt, relu keep their output; other nonlinear pointwise ops (gelu, silu, pow, sin,
...) keep their input; mul/div keep the operands; where/masked_fill keep the mask; gathers keep their indices;
cross-entropy keeps its fp32 log-probabilities and targets; add/sub/neg/casts/views/cat/reductions keep nothing.
Saved tensors are identified by their storage (views are followed back to their base), and :func:`compile_costs`
counts each once per node list: the q, k and v projections that all keep the same normalised input cost one copy.

Recompute (DIP's memory strategies, §2.5): a chunk run with activation recomputation keeps only its inputs, and its
backward first re-runs the forward: ``flops_bwd_recompute = flops_fwd + flops_bwd``,
``activation_bytes_recompute = input_bytes`` (the chunk's inputs from the batch and from other chunks; parameters
excluded), ``bytes_bwd_recompute = bytes_bwd + bytes_read + bytes_written``.  See :func:`recompute`.

Gradient flow ("rg"): a placeholder whose fake value has ``requires_grad`` (a trainable parameter) carries a
gradient, and so does every floating-point value computed from one.  Placeholders are *state* (parameters,
buffers, lifted constants: torch.export names them ``p_*``, ``b_*``, ``c_*``) or *inputs* (the batch); pass
``inputs=capture.input_keys`` to say which explicitly.

Sets ``node.meta["dipc_symcost"]`` (a :class:`SymCost`) on every ``call_function`` node and
``node.meta["dipc_symcost_state"]`` (bool) on every placeholder.  Pure: no process group, no I/O, no weights read
(works on models built on the meta device).

Package layout (one module per concern; the op families' rules are split along their own seams):

* :mod:`.record`: the cost record :class:`SymCost`, :data:`FIELDS` and :func:`recompute`;
* :mod:`.shapes`: sympy helpers on fake tensors (sizes, element counts, bytes, storage bytes);
* :mod:`.families`: the op-name sets per family, :func:`op_family` and the alias / no-op-cast tests;
* :mod:`.context`: :class:`GraphContext`, the per-graph gradient flow, state placeholders and storage keys;
* :mod:`.flops`: the FLOP rules of the matmul/einsum, attention and conv families;
* :mod:`.rules`: the per-node cost rules and the pass, :func:`annotate_symbolic_cost`;
* :mod:`.compiled`: :class:`CompiledCost`, :func:`compile_costs` and :func:`compile_groups`.
"""
from .compiled import CompiledCost, compile_costs, compile_groups
from .context import GraphContext
from .families import FAMILIES, SELECTIVE_SAVED_FAMILIES, op_family, op_name_family
from .record import FIELDS, SymCost, recompute
from .rules import annotate_symbolic_cost

__all__ = ["SymCost", "FAMILIES", "SELECTIVE_SAVED_FAMILIES", "annotate_symbolic_cost", "op_family", "op_name_family",
           "recompute", "compile_costs", "CompiledCost", "compile_groups", "FIELDS", "GraphContext"]
