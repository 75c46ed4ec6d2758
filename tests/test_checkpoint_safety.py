"""A checkpoint holds data, never code (orchestrator/training/checkpoint.py): a `state.pt` whose unpickling would
run code is refused by every reader of checkpoints (scoring and `orchestrator evaluate`, a resumed worker,
`model.init_from`, the local runner) without running it, while the checkpoints the project writes, now and
before, load and resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.launch import pretrained, worker
from orchestrator.launch.local_run import train_locally
from orchestrator.spec import spec_to_yaml, validate_spec
from orchestrator.storage.layout import checkpoint_name
from orchestrator.training.checkpoint import (
    STATE_FILE,
    CheckpointError,
    TrainingState,
    capture_rng,
    read_checkpoint,
    restore_rng,
    write_checkpoint,
)
from orchestrator.training.scoring import evaluate_checkpoint

GOLDEN = Path(__file__).parent / "assets" / "golden_losses.json"


class Payload:
    """Unpickling this creates `marker`: what a hostile `state.pt` would do with os.system instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _spec(tmp_path: Path):
    raw = json.loads(GOLDEN.read_text())["spec"]
    raw["run"] = {**raw.get("run", {}), "checkpoint_every": 2, "storage_path": str(tmp_path / "runs")}
    raw["optim"] = {**raw["optim"], "max_steps": 2, "warmup_steps": 1}
    return validate_spec(raw)


def _hostile_checkpoint(folder: Path, spec, marker: Path) -> Path:
    """A checkpoint folder as the project lays it out (spec.yaml beside it), whose state.pt runs code."""
    directory = folder / checkpoint_name(2)
    directory.mkdir(parents=True)
    torch.save({"step": 2, "model": {"w": torch.ones(1)}, "optimizer": Payload(marker), "scheduler": {},
                "scaler": {}, "data_positions": [None], "rng": [], "mlflow_run_id": None,
                "spec": spec.model_dump(mode="json")}, directory / STATE_FILE)
    (directory / "spec.yaml").write_text(spec_to_yaml(spec))
    (directory / "tokenizer.model").write_bytes(b"")
    return directory


def test_the_payload_does_run_when_a_checkpoint_is_read_as_a_full_pickle(tmp_path):
    """The hostile file below is real: the unrestricted loader runs it (which the readers must not use)."""
    marker = tmp_path / "ran"
    directory = _hostile_checkpoint(tmp_path / "run", _spec(tmp_path), marker)
    torch.load(directory / STATE_FILE, weights_only=False)
    assert marker.exists()


def test_every_reader_of_checkpoints_refuses_a_state_that_would_run_code(tmp_path, capsys):
    spec, marker = _spec(tmp_path), tmp_path / "ran"
    run = tmp_path / "run"
    directory = _hostile_checkpoint(run, spec, marker)
    message = rf"{directory / STATE_FILE} is refused: .*could run code"

    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(directory)
    with pytest.raises(CheckpointError, match=message):  # orchestrator evaluate, and every run's final scoring
        evaluate_checkpoint(directory, "test", cache_dir=tmp_path / "cache", out_dir=tmp_path / "out",
                            device=torch.device("cpu"))
    with pytest.raises(CheckpointError, match=message):  # model.init_from, on the worker
        pretrained.load(str(directory), tmp_path / "keep")
    with pytest.raises(CheckpointError, match=message):  # the local runner resuming from its folder
        train_locally(spec, cache_dir=tmp_path / "cache", folder=run)
    # A resumed Ray Train worker skips it as unreadable, says so, and starts from step 0 (no older checkpoint).
    def restore(state, shards):
        raise AssertionError("a refused checkpoint was restored")

    assert worker._restore_point(None, str(run), "unit", rank=0, restore=restore) == (None, {"checkpoint_000000002"})
    assert "checkpoint_000000002 (CheckpointError:" in capsys.readouterr().out
    assert not marker.exists()


def test_a_file_that_is_not_a_training_state_is_refused(tmp_path):
    for index, content in enumerate([[1, 2, 3], {"step": 1}, {"step": 1, "model": {}, "extra": 1}]):
        directory = tmp_path / str(index)
        directory.mkdir()
        torch.save(content, directory / STATE_FILE)
        with pytest.raises(CheckpointError, match="training state|fields no training state has"):
            read_checkpoint(directory)


def _state(rng: dict) -> TrainingState:
    return TrainingState(step=7, model={"w": torch.ones(2)}, optimizer={}, scheduler={}, scaler={},
                         data_positions=[{"epoch": 0, "step": 7}], rng=[rng], mlflow_run_id="abc", spec={"name": "x"})


def test_a_checkpoint_written_now_is_plain_data_and_restores_every_rng(tmp_path):
    rng = capture_rng()
    expected = (random.random(), np.random.rand(4), torch.rand(3))
    path = write_checkpoint(tmp_path, _state(rng), "name: x\n")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path / STATE_FILE) == []
    torch.load(path / STATE_FILE, weights_only=True)  # no allow-list needed
    restore_rng(read_checkpoint(path).rng[0])
    assert random.random() == expected[0]
    assert np.array_equal(np.random.rand(4), expected[1]) and torch.equal(torch.rand(3), expected[2])


def test_a_checkpoint_written_before_numpys_state_was_plain_data_still_loads_and_resumes(tmp_path):
    """Such a checkpoint holds np.random.get_state() itself: a tuple with a uint32 array."""
    rng = {**capture_rng(), "numpy": np.random.get_state()}
    expected = np.random.rand(4)
    directory = tmp_path / checkpoint_name(7)
    directory.mkdir()
    torch.save(_state(rng).__dict__, directory / STATE_FILE)
    assert any("_reconstruct" in name for name in torch.serialization.get_unsafe_globals_in_checkpoint(
        directory / STATE_FILE))
    loaded = read_checkpoint(directory)
    restore_rng(loaded.rng[0])
    assert np.array_equal(np.random.rand(4), expected) and loaded.step == 7


def test_a_run_resumes_from_its_own_checkpoint_after_the_change(tmp_path):
    """The local runner trains two steps, writes its checkpoint, and a second call resumes from it."""
    spec = _spec(tmp_path)
    train_locally(spec, cache_dir=tmp_path / "cache", folder=tmp_path / "run")
    longer = spec.model_copy(update={"optim": spec.optim.model_copy(update={"max_steps": 3})})
    trainer, _ = train_locally(longer, cache_dir=tmp_path / "cache", folder=tmp_path / "run")
    assert trainer.step == 3


def _sharded_checkpoints(run: Path, steps: tuple[int, ...]) -> None:
    """state.pt files of a sharded run (their tensors would be in sharded/, which the restore below stands in for)."""
    for step in steps:
        write_checkpoint(run, TrainingState(step=step, model={}, optimizer={"param_groups": []}, scheduler={},
                                            scaler={}, data_positions=[None], rng=[], mlflow_run_id=None,
                                            sharded=True), "name: x\n")


def test_a_resume_skips_a_sharded_checkpoint_whose_shards_cannot_be_read_and_nothing_else(tmp_path, capsys):
    """A resumed worker's ranks read their own shards inside `_restore_point`: a read error (a shard missing, DCP's
    error on every rank, as tests/test_fsdp.py raises it) skips that checkpoint for the one before, named by the
    end of its message; any other error of the restore (another
    model, another run.strategy) stops the run, since an older checkpoint would not do either."""
    from orchestrator.training.sharding import ShardReadError

    run = tmp_path / "run"
    _sharded_checkpoints(run, (2, 4))
    restored = []

    def shard_missing_at_4(state, shards):
        if state.step == 4:
            raise ShardReadError(f"{shards} cannot be read, a rank's shard is missing or incomplete: "
                                 f"FileNotFoundError: [Errno 2] No such file or directory: '{shards}/__1_0.distcp'")
        restored.append((state.step, shards.name))

    state, taken = worker._restore_point(None, str(run), "unit", rank=0, restore=shard_missing_at_4)
    assert state.step == 2 and restored == [(2, "sharded")] and taken == {checkpoint_name(2), checkpoint_name(4)}
    out = capsys.readouterr().out
    assert f"checkpoint {checkpoint_name(4)} (ShardReadError: " in out and "__1_0.distcp'" in out, out

    def another_model(state, shards):
        raise ValueError("does not hold this model's tensors")

    with pytest.raises(ValueError, match="this model's tensors"):
        worker._restore_point(None, str(run), "unit", rank=0, restore=another_model)
