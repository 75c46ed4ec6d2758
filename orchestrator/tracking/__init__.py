"""MLflow, and only here: `describe` (tags, params, the RunHandle of a run), `write` (run creation, tags, metrics,
artifacts, sending what waits in the spool), `spool` (what the server has not taken yet, kept through
outages and processes), `read` (experiments, runs by key, trial or parent, histories), `loggers`
(the metrics fan-out of a training run) and `ui` (`orchestrator ui`: MLflow's own UI server, started and stopped). No other module builds an MLflow client or creates a run.

Ray's MLflowLoggerCallback is deliberately not used: it keeps its trial -> run map in memory and opens a second
run after Tuner.restore. Here the run id is stored in every checkpoint instead.
"""
