"""Compile a Triton kernel for an NVIDIA GPU on a machine without one, through Triton's bundled ptxas: what the
compiler makes of it (errors only the compiler finds, the shared memory it allocates), for
tests/test_kernels.py `test_kernels_compile_for_gpu` and benchmarks/methods/kernel_shared_memory.py. Call it in a
process without TRITON_INTERPRET.

The signature is the one a launch on contiguous tensors gives: head-dim strides of 1 as constants and 16-byte
aligned pointers and strides, without which Triton does not pipeline the loads. Arguments named in capitals are
bf16 tensors unless ARG_TYPES says otherwise; every other argument is an int32 size or stride.
"""

from __future__ import annotations

import inspect
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ARG_TYPES = {
    "qk_scale": "fp32", "sm_scale": "fp32", "Lse": "*fp32", "Delta": "*fp32", "Kpm": "*u8", "Pad": "*u8", "Pos": "*i64",
    "HALF": "*i32", "IDS": "*i64", "QTok": "*i64", "KTok": "*i64", "GBlock": "*i64", "SRow": "*i64",
    "FirstGroup": "*i64", "SampleStart": "*i64", "LogW": "*fp32", "DKS": "*fp32", "DVS": "*fp32", "LSE": "*fp32",
    "LSE_OUT": "*fp32", "WEIGHT": "*fp32", "G_LSE": "*fp32", "G_LSE_R": "*fp32", "LSE_A": "*fp32", "LSE_B": "*fp32",
    "ALPHA": "*fp32", "BETA": "*fp32", "G_LSE_A": "*fp32", "G_LSE_B": "*fp32", "BUCKET": "*i64", "ORDER": "*i64",
    "TOKEN": "*i32", "POS": "*i64", "RANK": "*i64", "RANK_K": "*i64", "RANK_Q": "*i64", "KEY_K": "*i64",
    "KEY_Q": "*i64", "KEY_SORTED": "*i64", "BLOCK_OUT": "*i64", "QUERY": "*i64", "K_ROWS": "*i64", "Q_SLOTS": "*i64",
    "U": "*fp32", "GROUP_BLOCK": "*i64", "SROW": "*i64", "SSTART": "*i64", "FIRST_GROUP": "*i64", "LOGW": "*fp32",
    "D": "*fp32", "eps": "fp32", "Tok": "*i32", "BLOCK_IN": "*i64",
}  # fmt: skip
"""The arguments that are not bf16 tensors or int32 scalars: fp32 statistics and scales, int index tensors."""


def compile_for(fn: Any, constexprs: dict[str, Any], num_warps: int, num_stages: int, arch: int) -> Any:
    """`fn` (a @triton.jit function, or one under @triton.heuristics) compiled for sm_`arch`. Every constexpr of
    the kernel must be in `constexprs`: one left out would be compiled as a runtime argument (a capitalised one as
    a pointer), not the kernel that runs."""
    if isinstance(fn, triton.runtime.autotuner.Heuristics):
        fn = fn.fn
    constexprs = {**constexprs, **{n: 1 for n in fn.arg_names if n.startswith("stride_") and n.endswith("d")}}
    flags = [n for n, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)]
    missing = sorted(set(flags) - set(constexprs))
    if missing:
        raise ValueError(f"{fn.__name__}: constexprs not given: {missing}")
    signature = {name: "constexpr" if name in constexprs else
                 ARG_TYPES.get(name, "*bf16" if name[0].isupper() else "i32") for name in fn.arg_names}
    aligned = [i for i, n in enumerate(fn.arg_names) if signature[n] not in ("constexpr", "fp32")
               and (n[0].isupper() or n.startswith("stride_"))]
    source = ASTSource(fn, signature, {(fn.arg_names.index(n),): v for n, v in constexprs.items()},
                       {(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def shared_memory(fn: Any, constexprs: dict[str, Any], num_warps: int, num_stages: int, arch: int) -> int:
    """Bytes of shared memory the compiler allocates for `fn` on sm_`arch` (see `compile_for`)."""
    return compile_for(fn, constexprs, num_warps, num_stages, arch).metadata.shared
