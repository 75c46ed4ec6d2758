"""cluster.yaml and docs/cluster-onprem.yaml against Ray's own cluster-config schema (ray-schema.json, through
the launcher's prepare_config + validate_config), plus the project's own conventions for them."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[1]


def load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


@pytest.mark.parametrize("name", ["cluster.yaml", "docs/cluster-onprem.yaml"])
def test_config_passes_rays_schema(name):
    validate_config(prepare_config(copy.deepcopy(load(name))))


def test_schema_check_is_real():
    broken = load("cluster.yaml")
    broken["max_worker"] = broken.pop("max_workers")  # a typo Ray's schema must reject
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(broken))


def test_image_is_the_pinned_ray_gpu_image():
    image = load("cluster.yaml")["docker"]["image"]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert image == f"rayproject/ray:{ray.__version__}-{py}-gpu"


def test_head_serves_mlflow_and_workers_have_gpus():
    config = load("cluster.yaml")
    assert config["provider"]["type"] == "aws"
    head_commands = " ".join(config["head_start_ray_commands"])
    assert "mlflow server" in head_commands and "--artifacts-destination s3://" in head_commands
    assert "--dashboard-host=0.0.0.0" not in head_commands  # the dashboard is reached through `ray dashboard`
    head = config["available_node_types"][config["head_node_type"]]
    assert not head["node_config"]["InstanceType"].startswith(("g", "p"))  # CPU head
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert workers and all(t["node_config"]["InstanceType"].startswith(("g", "p")) for t in workers)
    assert any("pip install" in c and "/home/ray/attention-orchestrator" in c for c in config["setup_commands"])


def test_onprem_example_uses_the_local_provider():
    config = load("docs/cluster-onprem.yaml")
    assert config["provider"]["type"] == "local" and config["provider"]["worker_ips"]
    assert any("ray[default,train,tune]==" + ray.__version__ in c for c in config["setup_commands"])
