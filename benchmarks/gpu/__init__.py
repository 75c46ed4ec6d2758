"""The GPU suite: every GPU measurement of the project in one command, `python -m benchmarks.gpu.suite`.

`suite` runs the parts and writes the summary; each part is its own module (`parity`: the Triton kernels against
their references; `speed`: flash vs SDPA and long attention; `training`: one compiled bf16 training step, tokens/s
and MFU; `sweep`: a 2-trial bf16 / FSDP / compile sweep checked in MLflow), with `common` (the run's context, CSVs
appended case by case, timing), `baselines` (SDPA flash and cuDNN, FlexAttention, FlashAttention 3) and `budget`
(the `--budget` planner). Importing this package imports none of them.
"""
