"""Where a run's files live, local or s3://: `layout` (RunLayout, the one owner of a run's and a sweep's folders:
trial and pretraining folders, checkpoint names made and parsed only here, metadata, spool, cache, report),
`locations` (any location: joining, whole-file reads and atomic writes, folders listed, copied and removed) and
`object_store` (the one S3 filesystem, the bucket's preflight, conditional writes). The lowest room: it imports
no other."""

from orchestrator import lazy_face

OFFERS = {
    **dict.fromkeys(["RunLayout", "checkpoint_name", "checkpoint_step", "checkpoint_steps", "checkpoint_order",
                     "fresh_checkpoint_name", "latest_checkpoint", "EVALUATION_DIR", "META_FILE"], "layout"),
    **dict.fromkeys(["resolve", "parent", "join", "is_remote", "storage_fs"], "locations"),
    **dict.fromkeys(["StorageError", "is_s3", "check_s3_storage", "use_storage"], "object_store"),
}
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
