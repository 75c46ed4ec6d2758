"""The training core, Ray-free and MLflow-free: `trainer` (THE loop: evaluation, report cadence, best tracking,
prefetching, checkpoint state), `optimizer_step` (one step: micro-batches, accumulation, autocast, clipping,
AdamW and its schedule, token-weighted loss), `sharding` (run.strategy=fsdp: FSDP2 per layer, sharded
checkpoints through torch.distributed.checkpoint, read back as data), `checkpoint` (what a checkpoint holds;
atomic write, read),
`scoring` (a checkpoint scored on all of a split) and `export` (a model as plain files; `load_model`). The Ray
worker (launch/worker.py) and the in-process runner (launch/local_run.py) both drive this `Trainer`."""

from orchestrator import lazy_face

OFFERS = {
    **dict.fromkeys(["Trainer", "Cadence", "Best", "NonFiniteLoss"], "trainer"),
    **dict.fromkeys(["train_step", "Optimization", "LossFn", "LossMeter", "lr_lambda"], "optimizer_step"),
    **dict.fromkeys(["TrainingState", "read_checkpoint", "write_checkpoint"], "checkpoint"),
    **dict.fromkeys(["Evaluation", "evaluate_checkpoint"], "scoring"),
    **dict.fromkeys(["export_model", "load_model"], "export"),
    **dict.fromkeys(["shard_model", "is_sharded"], "sharding"),
}
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
