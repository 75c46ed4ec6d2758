"""Benchmarks of what the machinery costs: Ray Train and the launcher against the same core without Ray
(`ray_overhead`, with `ray_startup`, `bare_ray_train` and `overhead_baseline` beside it), a launch's CPU seconds
per process (`launch_cpu`), training throughput
against Hugging Face's BERT (`throughput`), corpus preparation and reading at scale (`corpus_scale`), what
`run.compile` buys (`compile_speed`) and what `orchestrator plan`'s counting costs (`plan_cost`).
Each is run as `python -m benchmarks.system.<name>`; importing this package imports none of them.
"""
