"""Where a run's files live, local or s3://: `layout` (RunLayout, the one owner of a run's and a sweep's folders:
trial and pretraining folders, checkpoint names made and parsed only here, metadata, spool, cache, report;
reading and writing files at any location) and `object_store` (the one S3 filesystem, the bucket's preflight,
conditional writes). The lowest room: it imports no other."""

from orchestrator import lazy_face

OFFERS = {
    **dict.fromkeys(["RunLayout", "resolve", "parent", "join", "is_remote", "storage_fs", "checkpoint_name",
                     "checkpoint_step", "checkpoint_steps", "checkpoint_order", "fresh_checkpoint_name", "latest_checkpoint", "EVALUATION_DIR", "META_FILE"],
                    "layout"),
    **dict.fromkeys(["StorageError", "is_s3", "check_s3_storage", "use_storage"], "object_store"),
}
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
