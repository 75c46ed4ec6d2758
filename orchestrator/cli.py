"""`orchestrator validate | plan | prepare | train | sweep | resume | status | evaluate | report | ui`.

Every command that takes a SPEC also takes dotted overrides after it (`model.attention.k=64`); new knobs
belong in the spec models, not in new flags (STYLE.md section 3). Specs are validated completely, every
trial of a sweep included, before Ray is imported, so a typo costs seconds, not a cluster start.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import re
import select
import signal
import sys
from collections.abc import Sequence
from typing import Any

from orchestrator.console import set_verbose
from orchestrator.launch import LaunchError, check_before_ray, check_data_files
from orchestrator.spec import (
    DEFAULT_GPU,
    SpecError,
    Study,
    TrackingSettings,
    check_gpus,
    expected_trials,
    format_plan,
    load_spec,
    load_study,
    local_gpu_count,
    name_problem,
    plan_study,
    refusals,
    spec_to_yaml,
)
from orchestrator.spec.counting import PLANNED_TASKS
from orchestrator.spec.gpus import gpu_argument, mfu_argument
from orchestrator.spec.search_space import MAX_TRIALS, ValidationPlan, grid_lines
from orchestrator.storage import parent, resolve
from orchestrator.tracking.ui import missing_store, port_argument, serve_ui, server_advice, ui_command

DEFAULT_STORAGE = "runs"
DEFAULT_UI_PORT = 5000
GRID_LINES_SHOWN = 50
"""Grid points `validate` lists one per line; a larger grid (up to MAX_TRIALS) is counted, not listed."""


def _run_name(value: str) -> str:
    """NAME of resume, status and evaluate: a folder under the storage path, held to the rule of a spec's name
    before it is joined to any path."""
    if (problem := name_problem(value)) is not None:
        raise argparse.ArgumentTypeError(f"{value[:80]!r} is not a run name ({problem})")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_spec(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("spec", help="YAML spec, e.g. configs/smoke.yaml")
        cmd.add_argument("overrides", nargs="*", metavar="key.path=value", help="dotted overrides of spec fields")
        cmd.add_argument("--scale", help="apply the spec's named `scales:` overrides first (e.g. tiny); "
                                         "the study is renamed <name>-<scale>")
        return cmd

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text)  # `NAME -h` says what it does too

    def with_verbose(cmd: argparse.ArgumentParser) -> argparse.ArgumentParser:
        cmd.add_argument("--verbose", action="store_true",
                         help="Ray's own output as Ray makes it (trial tables, Ray Train's logs) and a line per "
                              "logging step; default: one line per report and a sweep progress line")
        return cmd

    def with_gpu(cmd: argparse.ArgumentParser) -> argparse.ArgumentParser:
        cmd.add_argument("--gpu", default=None, type=gpu_argument, help="GPU kind each trial is planned for "
                         "(H100, H200, A100-80GB, A100-40GB, L4, A10G; default H100)")
        return cmd

    with_gpu(with_spec("validate", "check a spec (every trial of a sweep) and print the resolved spec and trial grid"))
    plan = with_gpu(with_spec("plan", "parameters, FLOPs per token, memory per GPU, step time and GPU-hours of "
                                      "every trial, counted on fake tensors (no GPU, no Ray)"))
    plan.add_argument("--mfu", type=mfu_argument, default=0.4, help="model FLOP utilisation assumed for step times")
    with_spec("prepare", "tokenise the spec's data once (every split) into the memory-mapped shards its runs map")
    with_verbose(with_spec("train", "train one run of a spec without search domains"))
    with_gpu(with_verbose(with_spec("sweep", "run a Ray Tune sweep over the spec's search domains")))
    resume = with_verbose(command("resume", "continue a run or sweep from its latest checkpoints"))
    resume.add_argument("name", type=_run_name, help="the spec's name (its folder under the storage path)")
    resume.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="what may change on resume: train longer (optim.max_steps=, runs only), retries, "
                             "placement, cadence, tracking (see orchestrator.spec.RESUME_OVERRIDES)")
    resume.add_argument("--storage-path", default=DEFAULT_STORAGE, help="the spec's run.storage_path (default: runs)")
    resume.add_argument("--storage-endpoint", default=None, metavar="URL",
                        help="the spec's run.storage_endpoint, for s3:// storage outside AWS (else AWS_ENDPOINT_URL_S3)")
    status = command("status", "where a run or sweep stands: trials, best so far, last checkpoint, MLflow link "
                               "(while it runs and after)")
    status.add_argument("name", type=_run_name, help="the run's or sweep's name (its folder under the storage path)")
    status.add_argument("--storage-path", default=DEFAULT_STORAGE, help="the spec's run.storage_path (default: runs)")
    status.add_argument("--storage-endpoint", default=None, metavar="URL",
                        help="the spec's run.storage_endpoint, for s3:// storage outside AWS (else AWS_ENDPOINT_URL_S3)")
    evaluate = sub.add_parser("evaluate", help="score a finished run (every trial of a sweep) on a split again",
                              description="score a finished run (every trial of a sweep) on all of a split, log "
                                          "<split>/* metrics to its MLflow run, outputs to <run>/evaluation/ (any "
                                          "checkpoint but best: checkpoints/<split>/*, evaluation/<checkpoint>/)")
    evaluate.add_argument("name", type=_run_name, help="the run's or sweep's name (its folder under the storage path)")
    evaluate.add_argument("--split", choices=("test", "validation"), default="test")
    evaluate.add_argument("--checkpoint", default="best",
                          help="best (by the spec's tune.metric), latest, all (every kept checkpoint, in step "
                               "order), or a kept checkpoint's folder name such as checkpoint_000002750")
    evaluate.add_argument("--storage-path", default=DEFAULT_STORAGE, help="the spec's run.storage_path (default: runs)")
    evaluate.add_argument("--storage-endpoint", default=None, metavar="URL",
                        help="the spec's run.storage_endpoint, for s3:// storage outside AWS (else AWS_ENDPOINT_URL_S3)")
    sub.add_parser("report", help="PRR / PEoP tables and plots from MLflow (see `orchestrator report -h`)",
                   add_help=False)
    ui = command("ui", "start the MLflow UI on the spec's tracking store (without a spec: ./mlflow.db, if it exists)")
    ui.add_argument("spec", nargs="?", help="spec whose tracking.uri to browse (default: sqlite:///mlflow.db)")
    ui.add_argument("overrides", nargs="*", metavar="key.path=value")
    ui.add_argument("--scale", help="the spec's named scale, as for sweep")
    ui.add_argument("--port", type=port_argument, default=DEFAULT_UI_PORT,
                    help=f"port of 127.0.0.1 the UI listens on (default {DEFAULT_UI_PORT}); a taken one is refused")
    return parser


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    """argparse, with dotted overrides accepted anywhere after the command (`validate SPEC --scale tiny k=v`):
    argparse ends a positional list at the first option, so the overrides after one come back unrecognised."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    late = [item for item in rest if "=" in item and not item.startswith("-")]
    unknown = [item for item in rest if item not in late]
    if unknown or (late and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or late)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def _check_local_gpus(study: Study) -> None:
    """Without a cluster to ask yet (RAY_ADDRESS), the GPUs of this machine are what a run can get."""
    if not os.environ.get("RAY_ADDRESS"):
        check_gpus(study.base, local_gpu_count(), "this machine (no RAY_ADDRESS set)")


def _describe_grid(study: Study) -> str:
    spec = study.base
    if not study.domains:
        return "no search domains: a single run (orchestrator train)"
    lines = []
    sampled = [d for d in study.domains if not d.is_grid]
    total = expected_trials(study)
    lines.append(f"search: {spec.tune.search}, scheduler: {spec.tune.scheduler}, metric: {spec.metric} ({spec.mode}), "
                 f"trials: {total:,} (at most {MAX_TRIALS:,})")
    lines.append("  " + ValidationPlan(study.domains, spec.tune.search).describe())
    if spec.tune.search == "grid":
        lines += grid_lines(study.domains, spec.tune.num_samples, GRID_LINES_SHOWN)
    else:
        lines.append("  grid domains are drawn like choice: " + ", ".join(d.path for d in study.domains if d.is_grid))
    for d in sampled:
        lines.append(f"  sampled per trial: {d.path} ~ {d.kind}{list(d.values)}")
    return "\n".join(lines)


def _plan(study: Study, gpu: str | None, mfu: float) -> int:
    """`orchestrator plan`: the table, and exit 2 naming the fixes when some trial does not fit."""
    if study.base.task.kind not in PLANNED_TASKS:
        print(f"orchestrator: plan counts the project's own models; task.kind={study.base.task.kind} loads a "
              "pretrained one on the worker, whose costs the run measures (val/forward_s, val/peak_gb)", file=sys.stderr)
        return 2
    plans = list(plan_study(study, gpu or DEFAULT_GPU, mfu, progress=_to_stderr))
    print(format_plan(study, plans, mfu))
    if problems := refusals(plans):
        print("orchestrator: some trials do not fit:\n" + "\n".join(problems), file=sys.stderr)
        return 2
    return 0


def _check_fit(study: Study, gpu: str | None) -> None:
    """A trial that cannot fit its GPU fails here, not on the cluster after its queue wait (only for specs that
    ask for GPUs: a CPU run has no fixed memory to plan against)."""
    if study.base.run.gpus_per_worker <= 0 or study.base.task.kind not in PLANNED_TASKS:
        return  # not pretrained_lm either: its size is known once a worker loads it
    if gpu is None:
        _to_stderr(f"note: memory per trial checked against {DEFAULT_GPU} (the default; --gpu names another)")
    if problems := refusals(list(plan_study(study, gpu or DEFAULT_GPU, progress=_to_stderr))):
        raise SpecError("some trials do not fit their GPU:\n" + "\n".join(problems))


_to_stderr = functools.partial(print, file=sys.stderr, flush=True)  # progress beside a table on stdout


def _progress_line(line: str) -> None:
    print(line, flush=True)  # flushed: a piped launcher's log shows that validation is moving


def _where_to_look(args: argparse.Namespace, tracking_uri: str, experiment: str, parent_run_id: str | None) -> str:
    """Overrides and scale ride along in the `ui` command: they may name its store, experiment and metric."""
    parent = f" --parent-run {parent_run_id}" if parent_run_id else ""
    ui = ui_command(args.spec, args.overrides, args.scale)
    return (f"MLflow: {tracking_uri} (experiment {experiment!r}); browse with `{ui}`\n"
            f"report: orchestrator report --tracking-uri {tracking_uri} --experiment {experiment}{parent}")


WAITING_EXIT = 3
"""Exit code of a run that trained to its end while the tracking server did not take all of it: its outputs wait
in storage and its MLflow run stays open until `orchestrator resume` sends them."""


def _print_run(outcome: Any, args: argparse.Namespace, tracking_uri: str, experiment: str) -> int:
    shown = {k: v for k, v in outcome.metrics.items() if "/" in k or k == "step"}
    values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    if outcome.waiting:
        print(f"run {outcome.name} trained to its end ({values}), but is not finished in MLflow: {outcome.waiting}; "
              f"send them with `orchestrator resume {outcome.name}` once the server answers", file=sys.stderr)
    else:
        print(f"run {outcome.name} finished: {values}")
    print(f"checkpoint: {outcome.checkpoint}")
    print(f"MLflow run id: {outcome.mlflow_run_id}")
    print(_where_to_look(args, tracking_uri, experiment, None))
    return WAITING_EXIT if outcome.waiting else 0


def _sweep_line(outcome: Any) -> str:
    """`sweep NAME: 3 trials: 1 finished, 1 errored, 1 unfinished`: every trial counted, none guessed."""
    counts = {state: sum(t["state"] == state for t in outcome.trials) for state in ("done", "error", "unfinished")}
    line = (f"sweep {outcome.name}: {len(outcome.trials)} trials: {counts['done']} finished, "
            f"{counts['error']} errored, {counts['unfinished']} unfinished")
    diverged = [t for t in outcome.trials
                if t["state"] == "error" and re.search(r"loss is -?(nan|inf)\b", t["error"] or "")]
    # Resume advice only where a resume can succeed: not for trials that diverged (they would again).
    if outcome.interrupted or outcome.errors > len(diverged):
        storage = parent(outcome.path)
        what = "interrupted before every trial ended" if outcome.interrupted else "some trials errored"
        line += (f"\n{what}; continue the unfinished and errored trials from their checkpoints with "
                 f"`orchestrator resume {outcome.name} --storage-path {storage}`" if outcome.resumable else
                 f"\n{what}; no trial wrote a checkpoint, so the name is free: fix the cause and start it again")
    if diverged:
        line += (f"\n{len(diverged)} errored trial(s) diverged (NaN or inf loss), and a resume diverges again from "
                 "the same checkpoint: change the spec (lower optim.lr, tighten optim.grad_clip, or set "
                 "run.stop_on_nan=false) and start a sweep under another name")
    return line


def _print_trials(outcome: Any, metric: str) -> None:
    for trial in outcome.trials:
        value = trial["metrics"].get(metric)
        shown = f"{metric}={value:.4g}" if isinstance(value, float) else f"{metric}=-"
        config = ", ".join(f"{k}={v}" for k, v in trial["config"].items())
        status = (f"error: {trial['error']}" if trial["error"] else
                  f"{trial['state']}, {trial['metrics'].get('evaluations', 0)} evals")
        print(f"  {trial['trial_id']}: {shown} ({status}) {config}")


def _print_sweep(outcome: Any, args: argparse.Namespace, tracking_uri: str, experiment: str, metric: str) -> None:
    print(f"{_sweep_line(outcome)}\n({outcome.path})")
    _print_trials(outcome, metric)
    if outcome.best:
        value = outcome.best['metrics'].get(metric)
        shown = f"{value:.4g}" if isinstance(value, float) else value  # the digits a comparison can use
        print(f"best: {metric}={shown} with {outcome.best['config']}")
    print(_where_to_look(args, tracking_uri, experiment, outcome.parent_run_id))


def _ui(args: argparse.Namespace) -> int:
    """`orchestrator ui`: a tracking server serves its own UI; a local store gets MLflow's (tracking/ui.py)."""
    spec = load_study(args.spec, args.overrides, args.scale).base if args.spec else None
    uri = spec.tracking.uri if spec else TrackingSettings().uri
    if uri.startswith(("http://", "https://")):
        print(server_advice(uri))
        return 0
    if missing := missing_store(uri, args.spec):  # browsing makes no store (MLflow's server would)
        print(f"orchestrator ui: {missing}", file=sys.stderr)
        return 2
    return serve_ui(uri, args.port, *((spec.tracking.experiment, spec.metric, spec.mode) if spec else ()))


def _set_verbosity(verbose: bool) -> None:
    """Before Ray starts: the launcher's --verbose for Ray (orchestrator/launch/ray_console.py), the workers, and
    MLflow's own Python logs (its database set-up lines)."""
    import logging

    set_verbose(verbose)
    if not verbose:
        # MLflow configured its logger when it was imported (above); the variable reaches Ray's processes.
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        logging.getLogger("mlflow").setLevel(logging.WARNING)


def _unexpected(err: Exception) -> int:
    """An error nobody turned into a message (often Ray's, from storage or restore): one line on the console,
    the whole traceback in a file for a bug report."""
    import tempfile
    import traceback

    if isinstance(err, BrokenPipeError) and _stdout_reader_gone():
        return _quiet_exit()  # stdout's reader left, as `| head` does: not an error
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        where = f" writing {err.filename}" if err.filename else ""
        print(f"orchestrator: no space left on the device{where}: free some space there (or point "
              "run.storage_path / --storage-path elsewhere) and run the command again; nothing was lost that "
              "a checkpoint holds", file=sys.stderr)
        return 1
    try:
        with tempfile.NamedTemporaryFile("w", prefix="orchestrator-error-", suffix=".txt", delete=False) as f:
            traceback.print_exception(err, file=f)
        kept = f"traceback in {f.name}"
    except OSError as why:
        kept = f"its traceback could not be kept: {why.strerror}"
    print(f"orchestrator: {type(err).__name__}: {first[:300]} ({kept})", file=sys.stderr)
    return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout's reader left (`| head -1`): POLLERR. Another pipe's BrokenPipeError is still unexpected."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or a stdout without a descriptor (a test's capture)
        return False


def _quiet_exit() -> int:
    """Nothing printed and SIGPIPE's status, as Unix tools; stdout to /dev/null, or Python's flush at exit of what
    its buffer holds would report the broken pipe again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `orchestrator` console script and of `python -m orchestrator`."""
    try:
        code = _command(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at exit: a reader gone by now gets the quiet exit below, not Python's message
        return code
    except BrokenPipeError:
        if _stdout_reader_gone():
            return _quiet_exit()
        raise


def _command(argv: list[str]) -> int:
    if argv[:1] == ["report"]:
        from orchestrator.report import report_cli

        return report_cli(argv[1:])
    args = _parse(argv)
    _set_verbosity(getattr(args, "verbose", False))
    if getattr(args, "storage_endpoint", None):
        from orchestrator.storage import use_storage

        use_storage(args.storage_endpoint, None)  # read the run's own files (its stored spec names it again)
    try:
        if args.command == "ui":
            return _ui(args)
        if args.command == "resume":
            # Deferred here and below: Ray is imported only by the commands that run something.
            from orchestrator.launch import SweepOutcome, resume

            outcome = resume(args.name, args.storage_path, args.overrides)
            print(f"resumed {args.name}")
            if isinstance(outcome, SweepOutcome):
                print(_sweep_line(outcome))
                _print_trials(outcome, outcome.metric)
                return 1 if outcome.errors or outcome.interrupted else 0
            print(f"run {outcome.name}: {outcome.metrics.get('step')} steps, MLflow run {outcome.mlflow_run_id}")
            if outcome.waiting:
                print(f"orchestrator: not finished in MLflow: {outcome.waiting}; resume again once the server "
                      "answers", file=sys.stderr)
                return WAITING_EXIT
            return 0
        if args.command == "status":
            from orchestrator.launch import status_cli

            return status_cli(args.name, args.storage_path)
        if args.command == "evaluate":
            from orchestrator.launch import evaluate_stored

            storage = resolve(args.storage_path)
            try:
                scored = evaluate_stored(args.name, storage, split=args.split, which=args.checkpoint)
            except ValueError as err:  # an unknown --checkpoint, a split the run's data does not have
                print(f"orchestrator evaluate: {err}", file=sys.stderr)
                return 2
            for item in scored:
                print(f"{item['label']}: outputs in {item['outputs']}")
            return 0 if scored else 1
        if args.command == "train":
            spec = load_spec(args.spec, args.overrides, args.scale)
            study = Study(raw={}, domains=[], base=spec)
        else:
            try:
                study = load_study(args.spec, args.overrides, args.scale, progress=_progress_line)
            except KeyboardInterrupt:  # validation takes seconds for a large grid; nothing has started yet
                print("orchestrator: interrupted (Ctrl-C) while validating the spec; nothing was started",
                      file=sys.stderr)
                return 130
        spec = study.base
        if args.command == "plan":
            return _plan(study, args.gpu, args.mfu)
        check_data_files(spec)
        if args.command == "prepare":
            from orchestrator.launch import describe_argv, prepare_spec

            return prepare_spec(study, describe_argv(args.spec, args.overrides, args.scale))
        if args.command in ("validate", "sweep"):
            _check_fit(study, args.gpu)
        if args.command == "validate":
            check_before_ray(study)  # storage, labelled data, tracking, init_from: as train's and sweep's preflight
            try:
                _check_local_gpus(study)
            except SpecError as err:  # a cluster spec validated on a laptop: worth a note, not a failure
                print(f"note: {err}\n(validate asks no cluster; train and sweep check its GPUs once connected)",
                      file=sys.stderr)
            print(spec_to_yaml(spec) if not study.domains else "# first trial of the sweep\n" + spec_to_yaml(spec))
            print(_describe_grid(study))
            return 0
        _check_local_gpus(study)
        # Ray is imported only from here on.
        from orchestrator.launch import run_sweep, run_training

        if args.command == "train":
            outcome = run_training(spec)
            return _print_run(outcome, args, spec.tracking.uri, spec.tracking.experiment)
        outcome = run_sweep(study)
        _print_sweep(outcome, args, spec.tracking.uri, spec.tracking.experiment, spec.metric)
        return 1 if outcome.errors or outcome.interrupted else 0
    except SpecError as err:
        print(f"orchestrator: invalid spec: {err}", file=sys.stderr)
        return 2
    except LaunchError as err:  # says what failed and what to do, in a line or two
        print(f"orchestrator: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("orchestrator: interrupted (Ctrl-C); the MLflow run is marked KILLED", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - Ray's own errors (storage, restore): one line, traceback in a file
        return _unexpected(err)


if __name__ == "__main__":
    sys.exit(main())
