"""A second device simulated on the CPU, so a CPU-only run can see a tensor made on the wrong device.

On a GPU, `torch.arange(T)` (no `device=`) combined with a CUDA tensor raises; on a CPU-only machine every tensor
is on the CPU and the missing `device=` goes unnoticed. The `meta` device catches it only where the code needs
no values (a host sync such as `int(x.max())` cannot run on meta). `OtherDevice` runs everything on the CPU with
real values but keeps track of which tensors live on a second device, `OTHER` (reported as `cpu:1`):

- a tensor is on OTHER if it was tagged (`to_other`), created with `device=OTHER`, moved there (`.to(OTHER)`), or
  computed from a tensor on OTHER; `x.device` of such a tensor is OTHER, so `device=x.device` follows it;
- `.cpu()` / `.to("cpu")` bring a copy back to the plain CPU;
- an operation mixing a tensor on OTHER with a plain CPU tensor of one or more dimensions raises, as CUDA does
  (a 0-dim CPU tensor is allowed, as CUDA allows it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

OTHER = torch.device("cpu", 1)
_TAG = "_on_other_device"


def on_other(t: torch.Tensor) -> bool:
    return getattr(t, _TAG, False)


def _tag(x):
    if isinstance(x, torch.Tensor):
        setattr(x, _TAG, True)
    return x


def to_other(x):
    """Tag a tensor, or every parameter and buffer of a module, as living on OTHER (in place)."""
    if isinstance(x, nn.Module):
        for t in [*x.parameters(), *x.buffers()]:
            _tag(t)
        return x
    return _tag(x)


def _is_other(d) -> bool:
    return isinstance(d, (torch.device, str)) and torch.device(d) == OTHER


def _is_plain_cpu(d) -> bool:
    return isinstance(d, (torch.device, str)) and torch.device(d) == torch.device("cpu")


class OtherDevice(TorchFunctionMode):
    """Within `with OtherDevice():`, tensors on OTHER and on the plain CPU cannot be mixed (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return OTHER if on_other(args[0]) else func(*args)
        device_args = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))]
        to_other_device = any(_is_other(d) for d in device_args)
        to_cpu = func == torch.Tensor.cpu or (func == torch.Tensor.to and any(_is_plain_cpu(d) for d in device_args))
        if to_other_device:
            args = tuple(torch.device("cpu") if _is_other(a) else a for a in args)
            if _is_other(kwargs.get("device")):
                kwargs = {**kwargs, "device": torch.device("cpu")}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tagged = [t for t in tensors if on_other(t)]
        plain = [t for t in tensors if not on_other(t) and t.dim() > 0]
        if tagged and plain and not (to_other_device or to_cpu):
            raise RuntimeError(f"{getattr(func, '__name__', func)}: expected all tensors on {OTHER}, found "
                               f"{len(plain)} on the plain CPU (a tensor created without the input's device?)")
        out = func(*args, **kwargs)
        if to_cpu:
            return out.clone() if any(out is t for t in tensors) else out
        if to_other_device or tagged:
            if tensors and not to_other_device and any(out is t for t in tensors if not on_other(t)):
                return out  # an in-place op on a plain tensor with only 0-dim tagged inputs stays plain
            return tree_map(_tag, out)
        return out
