"""Pick the attention backend for a call: the Triton kernels on CUDA, else PyTorch: the blockwise exact
attention (no M x N tensor kept for the backward) for large inputs, the reference for small ones and for
attention dropout.

Each backend declares what it supports as class attributes and explains itself through
``not_supported_reasons``; ``select_backend`` walks an explicit priority list and, when nothing fits, says
why each backend was rejected (after xFormers' ``ops/fmha/dispatch.py``).

``ATTN_BACKEND=triton|blockwise|reference`` forces one backend. It is also the only way CPU tensors reach
the Triton kernels, through the interpreter (TRITON_INTERPRET=1): automatic dispatch would otherwise send
every CPU test of the models through an interpreter that is orders of magnitude slower than PyTorch.

``stand_in_kernels()`` selects, before anything else (ATTN_BACKEND included), the stand-in for the Triton
kernels: the Triton backend's own functions with every launch counted instead of run (kernels/stand_in.py). On
fake tensors (``FakeTensorMode``) a model then allocates what it would allocate on a GPU (the kernels' outputs,
what their autograd.Functions save, the backward's delta, dq, dk, dv) and the launches are counted: the CPU
proxies of benchmarks/methods/attention_glue.py. Outside that context the stand-in rejects every call.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels import stand_in
from kernels.blockwise import BLOCK_ELEMENTS, exact_attention_blockwise
from kernels.chunked_attention import chunked_flash_attention
from kernels.flash_attention import MAX_HEAD_DIM, MIN_HEAD_DIM, TRITON_DTYPES, flash_attention, interpreter_enabled
from kernels.reference import SUPPORTED_DTYPES, chunked_attention_reference, exact_attention_reference

BACKEND_ENV = "ATTN_BACKEND"
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
"""Asked once, at import: inside a compiled model a call of `find_spec` at each dispatch is a graph break (torch
2.11's dynamo refuses to trace it: tests/test_compile_families.py), where a module constant is folded."""


@dataclass(frozen=True)
class AttentionInputs:
    """What a backend needs to see to decide whether it can run a call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dropout_p: float
    forced: bool  # chosen through ATTN_BACKEND rather than by the priority walk


class BaseAttentionBackend:
    """A way of computing attention, with its limits declared up front."""

    name: ClassVar[str]
    devices: ClassVar[frozenset[str]]
    dtypes: ClassVar[tuple[torch.dtype, ...]]
    min_head_dim: ClassVar[int] = 1
    max_head_dim: ClassVar[int | None] = None
    needs_triton: ClassVar[bool] = False
    supports_dropout: ClassVar[bool] = False

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons = []
        if self.needs_triton and not TRITON_INSTALLED:
            reasons.append("triton is not installed")
        devices = {t.device.type for t in (inputs.q, inputs.k, inputs.v)}
        if not devices <= self.devices:
            reasons.append(f"device {sorted(devices)} not in {sorted(self.devices)}")
        if inputs.q.dtype not in self.dtypes:
            reasons.append(f"dtype {inputs.q.dtype} not in {list(self.dtypes)}")
        head_dim = inputs.q.shape[-1]
        if head_dim < self.min_head_dim or (self.max_head_dim is not None and head_dim > self.max_head_dim):
            reasons.append(f"head_dim {head_dim} outside {self.min_head_dim}..{self.max_head_dim}")
        if inputs.dropout_p > 0.0 and not self.supports_dropout:
            reasons.append(f"no attention dropout (dropout_p={inputs.dropout_p})")
        return reasons

    # The two operations, with the arguments of the public functions below (dropout_p already checked).
    exact: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]]


class TritonBackend(BaseAttentionBackend):
    name = "triton"
    devices = frozenset({"cuda", "cpu"})
    dtypes = TRITON_DTYPES
    min_head_dim = MIN_HEAD_DIM
    max_head_dim = MAX_HEAD_DIM
    needs_triton = True
    exact = staticmethod(flash_attention)
    chunked = staticmethod(chunked_flash_attention)

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        if inputs.q.device.type == "cpu":
            if not interpreter_enabled():
                reasons.append("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
            elif not inputs.forced:
                reasons.append(f"the interpreter on CPU tensors is used only when {BACKEND_ENV}=triton")
        return reasons


class ReferenceBackend(BaseAttentionBackend):
    name = "reference"
    devices = frozenset({"cpu", "cuda", "mps"})
    dtypes = SUPPORTED_DTYPES
    supports_dropout = True
    exact = staticmethod(exact_attention_reference)
    chunked = staticmethod(chunked_attention_reference)


class BlockwiseBackend(BaseAttentionBackend):
    """Exact attention a block of query rows at a time with a recomputing backward (kernels/blockwise.py);
    chunked attention is the reference's, whose memory is already linear in the sequence."""

    name = "blockwise"
    devices = frozenset({"cpu", "cuda", "mps"})
    dtypes = SUPPORTED_DTYPES
    exact = staticmethod(exact_attention_blockwise)
    chunked = staticmethod(chunked_attention_reference)

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        batch, heads, seq_q, _ = inputs.q.shape
        logits = batch * heads * seq_q * inputs.k.shape[2]
        if logits <= BLOCK_ELEMENTS and not inputs.forced:
            # One block would hold every row: the reference does the same work and keeps P instead of
            # recomputing it in the backward, so it is faster for the same memory.
            reasons.append(f"{logits} logits fit in one block of {BLOCK_ELEMENTS}; the reference is faster there")
        return reasons


class StandInBackend(TritonBackend):
    """The Triton backend's functions with their launches counted, not run (kernels/stand_in.py): for counting a
    GPU run's memory and launches on fake tensors, inside `stand_in_kernels()` only. It takes what the Triton
    kernels take, on any device (fake tensors say cpu); an input they refuse goes down the priority list as it
    would on a GPU."""

    name = "stand-in"
    devices = frozenset({"cpu", "cuda", "meta"})

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons = BaseAttentionBackend.not_supported_reasons(self, inputs)
        if not stand_in.standing_in():
            reasons.append("used only inside kernels.dispatch.stand_in_kernels() (counting on fake tensors)")
        return reasons


@contextmanager
def stand_in_kernels(counting: bool = True) -> Iterator[stand_in.KernelLog]:
    """Inside, attention calls the Triton kernels can take go to the stand-in, whatever ATTN_BACKEND says; the
    log counts their launches by kernel name (flash_fwd, chunked_bwd_dq, bwd_delta, ...), unless `counting` is
    False (for torch.compile's capture of the kernels' path: kernels.stand_in.KernelLog.counting).

        with FakeTensorMode(), stand_in_kernels() as log:
            layer(x).backward(grad)
        log.launches  # Counter({'chunked_fwd': 1, ...})
    """
    with stand_in.installed(stand_in.KernelLog(counting=counting)) as log:
        yield log


STAND_IN = StandInBackend()
TRITON = TritonBackend()
BLOCKWISE = BlockwiseBackend()
REFERENCE = ReferenceBackend()
# Priority order: first backend without objections wins. The reference comes last: it keeps the M x N
# probabilities for autograd, so it gets what fits in one block, attention dropout, or a forced call. The
# stand-in is not in it: inside stand_in_kernels() it goes before every candidate.
PRIORITY: tuple[BaseAttentionBackend, ...] = (TRITON, BLOCKWISE, REFERENCE)


def select_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> BaseAttentionBackend:
    """Walk PRIORITY (or only the backend named by ATTN_BACKEND), after the stand-in inside stand_in_kernels();
    raise with every rejection's reasons."""
    forced_name = os.environ.get(BACKEND_ENV, "").strip().lower()
    candidates: Sequence[BaseAttentionBackend] = PRIORITY
    if forced_name:
        candidates = [b for b in PRIORITY if b.name == forced_name]
        if not candidates:
            valid = ", ".join(b.name for b in PRIORITY)
            raise ValueError(f"{BACKEND_ENV}={forced_name!r} is not a backend; valid names: {valid}")
    if stand_in.standing_in():
        candidates = [STAND_IN, *candidates]  # counting stands in for the kernels, whatever is forced
    inputs = AttentionInputs(q, k, v, dropout_p, forced=bool(forced_name))
    rejected = []
    for backend in candidates:
        reasons = backend.not_supported_reasons(inputs)
        if not reasons:
            return backend
        rejected.append(f"  {backend.name}: " + "; ".join(reasons))
    raise NotImplementedError("no attention backend supports these inputs:\n" + "\n".join(rejected))


def fused_kernels(x: torch.Tensor) -> bool:
    """A method's own fused Triton kernels take `x` [B, H, T, E] (LSH's hash, kernels/lsh_hash.py; HyperAttention's
    blocks + samples, kernels/hyper_blocks.py; or their stand-in while counting) wherever attention on `x` would
    run on the Triton kernels; elsewhere the methods compute the same thing in PyTorch (models/attention/lsh.py
    `angular_argmax` a slice of tokens at a time; models/attention/hyper.py its two parts and their merge)."""
    return select_backend(x, x, x).name in (TRITON.name, STAND_IN.name)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention (out [B, H, M, D], lse [B, H, M]) on the best available backend; see
    kernels.reference.exact_attention_reference for the semantics (causal is aligned top-left)."""
    backend = select_backend(q, k, v, dropout_p)
    # Only a backend that supports dropout is given the argument; the others were rejected for dropout_p > 0.
    dropout = {"dropout_p": dropout_p} if dropout_p > 0.0 else {}
    return backend.exact(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, **dropout)


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: int,
    lookback: int = 1,
    positions: torch.Tensor | None = None,
    causal: bool = False,
    self_mask: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    wrap: bool = True,
    dropout_p: float = 0.0,
    token_of_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked attention over a sorted sequence on the best available backend; see
    kernels.reference.chunked_attention_reference for the semantics (and for `token_of_row`, the sorted order
    given as an index rather than as sorted copies)."""
    backend = select_backend(q, k, v, dropout_p)
    dropout = {"dropout_p": dropout_p} if dropout_p > 0.0 else {}
    return backend.chunked(
        q, k, v, chunk, lookback=lookback, positions=positions, causal=causal, self_mask=self_mask,
        key_padding_mask=key_padding_mask, scale=scale, wrap=wrap, token_of_row=token_of_row, **dropout,
    )  # fmt: skip
