"""run.strategy=fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) and the sharded checkpoint it writes.

Sharding is models/fsdp.py's `apply_fsdp` (torchtitan's way: `fully_shard` on each transformer layer, then on the
root; under run.precision=bf16, bf16 parameters and fp32 reductions with no autocast), which `plan`'s count of a
sharded step uses too, here over an explicit 1-D device mesh of the process group Ray Train set up (gloo on CPU,
NCCL on CUDA). Layers that share a parameter with the rest of the model (Linformer's layerwise projections), and
the layers of a reversible stack or of a Transformer-XL memory stack (which call a layer's sub-blocks or
`forward_with_memory`, not the layer itself, so the layer's all-gather hooks would not fire) stay in the root's
group instead.

A sharded checkpoint is written through torch.distributed.checkpoint (DCP): every rank writes its own shard of the
model and optimizer tensors (`__<rank>_0.distcp`), rank 0 the index (`.metadata`); nothing is gathered onto one
rank. Only tensors go through DCP, flat-keyed `model/<fqn>` and `optim/<fqn>/<slot>`; the optimizer's param
groups and everything else travel in the checkpoint's `state.pt` (orchestrator/training/checkpoint.py).

Reading it back must not run code: DCP reads its `.metadata` with plain `pickle.load`, and any non-tensor item with
`torch.load(weights_only=False)`. `SafeShardReader` reads the index with an unpickler that knows only DCP's own
metadata classes, and refuses an index that lists a non-tensor item (this project never writes one).

FSDP's import (torch.distributed.fsdp and DTensor) costs about half a second of a worker's start, so only a run
that shards imports it, inside the functions below (benchmarks/RESULTS.md, "Start-up against a bare Ray Train run").
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.fsdp import apply_fsdp

SHARDS_DIR = "sharded"
"""The DCP folder inside a checkpoint directory."""
MODEL_PREFIX, OPTIM_PREFIX = "model/", "optim/"


def is_sharded(model: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model`, asked without importing FSDP (nothing can be sharded before
    something imported it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def shard_model(model: nn.Module, device: torch.device, precision: str, world_size: int) -> nn.Module:
    """`model` (on `device`) sharded in place across the default process group's `world_size` ranks, as
    models/fsdp.py shards every model."""
    from torch.distributed.device_mesh import init_device_mesh

    return apply_fsdp(model, init_device_mesh(device.type, (world_size,)), precision)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on rank 0, on CPU ({} on the other ranks); a collective of every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def evaluate_replica(replica: nn.Module, weights: dict[str, torch.Tensor], device: torch.device,
                     evaluate: Callable[[nn.Module], dict[str, float]]) -> dict[str, float]:
    """`evaluate` (Task.evaluate) of rank 0's unsharded replica, loaded with `weights` (`full_model_state`), on the
    training `device`, in eval mode and without gradients. The replica lives in host memory, where Trainer.create
    copied it before the model went to the device: it moves to the device for the evaluation only, so training
    keeps the device's memory for its shards, and evaluation does not run at the CPU's speed while the other ranks
    wait for rank 0 in their next collective (where a long enough wait meets the process group's timeout).
    It goes back to host memory and train mode afterwards, also when the evaluation fails."""
    home = next(replica.parameters()).device
    replica.load_state_dict(weights)
    replica.to(device)
    replica.eval()
    try:
        with torch.no_grad():
            return evaluate(replica)
    finally:
        replica.to(home)
        replica.train()


def shard_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict]]:
    """This rank's shards of the model and optimizer tensors, flat-keyed for DCP, and the optimizer's param
    groups (plain values, the same on every rank; parameters named by FQN)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    flat: dict[str, Any] = {MODEL_PREFIX + name: value for name, value in model_state.items()}
    for name, slots in optim_state["state"].items():
        for slot, value in slots.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}/{slot} is a {type(value).__name__}, not a tensor: only "
                                "tensors go into a sharded checkpoint")
            flat[f"{OPTIM_PREFIX}{name}/{slot}"] = value
    return flat, optim_state["param_groups"]


def save_shards(flat: dict[str, Any], directory: Path) -> None:
    """Every rank writes its shards into `directory` (its own local folder is fine: Ray Train gathers the ranks'
    folders into one checkpoint); rank 0 also writes the index. A collective of every rank."""
    import torch.distributed.checkpoint as dcp

    dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(directory)))


def restore_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any]) -> None:
    """Load full (unsharded, FQN-keyed) model and optimizer states into a sharded model: each rank keeps its
    shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))


class ShardMismatchError(ValueError):
    """A sharded checkpoint of another model (not a damaged one: resuming from an older checkpoint would not help)."""


def restore_own_shards(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                       param_groups: list[dict]) -> None:
    """Read a sharded checkpoint's DCP folder straight into this rank's shards, as torchtitan resumes: DCP reads,
    for each tensor, only the parts that overlap this rank's shard, so no rank holds the full state (which
    `restore_sharded` needs: the model, gradients-sized AdamW moments and all, on every rank at once). A run resumed
    on another number of ranks is resharded by the same read. A collective of every rank; a shard file missing or
    cut short fails every rank alike with a ShardReadError (DCP gathers the ranks' read errors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat, _ = shard_tensors(model, optimizer)  # AdamW's moments made by a zero step first (torch's state_dict.py)
    reader = safe_shard_reader(directory)
    with _shard_read(directory):
        stored = reader.read_metadata().state_dict_metadata
    wrong = sorted(key for key, value in flat.items()
                   if not isinstance(stored.get(key), TensorStorageMetadata) or stored[key].size != value.shape)
    if wrong:
        raise ShardMismatchError(f"{directory} does not hold this model's tensors: {wrong[:3]} are missing or of "
                                 "another shape; resume with the spec that wrote it")
    with _shard_read(directory):
        dcp.load(flat, storage_reader=reader)
    model_state, optimizer_state = _unflatten(flat, param_groups)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def _unflatten(flat: dict[str, Any], param_groups: list[dict]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`shard_tensors`' flat keys back to a model state and an FQN-keyed optimizer state."""
    model_state = {k[len(MODEL_PREFIX):]: v for k, v in flat.items() if k.startswith(MODEL_PREFIX)}
    slots: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(OPTIM_PREFIX):
            name, slot = key[len(OPTIM_PREFIX):].rsplit("/", 1)
            slots.setdefault(name, {})[slot] = value
    return model_state, {"state": slots, "param_groups": param_groups}


# --- reading a sharded checkpoint as data ------------------------------------------------------------------


class ShardIndexError(ValueError):
    """A DCP index that is not one this project writes."""


class ShardReadError(ValueError):
    """A rank's shard missing or cut short: DCP's read failed (under a process group, on every rank alike)."""


@contextlib.contextmanager
def _shard_read(directory: Path) -> Iterator[None]:
    """DCP's read error, a BaseException (CheckpointException) whose last line names the failing file, as a
    ShardReadError that says so."""
    try:
        yield
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit, ShardIndexError)):
            raise
        last = next((line.strip() for line in reversed(str(err).splitlines()) if line.strip()), type(err).__name__)
        raise ShardReadError(f"{directory} cannot be read, a rank's shard is missing or incomplete: "
                             f"{last[-300:]}") from None


@functools.cache
def _index_globals() -> dict[str, dict[str, Any]]:
    """module -> name -> object: everything a DCP index of tensors may name (built once, on the first read)."""
    from torch.distributed.checkpoint import filesystem, metadata

    return {
        "torch.distributed.checkpoint.metadata": {
            n: getattr(metadata, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING")},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo": filesystem._StorageInfo},
        "torch.serialization": {"_get_layout": torch.serialization._get_layout},
        "torch": {"Size": torch.Size, **{n: getattr(torch, n) for n in dir(torch)
                                          if isinstance(getattr(torch, n, None), torch.dtype)}},
        "pathlib": {"PosixPath": Path, "WindowsPath": Path, "Path": Path},
        "collections": {"OrderedDict": dict},
    }


class _IndexUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch.Size, dtypes and layouts; nothing else can be named in the index."""

    def find_class(self, module: str, name: str) -> Any:
        found = _index_globals().get(module, {}).get(name)
        if found is None:
            raise ShardIndexError(f"the index names {module}.{name}, which a DCP index of tensors never holds")
        return found


def safe_shard_reader(directory: Path) -> Any:
    """A DCP FileSystemReader whose index is read as data (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

    class SafeShardReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            index = Path(self.path) / ".metadata"
            try:
                metadata = _IndexUnpickler(io.BytesIO(index.read_bytes())).load()
            except (pickle.UnpicklingError, ShardIndexError, EOFError, AttributeError, TypeError) as err:
                raise ShardIndexError(f"{index} is refused: {err}; a sharded checkpoint's index names DCP's "
                                      "metadata classes only, and reading anything else could run code") from None
            entries = getattr(metadata, "state_dict_metadata", None)
            if not isinstance(entries, dict):
                raise ShardIndexError(f"{index} is not a DCP index")
            if others := sorted(k for k, v in entries.items() if isinstance(v, BytesStorageMetadata)):
                raise ShardIndexError(f"{index} lists non-tensor items {others[:3]}: DCP would unpickle them with "
                                      "code execution allowed, and this project's sharded checkpoints hold none")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeShardReader(str(directory))


def load_full_state(directory: Path, param_groups: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full model state and the full (FQN-keyed) optimizer state of a sharded checkpoint's DCP folder, read
    in this process alone on CPU (whatever the number of ranks that wrote it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with _shard_read(directory), warnings.catch_warnings():
        # DCP's "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        entries = safe_shard_reader(directory).read_metadata().state_dict_metadata
        flat = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                for key, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}
        dcp.load(flat, storage_reader=safe_shard_reader(directory), no_dist=True)
    return _unflatten(flat, param_groups)
