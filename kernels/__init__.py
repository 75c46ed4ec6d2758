"""Attention kernels: Triton FlashAttention-2 style kernels (Dao, 2023, arXiv 2307.08691), their PyTorch
references, and the dispatch between them.

Models call the dispatching functions ``exact_attention`` and ``chunked_attention``; both return
``(out, lse)``. Importing this package needs neither triton nor CUDA: the Triton kernels are compiled on
first use.
"""

# The modules kernels.flash_attention and kernels.chunked_attention share names with functions exported
# here. Importing a submodule binds it as an attribute of this package, so they are imported first and
# the function names are bound after them; later imports find them in sys.modules and rebind nothing.
from kernels.chunked_attention import chunked_flash_attention
from kernels.flash_attention import flash_attention
from kernels.reference import chunked_attention_reference, exact_attention_reference
from kernels.dispatch import chunked_attention, exact_attention, select_backend  # noqa: I001 (order matters)

__all__ = [
    "chunked_attention",
    "chunked_attention_reference",
    "chunked_flash_attention",
    "exact_attention",
    "exact_attention_reference",
    "flash_attention",
    "select_backend",
]
