"""Ray and the cluster: `ray_env` (connecting to or starting Ray, the runtime environment every Ray process gets,
Train V2, results kept in storage), `resources` (what the connected cluster can run now and what its
autoscaler may add) and `reaper` (the processes of a local Ray session ended with the launcher)."""

from orchestrator import lazy_face

OFFERS = {
    **dict.fromkeys(["start_local_ray", "use_train_v2", "stored_result", "joined_runtime_env", "train_worker_env"],
                    "ray_env"),
    **dict.fromkeys(["ClusterView", "view_cluster", "max_resources"], "resources"),
    **dict.fromkeys(["start_reaper"], "reaper"),
}
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
