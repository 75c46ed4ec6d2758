"""cluster.yaml and docs/cluster-onprem.yaml against Ray's own cluster-config schema (ray-schema.json, through
the launcher's prepare_config + validate_config), plus the project's own conventions for them."""

from __future__ import annotations

import copy
import fnmatch
import re
import subprocess
import sys
import tomllib
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


def test_nodes_boot_the_current_deep_learning_ami_not_rays_default():
    """Ray's `latest_dlami` (or no ImageId) is DLAMI v71 in Ray's own table: Ubuntu 18.04 with a CUDA 11.2 driver,
    on which the CUDA 12 GPU image and torch's wheels see no GPU. Every node type boots AWS's current Deep Learning
    Base AMI, looked up by EC2 at launch from AWS's public SSM parameter."""
    from ray.autoscaler._private.aws import config as aws_config

    assert "Ubuntu 18.04" in aws_config.DEFAULT_AMI_NAME  # what latest_dlami still means in this Ray
    for name, node_type in load("cluster.yaml")["available_node_types"].items():
        image = node_type["node_config"].get("ImageId", "")
        assert image.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"), (name, image)
        assert "nvidia-driver-gpu-ubuntu-22.04/latest/ami-id" in image, (name, image)


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


def _pin(text: str, package: str) -> str:
    found = re.findall(rf"{package}==([0-9][\w.+]*)", text)
    assert found, f"no {package}== pin in {text[:200]!r}"
    return found[0]


def test_nodes_install_the_torch_that_ci_tests():
    """Every node pins torch to .ci/run's version; unpinned, each boot would fetch whatever CUDA build is newest."""
    ci_pin = _pin((REPO / ".ci" / "run").read_text(), "torch")
    for name in ("cluster.yaml", "docs/cluster-onprem.yaml"):
        setup = " ".join(load(name)["setup_commands"])
        assert _pin(setup, "torch") == ci_pin, name


def test_mlflow_folder_exists_before_docker_mounts_it():
    config = load("cluster.yaml")
    mounts = [opt.split()[1].split(":")[0] for opt in config["docker"]["head_run_options"] if opt.startswith("-v ")]
    made = " ".join(config.get("initialization_commands", []))
    assert mounts and all(f"mkdir -p {source}" in made for source in mounts)


def test_token_auth_on_every_node():
    config = load("cluster.yaml")
    assert "-e RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    onprem = load("docs/cluster-onprem.yaml")
    starts = onprem["head_start_ray_commands"] + onprem["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts if "ray start" in c)


def test_cluster_extra_brings_what_ray_up_needs():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cluster"]
    names = {re.split(r"[\[<>=]", requirement)[0] for requirement in extras}
    assert {"boto3", "ray"} <= names and any("default" in r for r in extras if r.startswith("ray["))
    assert any("[cluster]" in c for c in load("cluster.yaml")["setup_commands"])


def test_onprem_mlflow_server_allows_the_host_name_its_runs_use():
    """MLflow 3 refuses (403) a Host outside --allowed-hosts: the name in the example's tracking.uri must be listed."""
    text = (REPO / "docs" / "cluster-onprem.yaml").read_text()
    host = re.search(r"tracking\.uri=http://([\w.-]+:\d+)", text).group(1)
    server = " ".join(load("docs/cluster-onprem.yaml")["head_start_ray_commands"])
    allowed = re.search(r"--allowed-hosts (\S+)", server).group(1).split(",")
    assert host in allowed and "localhost:5000" in allowed


def test_launcher_counts_the_gpus_the_autoscaler_may_add_before_any_gpu_node_is_up():
    """GPU workers start at 0; their written-out resources let the launcher admit GPU runs at once."""
    from orchestrator.cluster.resources import max_resources

    most = max_resources(load("cluster.yaml"), head={"CPU": 8.0})
    assert most is not None and most["GPU"] == 8 * 4
    assert load("cluster.yaml")["available_node_types"]["ray.worker.gpu"]["min_workers"] == 0


def test_every_node_starts_ray_with_the_startup_concurrency_the_test_clusters_use():
    """A Train run starts about seven actor processes at once; both cluster configs raise the raylet's limit on
    concurrent worker starts (cluster.yaml says why) on every node, to the value the real-process tests' clusters
    use, so the job-log test sees what a user's cluster prints."""
    from tests.cluster_helpers import STARTUP_CONCURRENCY

    (name, value), = STARTUP_CONCURRENCY.items()
    for path in ("cluster.yaml", "docs/cluster-onprem.yaml"):
        config = load(path)
        starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
        assert len(starts) == 2 and all(f"{name}={value} " in c for c in starts), (path, starts)


CONFIGS = ("cluster.yaml", "docs/cluster-onprem.yaml")
LEFT_OUT = {".git/", ".env", "mlruns/", "mlartifacts/", "mlflow.db", "reports/", "runs/"}
"""What never goes to the nodes: the history, local tracking stores and their artifacts, reports, run folders,
and the secrets a checkout may keep in .env."""


@pytest.mark.parametrize("name", CONFIGS)
def test_nodes_get_the_source_and_the_secrets_they_need_only(name):
    """rsync_exclude leaves out LEFT_OUT (and rsync_filter what .gitignore does), yet matches none of the files
    that are mounted on purpose (Ray applies the excludes to every file mount, the token's and the login's too)."""
    config = load(name)
    excluded = set(config["rsync_exclude"])
    assert LEFT_OUT <= excluded, LEFT_OUT - excluded
    assert config["rsync_filter"] == [".gitignore"] and (REPO / ".gitignore").is_file()
    for source in config["file_mounts"].values():
        base = Path(source).name or source
        assert not any(fnmatch.fnmatch(base, pattern.rstrip("/")) for pattern in excluded), (source, excluded)
    assert {"~/.ray/auth_token", "~/.ray/mlflow_credentials"} <= set(config["file_mounts"].values())


def test_gpu_workers_have_an_instance_profile_for_s3():
    """Ray's AWS provider gives its default instance profile to the head only (ray autoscaler/_private/aws/
    config.py, `_configure_iam_role`): the GPU workers, which write checkpoints to S3, name theirs."""
    config = load("cluster.yaml")
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert workers
    for node_type in workers:
        profile = node_type["node_config"]["IamInstanceProfile"]
        assert re.fullmatch(r"arn:aws:iam::[^:]+:instance-profile/\S+", profile["Arn"]), profile
    assert "IamInstanceProfile" in (REPO / "docs" / "orchestrator.md").read_text()  # the user is told to set it


@pytest.mark.parametrize("name", CONFIGS)
def test_mlflow_asks_for_a_login_that_every_node_has(name):
    """The head's server runs MLflow's basic-auth app with its admin password from the mounted login file (MLflow
    ships none), and every `ray start` reads that file into its environment, where every Ray process of the node,
    Train workers included, finds MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. The auth app needs
    the `mlflow[auth]` extra, which every node installs with the project."""
    config = load(name)
    read = "set -a && . ~/.ray/mlflow_credentials && set +a || exit 1;"
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith(read) for c in starts), starts
    (server,) = [c for c in config["head_start_ray_commands"] if "mlflow server" in c]
    assert server.startswith(read) and "--app-name basic-auth" in server
    assert 'MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD"' in server
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("mlflow[auth]") for d in dependencies), dependencies


@pytest.mark.parametrize("name", CONFIGS)
def test_every_node_command_is_shell_that_parses(name):
    """Ray runs each command through bash on the node: a quoting slip would only show at `ray up`."""
    config = load(name)
    commands = [c for key in ("initialization_commands", "setup_commands", "head_start_ray_commands",
                              "worker_start_ray_commands") for c in config.get(key, [])]
    for command in commands:
        checked = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert checked.returncode == 0, (command, checked.stderr)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_documented_sweep_command_passes_the_multi_node_checks(name):
    """The `orchestrator sweep` in a config's header, on the cluster it describes (the head and its workers, or
    an autoscaler), is not refused for storage or tracking the other nodes cannot reach (run.shared_storage for
    an NFS folder; the head's address, not loopback)."""
    from orchestrator.launch.preflight import check_multi_node
    from orchestrator.spec import load_study

    header = "\n".join(line.lstrip("#") for line in (REPO / name).read_text().splitlines() if line.startswith("#"))
    command = re.search(r"orchestrator sweep (\S+)((?:\s+\\?\s*[\w.]+=\S+)*)", header)
    overrides = [item for item in command.group(2).split() if item != "\\"]
    assert any(item.startswith("run.storage_path=") for item in overrides), overrides
    study = load_study(REPO / command.group(1), overrides)
    config = load(name)
    workers = len(config["provider"].get("worker_ips", []))
    check_multi_node(study.base, nodes=1 + workers, autoscaling=not workers)
