"""`orchestrator plan` on the studies under configs/studies (issue 48), and docs/studies.md's cost column against it.

The fast tier plans one trial of a representative subset, at the study's small scale (`tiny`, or `cpu` for the
long-range ones): one study per task kind plan builds (FAST_STUDIES). Every study, even one trial each at the small
scale, took 114 s with another run beside it on the 2-core machine, more than a fast test may take: each distinct
model is a forward and backward on fake tensors, whose cost is the number of ops, not their size
(benchmarks/system/plan_cost.py prints the times). tests/test_plan.py covers causal LMs and every attention kind.
The full plan of each study docs/studies.md prices, against the GPU-hours it quotes, is the real-process tier's
(RUN_SLOW=1).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.spec import gpu_kind, load_study
from orchestrator.spec.counting import PLANNED_TASKS
from orchestrator.spec.loading import expected_trials, read_yaml
from orchestrator.spec.plan import plan_spec, plan_study, study_gpu_hours
from orchestrator.spec.search_space import validation_points

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted((ROOT / "configs" / "studies").glob("*.yaml"))
SMALL_SCALES = ("tiny", "cpu")
FAST_STUDIES = ("linformer", "long_range", "long_range_bytes", "long_range_listops", "downstream_sst2",
                "mhe_translation")
"""mlm, mqar, bytelm, listops, classify and translation: every task kind but clm (tests/test_plan.py's)."""


def _load(path: Path, small: bool):
    scales = read_yaml(path).get("scales", {})  # a study's own or its base's (mhe_clm.yaml: mhe.yaml's)
    scale = next((name for name in SMALL_SCALES if name in scales), None) if small else None
    study = load_study(path, scale=scale)
    if study.base.task.kind not in PLANNED_TASKS:
        pytest.skip(f"task.kind={study.base.task.kind} is not one plan builds (PLANNED_TASKS)")
    return study


@pytest.mark.parametrize("name", FAST_STUDIES)
def test_plan_counts_a_trial_of_a_study_of_each_task_kind(name):
    study = _load(ROOT / "configs" / "studies" / f"{name}.yaml", small=True)
    points = list(validation_points(study.domains, search=study.base.tune.search)) if study.domains else [{}]
    spec = study.spec_for(points[0]) if study.domains else study.base
    plan = plan_spec(spec, gpu_kind("H100"), values=points[0])
    assert plan.step.flops > 0 and plan.memory_bytes > 0 and plan.gpu_hours > 0
    assert expected_trials(study) >= 1


def _documented_gpu_hours() -> dict[str, float]:
    """docs/studies.md's cost column: `| `<spec>.yaml` | ... | <hours> GPU-hours on H100 ... |` per study."""
    text = (ROOT / "docs" / "studies.md").read_text()
    rows = re.findall(r"^\| `([\w]+)\.yaml` \|.*?\| ([\d.]+(?:e-?\d+)?) GPU-hours", text, flags=re.MULTILINE)
    return {name: float(hours) for name, hours in rows}


# hyper.yaml's plan (11 trials at n = 16384) takes about 100 s of CPU, the most of any study (the others 30-60 s):
# left out of the real-process tier to keep CI's time; `python -m benchmarks.system.plan_cost --part studies` checks it.
PLANNED_BY_HAND = {"hyper"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(_documented_gpu_hours()) - PLANNED_BY_HAND))
def test_docs_quote_the_plan_of_every_study_in_their_table(name):
    """Each study docs/studies.md's table prices (the paper studies; configs/studies also holds the patching
    studies of docs/patching.md, whose pretrained models plan does not build) costs what plan computes."""
    study = _load(ROOT / "configs" / "studies" / f"{name}.yaml", small=False)
    hours = study_gpu_hours(study, list(plan_study(study, "H100")))
    assert float(f"{hours:.3g}") == _documented_gpu_hours()[name], (name, hours)
