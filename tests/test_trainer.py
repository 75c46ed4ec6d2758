"""The training core without Ray: cadence, token-weighted loss, best tracking, exact resume, checkpoint choice
for the final evaluation, and the exported model."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from models import LanguageModel, ModelConfig, Seq2SeqTransformer
from orchestrator.launch.evaluate import choose_checkpoint
from orchestrator.launch.local_run import latest_checkpoint, train_locally
from orchestrator.spec import validate_spec
from orchestrator.training.checkpoint import read_checkpoint
from orchestrator.training.export import load_model, export_model
from orchestrator.training.optimizer_step import LossMeter
from orchestrator.training.trainer import Best, Cadence, Trainer
from tasks import WorkerContext
from tests.local_training import FailAtStep3


def tiny_raw(name: str = "core", **optim) -> dict:
    return {
        "name": name,
        "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120,
                 "builtin": {"train_sentences": 200, "eval_sentences": 20}},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "dropout": 0.1,
                  "attention": {"kind": "mha", "heads": 2}},
        "optim": {"lr": 3e-3, "max_steps": 6, "warmup_steps": 1, "seed": 3, **optim},
        "run": {"checkpoint_every": 2, "eval_every": 2, "log_every": 1},
    }


def test_cadence_checkpoints_are_evaluations_and_the_last_step_always_reports():
    cadence = Cadence(max_steps=10, log_every=3, eval_every=4, checkpoint_every=5)
    assert [s for s in range(1, 11) if cadence.reports(s)] == [4, 5, 8, 10]
    assert [s for s in range(1, 11) if cadence.checkpoints(s)] == [5, 10]
    assert [s for s in range(1, 11) if cadence.logs(s)] == [3, 4, 5, 6, 8, 9, 10]
    assert all(cadence.reports(s) for s in range(1, 11) if cadence.checkpoints(s))
    assert cadence.report_count() == 4


def test_loss_meter_weights_micro_batches_by_their_tokens():
    meter = LossMeter()
    meter.add(torch.tensor(1.0), 30)
    meter.add(torch.tensor(4.0), 10)
    read = meter.read()
    assert read["train/loss"] == pytest.approx((1.0 * 30 + 4.0 * 10) / 40)  # not the mean of means, 2.5
    assert meter.read()["train/loss"] != meter.read()["train/loss"]  # an empty window is NaN, not a stale value


@pytest.mark.parametrize("mode, values, best, step", [("min", [3.0, 2.0, 2.5], 2.0, 2), ("max", [3.0, 2.0, 4.0], 4.0, 3)])
def test_best_keeps_the_better_value_and_its_step(mode, values, best, step):
    tracker = Best("val/x", mode)
    for i, value in enumerate(values, start=1):
        tracker.update({"val/x": value}, i)
    tracker.update({"val/x": math.nan}, 9)
    tracker.update({}, 10)  # a rank without validation metrics
    assert (tracker.value, tracker.step) == (best, step)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_tie_with_the_best_goes_to_the_later_step_as_ray_keeps_its_checkpoint(mode):
    # Ray's CheckpointConfig ranks the later of equal scores higher and, with num_to_keep=1, deletes the earlier
    tracker = Best("val/acc", mode)
    for step, value in ((10, 0.5), (20, 0.5)):
        tracker.update({"val/acc": value}, step)
    assert tracker.as_metrics() == {"best/val/acc": 0.5, "best/step": 20.0}


def test_a_worker_registers_its_restored_last_step_only_when_ray_holds_an_older_checkpoint():
    """A Train worker restored at optim.max_steps from a checkpoint Ray never registered has no report left to
    register it (orchestrator/launch/worker.py); one restored before the last step, or from Ray's own, does."""
    from types import SimpleNamespace

    from orchestrator.launch.worker import final_checkpoint_unregistered

    def ray_holds(name):
        return SimpleNamespace(path=f"s3://bucket/runs/r/{name}")

    at = {step: SimpleNamespace(step=step) for step in (10, 12)}
    assert final_checkpoint_unregistered(at[12], ray_holds("checkpoint_000000010"), max_steps=12)
    assert final_checkpoint_unregistered(at[12], None, max_steps=12)
    assert not final_checkpoint_unregistered(at[12], ray_holds("checkpoint_000000012"), max_steps=12)
    assert not final_checkpoint_unregistered(at[12], ray_holds("checkpoint_000000012-r1"), max_steps=12)
    assert not final_checkpoint_unregistered(at[10], ray_holds("checkpoint_000000008"), max_steps=12)  # trains on
    assert not final_checkpoint_unregistered(None, None, max_steps=12)
    assert not final_checkpoint_unregistered(at[12], None, max_steps=0)  # scoring only: no checkpoints


def test_local_resume_continues_the_loss_curve_and_the_best(tmp_path):
    spec = validate_spec(tiny_raw())
    _, reference = train_locally(spec, cache_dir=tmp_path / "cache")

    folder = tmp_path / "ckpt"
    trainer = Trainer.create(spec, WorkerContext(seed=spec.optim.seed, cache_dir=tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(FailAtStep3(spec, folder))
    assert read_checkpoint(latest_checkpoint(folder)).step == 2
    restored = Trainer.create(spec, WorkerContext(seed=spec.optim.seed, cache_dir=tmp_path / "cache"))
    restored.restore(read_checkpoint(latest_checkpoint(folder)))
    assert (restored.step, restored.best.step) == (2, 2)
    assert restored.best.value == dict(reference.history)[2]["val/ppl"]
    resumed_trainer, resumed = train_locally(spec, cache_dir=tmp_path / "cache", folder=folder)

    def curve(hooks, key):
        return {step: m[key] for step, m in hooks.history if key in m}

    after = {s: v for s, v in curve(reference, "train/loss").items() if s > 2}
    assert curve(resumed, "train/loss") == after
    assert curve(resumed, "val/ppl") == {s: v for s, v in curve(reference, "val/ppl").items() if s > 2}
    assert curve(resumed, "best/val/ppl")[6] == curve(reference, "best/val/ppl")[6]
    state = read_checkpoint(latest_checkpoint(folder))
    assert state.best["step"] == resumed_trainer.best.step and state.best["value"] == resumed_trainer.best.value


def _result(metric_values: dict[int, float]) -> SimpleNamespace:
    checkpoints = [(SimpleNamespace(path=f"/runs/x/checkpoint_{s:09d}"), {"step": s, "val/bleu": v})
                   for s, v in metric_values.items()]
    return SimpleNamespace(checkpoint=checkpoints[-1][0], metrics=checkpoints[-1][1], best_checkpoints=checkpoints)


def _translation_spec(**task):
    return validate_spec({"name": "t", "task": {"kind": "translation", "max_source_len": 16, **task},
                          "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16,
                                    "attention": {"kind": "mha", "heads": 2}}})


def test_final_evaluation_scores_the_best_checkpoint_not_the_latest():
    chosen = choose_checkpoint(_result({2: 10.0, 4: 30.0, 6: 20.0}), _translation_spec(), "best", "test")
    assert chosen.which == "best" and chosen.path.endswith("checkpoint_000000004")
    latest = choose_checkpoint(_result({2: 10.0, 4: 30.0, 6: 20.0}), _translation_spec(), "latest", "test")
    assert latest.path.endswith("checkpoint_000000006")


def test_selection_on_the_scored_split_falls_back_to_the_latest():
    """A spec that validates on test must not pick its test checkpoint by test score."""
    chosen = choose_checkpoint(_result({2: 10.0, 4: 30.0, 6: 20.0}), _translation_spec(eval_split="test"),
                               "best", "test")
    assert chosen.which == "latest" and chosen.path.endswith("checkpoint_000000006") and "eval_split" in chosen.note


def test_the_final_evaluation_task_makes_the_runs_store_its_own_on_any_node(monkeypatch):
    """final_evaluation scores as a Ray task on whichever node Ray picks; on a joined cluster that process has only
    the job's environment, without the store's endpoint (a local Ray's raylet passed the launcher's down, so no
    real-process test sees it). Ray's task runs here, in this process, with the endpoint unset."""
    import ray

    from orchestrator.launch import evaluate
    from orchestrator.storage.object_store import ENDPOINT_VARS

    for name in ENDPOINT_VARS:  # unset for the test, restored after it
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    seen = {}

    def score(spec, chosen, split, **kwargs):
        seen[split] = os.environ.get(ENDPOINT_VARS[0])
        return {f"{split}/bleu": 1.0}

    def remote(**resources):
        return lambda fn: SimpleNamespace(options=lambda **_: SimpleNamespace(remote=lambda *a, **k: fn(*a, **k)))

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", lambda value: value)
    monkeypatch.setattr(evaluate, "score_and_store", score)
    checkpoint = SimpleNamespace(path="s3://bucket/runs/t/checkpoint_000000004")
    monkeypatch.setattr(evaluate, "choose_checkpoint", lambda *_: evaluate.ChosenCheckpoint(checkpoint, "best", {}))
    raw = _translation_spec().model_dump(mode="json")
    raw["run"].update(storage_path="s3://bucket/runs", storage_endpoint="http://10.0.0.5:8333")
    metrics = evaluate.final_evaluation(validate_spec(raw), None, "s3://bucket/runs/t", cache_dir="/tmp/cache")
    assert metrics == {"test/bleu": 1.0} and seen == {"test": "http://10.0.0.5:8333"}


def test_a_checkpoint_is_scored_with_the_runs_matmul_precision(tmp_path, monkeypatch):
    """The final evaluation and `orchestrator evaluate` run in fresh processes, where PyTorch's default fp32
    matmuls would score a run that trained and validated with TF32 (run.tf32) in other, slower arithmetic."""
    from orchestrator.training import scoring

    raw = tiny_raw("tf32", max_steps=2)
    raw["run"].update(tf32=False)
    train_locally(validate_spec(raw), cache_dir=tmp_path / "cache", folder=tmp_path / "run")
    applied = []
    monkeypatch.setattr(scoring, "set_tf32", lambda run, device: applied.append((run.tf32, device)))
    scoring.evaluate_checkpoint(latest_checkpoint(tmp_path / "run"), "test", cache_dir=tmp_path / "cache",
                                out_dir=tmp_path / "out", device=torch.device("cpu"))
    assert applied == [(False, torch.device("cpu"))]


@pytest.mark.parametrize("kind", ["clm", "translation"])
def test_exported_model_loads_without_the_project_state_and_predicts_the_same(tmp_path, kind):
    cfg = ModelConfig.model_validate({"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16,
                                      "attention": {"kind": "mhe", "heads": 2, "mode": "mul"}})
    torch.manual_seed(0)
    model = (LanguageModel(cfg, 50, causal=True) if kind == "clm" else Seq2SeqTransformer(cfg, 50)).eval()
    export_model(model, task_kind=kind, model_cfg=cfg, vocab_size=50, out_dir=tmp_path / "model")
    loaded = load_model(tmp_path / "model")
    tokens = torch.randint(4, 50, (2, 9))
    with torch.no_grad():
        if kind == "clm":
            assert torch.equal(model(tokens), loaded(tokens))
        else:
            assert torch.equal(model(tokens, tokens[:, :7]), loaded(tokens, tokens[:, :7]))
    assert set(model.state_dict()) == set(loaded.state_dict())


def test_export_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.json"):
        load_model(Path(tmp_path))


def test_a_kept_checkpoint_is_chosen_by_name_and_an_unknown_name_lists_the_kept_ones():
    result = _result({2: 10.0, 4: 30.0, 6: 20.0})
    chosen = choose_checkpoint(result, _translation_spec(), "checkpoint_000000002", "test")
    assert chosen.path.endswith("checkpoint_000000002") and chosen.metrics["val/bleu"] == 10.0
    with pytest.raises(ValueError, match="checkpoint_000000004"):
        choose_checkpoint(result, _translation_spec(), "checkpoint_000000003", "test")


def test_evaluate_names_the_missing_run_and_the_storage_path(tmp_path, capsys):
    from orchestrator.cli import main

    assert main(["evaluate", "no-such-run", "--storage-path", str(tmp_path)]) == 2  # a wrong argument, not a failed run
    err = capsys.readouterr().err
    assert "no-such-run" in err and str(tmp_path) in err and "--storage-path" in err


def test_nan_loss_stops_the_run_before_it_is_checkpointed(tmp_path):
    """lr 1e4 makes the loss non-finite within a few steps (lr 300 only grew it to 1e12 on some CPUs): the core
    stops with the step and value, and no checkpoint holds the diverged state (every checkpoint step closes a
    logging window that is checked first)."""
    from orchestrator.training.trainer import NonFiniteLoss

    raw = tiny_raw("nan", lr=1e4, grad_clip=None, max_steps=40, warmup_steps=10)
    raw["run"] = {"checkpoint_every": 1, "eval_every": 1, "log_every": 1}
    folder = tmp_path / "ckpt"
    with pytest.raises(NonFiniteLoss, match=r"loss is (nan|inf) at step \d+") as caught:
        train_locally(validate_spec(raw), cache_dir=tmp_path / "cache", folder=folder)
    stopped = int(str(caught.value).split(" at step ")[1].split()[0])
    kept = sorted(folder.glob("checkpoint_*"))
    assert stopped >= 2 and int(kept[-1].name.split("_")[1]) == stopped - 1  # the last finite step, not later
    for path in kept:
        state = read_checkpoint(path)
        assert all(torch.isfinite(t).all() for t in state.model.values() if t.is_floating_point())
    raw["run"]["stop_on_nan"] = False  # the knob: train on regardless
    trainer, _ = train_locally(validate_spec({**raw, "optim": {**raw["optim"], "max_steps": stopped + 1, "warmup_steps": 1}}),
                               cache_dir=tmp_path / "cache")
    assert trainer.step == stopped + 1


@pytest.mark.slow
def test_a_worker_starts_without_importing_fsdp_and_still_recognises_a_sharded_model(tmp_path):
    """Importing FSDP costs about half a second of every Train worker's start, so the worker's modules import it
    only when run.strategy=fsdp shards the model (orchestrator/training/sharding.py); a sharded model must still
    be seen as one (its gradient sync, checkpoints and evaluation are collectives), and DDP's as a wrapper.

    One fresh interpreter does both: it lists the FSDP modules right after importing what a worker imports (before
    anything shards), then shards a model over a one-rank process group of its own (this process's tests must not
    inherit a default group). A second interpreter would only import torch again."""
    import subprocess
    import sys

    probe = ("import sys, torch, ray.train.torch; import orchestrator.launch.worker; "
             "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.checkpoint') if m in sys.modules)); "
             "import torch.distributed as dist; from orchestrator.training.sharding import is_sharded, shard_model; "
             "from orchestrator.training.optimizer_step import is_wrapped; "
             f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1); "
             "m = torch.nn.Sequential(torch.nn.Linear(2, 2)); plain = is_sharded(m); "
             "shard_model(m, torch.device('cpu'), 'fp32', 1); print(plain, is_sharded(m), is_wrapped(m))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    imported, sharded = done.stdout.strip().splitlines()
    assert imported == "[]", done.stdout
    assert sharded.split() == ["False", "True", "False"], done.stdout + done.stderr

    from orchestrator.training.optimizer_step import is_wrapped
    from orchestrator.training.trainer import unwrap

    inner = torch.nn.Linear(2, 2)
    ddp = object.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(ddp)
    ddp.module = inner
    assert is_wrapped(ddp) and unwrap(ddp) is inner
    assert not is_wrapped(inner) and unwrap(inner) is inner
