"""The YAML search-space syntax: parsing at any depth, clear errors, grid/edge validation points and the
compiled Ray Tune domains. No Ray cluster is started (ray.tune objects are plain Python)."""

from __future__ import annotations

import pytest

from orchestrator.spec.search_space import (
    MAX_VALIDATED_POINTS,
    SearchSpaceError,
    ValidationPlan,
    find_domains,
    grid_points,
    resolve,
    set_path,
    to_param_space,
    validation_points,
)

RAW = {
    "name": "s",
    "model": {
        "d_model": 32,
        "attention": {"kind": "linformer", "k": {"grid": [8, 16]}, "sharing": {"grid": ["none", "kv", "layerwise"]}},
    },
    "optim": {"lr": {"loguniform": [1e-4, 1e-2]}, "seed": {"randint": [0, 5]}, "schedule": {"choice": ["cosine", "linear"]}},
}


def test_domains_are_found_at_any_depth_with_dotted_paths():
    domains = {d.path: d for d in find_domains(RAW)}
    assert set(domains) == {"model.attention.k", "model.attention.sharing", "optim.lr", "optim.seed",
                            "optim.schedule"}
    assert domains["model.attention.k"].kind == "grid" and domains["model.attention.k"].values == (8, 16)
    assert domains["optim.lr"].values == (1e-4, 1e-2)


def test_a_whole_block_can_be_a_grid_value():
    raw = {"model": {"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "mhe", "mode": "mul"}]}}}
    (domain,) = find_domains(raw)
    assert domain.path == "model.attention"
    assert [p["model.attention"]["kind"] for p in grid_points([domain])] == ["mha", "mhe"]


def test_yaml_exponent_strings_are_numbers():
    # PyYAML reads 1e-4 (no dot) as a string.
    (domain,) = find_domains({"optim": {"lr": {"loguniform": ["1e-4", "1e-2"]}}})
    assert domain.values == (1e-4, 1e-2)


@pytest.mark.parametrize(
    "node, message",
    [
        ({"uniform": [1.0, 1.0]}, "lo < hi"),
        ({"loguniform": [0, 1]}, "lo > 0"),
        ({"randint": [0.5, 4]}, "integers"),
        ({"grid": []}, "non-empty list"),
        ({"choice": "abc"}, "non-empty list"),
        ({"uniform": [0, 1, 2]}, "exactly two numbers"),
        ({"loguniform": [float("nan"), 1.0]}, "finite bounds"),
        ({"uniform": [0.0, float("inf")]}, "finite bounds"),
    ],
    ids=["empty-range", "loguniform-zero", "randint-float", "empty-grid", "choice-not-list", "three-bounds",
         "nan-bound", "infinite-bound"],
)
def test_malformed_domains_name_their_path(node, message):
    with pytest.raises(SearchSpaceError, match=message) as err:
        find_domains({"optim": {"lr": node}})
    assert str(err.value).startswith("optim.lr:")


def test_domains_inside_lists_are_refused_with_the_alternative():
    with pytest.raises(SearchSpaceError, match=r"model.attention.k: .*whole list"):
        find_domains({"model": {"attention": {"k": [{"grid": [8, 16]}, 32]}}})


def test_grid_points_are_the_product_of_grid_domains_only():
    points = grid_points(find_domains(RAW))
    assert len(points) == 2 * 3
    assert {(p["model.attention.k"], p["model.attention.sharing"]) for p in points} == {
        (k, s) for k in (8, 16) for s in ("none", "kv", "layerwise")
    }
    assert all(set(p) == {"model.attention.k", "model.attention.sharing"} for p in points)


def test_validation_points_cover_every_grid_combination_and_range_edges():
    domains = find_domains(RAW)
    points = list(validation_points(domains))
    combos = {(p["model.attention.k"], p["model.attention.sharing"]) for p in points}
    assert combos == {(k, s) for k in (8, 16) for s in ("none", "kv", "layerwise")}
    assert {p["optim.lr"] for p in points} >= {1e-4, 1e-2}
    seeds = {p["optim.seed"] for p in points}
    assert {0, 4} <= seeds and max(seeds) < 5  # randint's upper bound is excluded, as in Ray Tune
    assert {p["optim.schedule"] for p in points} == {"cosine", "linear"}


def test_every_grid_combination_is_validated_past_the_old_cap_of_256():
    raw = {"a": {f"x{i}": {"grid": list(range(4))} for i in range(5)}}  # 4**5 = 1024 combinations
    points = list(validation_points(find_domains(raw)))
    assert len(points) == 1024 and len({tuple(p.values()) for p in points}) == 1024


@pytest.mark.parametrize("search", ["grid", "random"])
def test_past_the_exhaustive_limit_grids_stay_whole_and_every_sampled_value_is_tried(search):
    # 1024 grid combinations x 20 choices = 20,480 combinations of test points, past MAX_VALIDATED_POINTS.
    raw = {"a": {f"x{i}": {"grid": list(range(4))} for i in range(5)}, "b": {"choice": list(range(20))}}
    domains = find_domains(raw)
    plan = ValidationPlan(domains, search)
    assert 1024 * 20 > MAX_VALIDATED_POINTS and not plan.exhaustive
    points = list(plan)
    assert len(points) == len(plan) == (1024 if search == "grid" else 20)
    assert {p["b"] for p in points} == set(range(20))
    for domain in domains:
        assert {p[domain.path] for p in points} >= set(domain.values)
    if search == "grid":  # the trials Tune runs, each of them
        assert len({tuple(p[f"a.x{i}"] for i in range(5)) for p in points}) == 1024


def test_resolve_and_set_path_do_not_mutate_the_spec():
    resolved = resolve(RAW, {"model.attention.k": 16, "optim.lr": 3e-4})
    assert resolved["model"]["attention"]["k"] == 16 and resolved["optim"]["lr"] == 3e-4
    assert RAW["model"]["attention"]["k"] == {"grid": [8, 16]}
    assert set_path({}, "run.workers", 2) == {"run": {"workers": 2}}
    with pytest.raises(SearchSpaceError, match="model.d_model is a value"):
        set_path(RAW, "model.d_model.x", 1)


def test_param_space_compiles_to_tune_domains():
    from ray import tune
    from ray.tune.search.sample import Categorical, Float, Integer

    space = to_param_space(find_domains(RAW), "grid")
    assert space["model.attention.k"] == tune.grid_search([8, 16])
    assert isinstance(space["optim.lr"], Float) and (space["optim.lr"].lower, space["optim.lr"].upper) == (1e-4, 1e-2)
    assert isinstance(space["optim.seed"], Integer) and space["optim.seed"].upper == 5
    assert isinstance(space["optim.schedule"], Categorical)
    # Searchers propose one point at a time: grids become choices for random and optuna.
    optuna_space = to_param_space(find_domains(RAW), "optuna")
    assert isinstance(optuna_space["model.attention.k"], Categorical)
    assert optuna_space["model.attention.k"].categories == [8, 16]


@pytest.mark.parametrize("kind", ["grid", "choice"])
def test_a_domain_inside_a_grid_or_choice_value_is_refused_with_one_value_per_combination(kind):
    # Validate and sweep both used to answer "run it with `orchestrator sweep`", the command already running.
    raw = {"model": {"attention": {kind: [{"kind": "mha", "heads": 4},
                                          {"kind": "linformer", "heads": 4, "k": {"grid": [16, 32]}}]}}}
    with pytest.raises(SearchSpaceError) as err:
        find_domains(raw)
    message = str(err.value)
    assert (f"model.attention: a {{{kind}: [...]}} value holds a search domain of its own, at model.attention.k"
            in message)
    assert "{kind: linformer, heads: 4, k: 16} and {kind: linformer, heads: 4, k: 32}" in message
    assert "orchestrator sweep" not in message
