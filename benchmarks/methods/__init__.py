"""Benchmarks of the attention methods themselves: speed and memory against sequence length
(`attention_scaling`), the Triton flash kernel against SDPA's flash backend on a GPU (`kernels`), decoding with a
key/value cache against recomputation (`decoding`, `patched_decoding`), and what a method's quality depends on
(`causal_leak`: the paper routing's use of the future; `memory_swap`: Transformer-XL's memory length), and the
glue around the attention kernels counted on fake tensors (`attention_glue`: peak memory, bytes and launches).
Each is run as `python -m benchmarks.methods.<name>`; importing this package imports none of them.
"""
