"""Model and attention knobs that a spec check refuses before Ray (the QA report's a1-a3, b2-b10, b14, b16, c1-c3):
each refusal names the field and the fix, and the boundary value of every new check is still accepted."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from orchestrator.spec import SpecError, search_space, study_from_raw, validate_spec
from orchestrator.spec.models import ExperimentSpec
from tests.test_spec import base_raw

SEQ = 16
"""base_raw's task.seq_len (mlm; model.max_seq_len 32): the longest sequence the task feeds."""


def attention(**block) -> dict:
    return base_raw(model={"attention": {"heads": 2, **block}})


def refused(raw: dict, *fragments: str) -> str:
    with pytest.raises(SpecError) as err:
        validate_spec(raw)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


# --- a1/b8: the attention block's dropout ------------------------------------------------------------------------

@pytest.mark.parametrize("kind, knobs", [("mha", {}), ("mhe", {}), ("linformer", {"k": 8}),
                                         ("lsh", {"bucket_size": 4})])
@pytest.mark.parametrize("dropout", [1.5, 1.0, -0.1])
def test_attention_dropout_outside_0_1_is_refused_in_every_block(kind, knobs, dropout):
    refused(attention(kind=kind, dropout=dropout, **knobs),
            f"model.attention.dropout must be in [0, 1) (got {dropout})", "0 disables it")


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_attention_dropout_in_0_1_is_accepted(dropout):
    assert validate_spec(attention(kind="mha", dropout=dropout)).model.attention.dropout == dropout


def test_hyper_refuses_attention_dropout_at_validate_not_at_model_build():
    refused(attention(kind="mha", dropout=0.1, mechanism={"kind": "hyper", "block_size": 4, "min_seq_len": 8}),
            "model.attention.dropout=0.1 is not supported by the hyper mechanism", "set model.attention.dropout to 0")


# --- a2/b9: adaptive-input cutoffs against task.vocab_size -------------------------------------------------------

def test_adaptive_cutoffs_reaching_the_vocabulary_are_refused_and_just_below_accepted():
    refused(base_raw(model={"embedding": {"kind": "adaptive", "cutoffs": [50, 120]}}),
            "model.embedding.cutoffs=[50, 120] must stay below the vocabulary size 120", "lower the last cutoff")
    spec = validate_spec(base_raw(model={"embedding": {"kind": "adaptive", "cutoffs": [50, 119]}}))
    assert spec.model.embedding.cutoffs == [50, 119]


# --- a3/b16: reversible translation ------------------------------------------------------------------------------

TRANSLATION = {"kind": "translation", "max_source_len": 32, "max_tokens": 256}


def test_reversible_translation_is_refused_at_validate_and_reversible_mlm_accepted():
    raw = base_raw(model={"reversible": True})
    assert validate_spec(raw).model.reversible
    raw["task"] = TRANSLATION
    refused(raw, "model.reversible=true is not supported for a translation decoder",
            "Set model.reversible=false for translation")


# --- b2: Linformer's k against the task's longest sequence -------------------------------------------------------

def test_linformer_k_above_the_task_seq_len_is_refused_and_equal_accepted():
    refused(attention(kind="linformer", k=SEQ + 1), f"model.attention.k={SEQ + 1} is larger than the longest "
            f"sequence the task feeds, task.seq_len={SEQ}", f"choose k <= {SEQ}")
    assert validate_spec(attention(kind="linformer", k=SEQ)).model.attention.k == SEQ
    raw = attention(kind="linformer", k=[8, SEQ + 4])
    raw["model"]["layers"] = 2
    refused(raw, f"model.attention.k={SEQ + 4} is larger")


def test_linformer_max_seq_len_below_the_task_seq_len_is_refused_at_validate_not_at_the_first_step():
    # It passed validate and stopped the run at its first forward ("sequence length 16 exceeds
    # model.attention.max_seq_len=8"), inside Ray; in a mechanism: block too.
    refused(attention(kind="linformer", k=4, max_seq_len=SEQ - 8),
            f"model.attention.max_seq_len={SEQ - 8} is shorter than the longest sequence the task feeds, "
            f"task.seq_len={SEQ}", f"raise model.attention.max_seq_len to at least {SEQ}")
    refused(attention(kind="gqa", groups=1, mechanism={"kind": "linformer", "k": 4, "max_seq_len": SEQ - 1}),
            f"model.attention.mechanism.max_seq_len={SEQ - 1} is shorter")
    assert validate_spec(attention(kind="linformer", k=4, max_seq_len=SEQ)).model.attention.max_seq_len == SEQ


@pytest.mark.parametrize("block, expected", [
    ({"kind": "mha", "k": 8}, "k is a field of kind linformer, not of mha: set kind: linformer, or keep mha's "
                              "projections and cross them with it: mechanism: {kind: linformer, k: ...}"),
    ({"kind": "mha", "mode": "mul"}, "mode is a field of kind mhe, not of mha: set kind: mhe"),
    ({"kind": "gqa", "bucket_size": 8}, "bucket_size is a field of kind lsh, not of gqa: set kind: lsh;"),
    ({"kind": "linformer", "k": 8, "groups": 2}, "groups is a field of kind gqa, not of linformer"),
], ids=["linformer-k-on-mha", "mhe-mode-on-mha", "lsh-knob-not-crossable", "gqa-groups-on-linformer"])
def test_another_kinds_knob_names_that_kind_instead_of_a_close_name_of_this_one(block, expected):
    # The field list alone did not say whose knob it is, and `{kind: mha, mode: mul}` suggested d_model.
    message = refused(attention(**block), expected)
    assert "did you mean" not in message, message


@pytest.mark.parametrize("block, expected", [
    ({"kind": "mha", "shareing": "kv"}, "did you mean sharing? sharing is a field of kind linformer, not of mha"),
    ({"kind": "mha", "bucketsize": 8}, "did you mean bucket_size? bucket_size is a field of kind lsh, not of mha"),
])
def test_a_misspelt_knob_of_another_kind_names_the_knob_and_its_kind(block, expected):
    refused(attention(**block), expected)


def test_a_misspelt_knob_of_this_kind_is_not_sent_to_another_kind():
    message = refused(attention(kind="mha", hedas=2), "did you mean heads?")
    assert "field of kind" not in message, message


def test_another_kinds_knob_on_an_embedding_names_that_kind():
    refused(base_raw(model={"embedding": {"kind": "standard", "cutoffs": [10]}}),
            "cutoffs is a field of kind adaptive, not of standard: set kind: adaptive")


def test_classify_lengths_come_from_task_max_len():
    raw = attention(kind="linformer", k=24)
    raw["task"] = {"kind": "classify", "max_len": 20}
    refused(raw, "model.attention.k=24 is larger than the longest sequence the task feeds, task.max_len=20")
    raw["model"]["attention"]["k"] = 20
    assert validate_spec(raw).model.attention.k == 20


# --- b3/b4: LSH bucket_size and n_buckets ------------------------------------------------------------------------

def test_lsh_bucket_size_above_the_length_is_refused_and_equal_accepted():
    refused(attention(kind="lsh", bucket_size=SEQ + 1), f"model.attention.bucket_size={SEQ + 1} is larger than the "
            f"longest sequence the task feeds, task.seq_len={SEQ}", f"choose bucket_size <= {SEQ}")
    assert validate_spec(attention(kind="lsh", bucket_size=SEQ)).model.attention.bucket_size == SEQ


@pytest.mark.parametrize("n_buckets, buckets", [(SEQ + 2, SEQ + 2), ([4, 6], 24)])
def test_lsh_more_buckets_than_tokens_is_refused(n_buckets, buckets):
    refused(attention(kind="lsh", bucket_size=4, n_buckets=n_buckets),
            f"model.attention.n_buckets={n_buckets} makes {buckets} buckets per hash round for at most {SEQ} tokens",
            f"use at most {SEQ} buckets, or leave model.attention.n_buckets unset")


@pytest.mark.parametrize("n_buckets", [SEQ, [4, 4], None])
def test_lsh_as_many_buckets_as_tokens_or_the_default_is_accepted(n_buckets):
    spec = validate_spec(attention(kind="lsh", bucket_size=4, n_buckets=n_buckets))
    assert spec.model.attention.n_buckets == n_buckets


# --- b5/b6: HyperAttention's min_seq_len and block_size ----------------------------------------------------------

def test_hyper_min_seq_len_above_the_length_is_refused_saying_it_never_runs():
    refused(attention(kind="hyper", block_size=4, min_seq_len=SEQ + 1),
            f"model.attention.min_seq_len={SEQ + 1} is larger than the longest sequence the task feeds, "
            f"task.seq_len={SEQ}", "HyperAttention would never run", f"lower min_seq_len to at most {SEQ}",
            "use attention kind mha")
    assert validate_spec(attention(kind="hyper", block_size=4, min_seq_len=SEQ)).model.attention.min_seq_len == SEQ


def test_hyper_block_size_above_the_length_is_refused_and_equal_accepted():
    refused(attention(kind="hyper", block_size=SEQ + 1, min_seq_len=8),
            f"model.attention.block_size={SEQ + 1} is larger than the longest sequence", f"block_size <= {SEQ}")
    assert validate_spec(attention(kind="hyper", block_size=SEQ, min_seq_len=8)).model.attention.block_size == SEQ


def test_a_hyper_mechanism_block_is_named_by_its_own_path():
    refused(attention(kind="mha", mechanism={"kind": "hyper", "block_size": 4, "min_seq_len": 64}),
            "model.attention.mechanism.min_seq_len=64 is larger")


@pytest.mark.parametrize("mechanism, message", [
    ({"kind": "linformer", "k": 0}, "model.attention.mechanism.k must be >= 1 (got 0)"),
    ({"kind": "linformer", "k": 6, "max_seq_len": 16, "projection": "conv", "sharing": "kv"},
     "model.attention.mechanism.projection=conv needs max_seq_len divisible by k"),
    ({"kind": "hyper", "block_size": 0}, "model.attention.mechanism.block_size must be >= 1 (got 0)"),
    ({"kind": "linformer", "k": 8, "max_seq_len": 64}, "model.attention.mechanism.max_seq_len=64 exceeds "
                                                       "model.max_seq_len=32"),
])
def test_a_mechanism_blocks_own_checks_name_its_path(mechanism, message):
    """A mechanism's validators and its check against the model name its fields where the spec sets them
    (`mechanism: {k: 0}` is model.attention.mechanism.k; model.attention.k is not a field of an mha block)."""
    error = refused(attention(kind="mha", mechanism=mechanism), message)
    assert "model.attention.k " not in error and "model.attention.max_seq_len" not in error, error


def test_a_patch_blocks_own_checks_name_the_patch(tmp_path):
    refused(pretrained_raw(tmp_path, {"layers": 2, "attention": {"kind": "lsh", "bucket_size": 0}}),
            "task.patch.attention: task.patch.attention.bucket_size must be >= 1 (got 0)")


def pretrained_raw(tmp_path, patch: dict) -> dict:
    files = {}
    for split in ("train", "validation"):
        (tmp_path / f"{split}.txt").write_text("some words\n")
        files[split] = str(tmp_path / f"{split}.txt")
    task = {"kind": "pretrained_lm", "pretrained": "gpt2", "seq_len": 64, "files": files, "patch": patch}
    return {"name": "patched", "task": task, "optim": {"max_steps": 0}}


def test_the_pretrained_lm_patch_is_checked_against_task_seq_len(tmp_path):
    hyper = {"kind": "hyper", "block_size": 16, "min_seq_len": 128}
    refused(pretrained_raw(tmp_path, {"layers": 2, "attention": hyper}),
            "task.patch.attention.min_seq_len=128 is larger than the longest sequence the task feeds, task.seq_len=64")
    validate_spec(pretrained_raw(tmp_path, {"layers": 0, "attention": hyper}))  # nothing patched: nothing runs
    validate_spec(pretrained_raw(tmp_path, {"layers": 2, "attention": {**hyper, "min_seq_len": 64}}))


# --- b7, b14, b10 ------------------------------------------------------------------------------------------------

def test_a_negative_mhe_init_std_is_refused_and_zero_accepted():
    refused(attention(kind="mhe", init_std=-0.5), "model.attention.init_std must be >= 0 (got -0.5)",
            "the default is 0.02")
    assert validate_spec(attention(kind="mhe", init_std=0.0)).model.attention.init_std == 0.0


def test_define_input_dim_above_width_is_refused_citing_the_paper_and_equal_accepted():
    define = {"kind": "define", "input_dim": 64, "width": 32, "depth": 2}
    refused(base_raw(model={"embedding": define}), "model.embedding.input_dim=64 is larger than "
            "model.embedding.width=32", "Mehta et al., 2020", "raise width to at least input_dim")
    assert validate_spec(base_raw(model={"embedding": {**define, "width": 64}})).model.embedding.width == 64


def test_decoder_layers_are_refused_where_no_decoder_would_read_them():
    refused(base_raw(model={"decoder_layers": 2}), "model.decoder_layers=2 is the decoder depth of a translation "
            "model; task.kind: mlm", "remove model.decoder_layers")
    raw = base_raw(model={"decoder_layers": 2})
    raw["task"] = TRANSLATION
    assert validate_spec(raw).model.decoder_layers == 2


# --- c1-c3: search-domain mistakes -------------------------------------------------------------------------------

def test_a_list_of_attention_blocks_says_a_list_is_not_a_block_and_how_to_sweep():
    message = refused(base_raw(model={"attention": [{"kind": "mha"}, {"kind": "linformer", "k": 8}]}),
                      "model.attention is a list of 2, but a list is not an attention block", "{grid: [")
    assert "kind='heads'" not in message
    study = study_from_raw(base_raw(model={"attention": {"grid": [{"kind": "mha"}, {"kind": "linformer", "k": 8}]}}))
    assert len(study.domains) == 1


def test_a_misspelt_domain_kind_is_named_with_the_close_kind():
    for check in (validate_spec, study_from_raw):
        with pytest.raises(SpecError, match=r"model.layers: 'gird' is not a search domain kind; did you mean grid\?"):
            check(base_raw(model={"layers": {"gird": [1, 2]}}))
    assert len(study_from_raw(base_raw(model={"layers": {"grid": [1, 2]}})).domains) == 1


@pytest.mark.parametrize("typo, kind", [("gird", "grid"), ("choise", "choice"), ("unifrom", "uniform"),
                                         ("log_uniform", "loguniform"), ("randit", "randint")])
def test_typos_of_every_domain_kind_are_caught(typo, kind):
    with pytest.raises(SpecError, match=rf"'{typo}' is not a search domain kind; did you mean {kind}( or \w+)?\?"):
        study_from_raw(base_raw(model={"layers": {typo: [1, 2]}}))


def test_no_field_of_the_spec_reads_as_a_misspelt_domain_kind():
    """A one-key mapping of a list under a field name (`{train: [...]}`) is not a domain typo: no field name of any
    block is as close to a domain kind as a typo is (at difflib's default 0.6, train, compile and init_from were)."""
    fields: set[str] = set()
    blocks = [ExperimentSpec]
    while blocks:
        block = blocks.pop()
        for name, field in block.model_fields.items():
            fields.add(name)
            stack = [field.annotation]
            while stack:
                annotation = stack.pop()
                stack.extend(typing.get_args(annotation))
                if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in blocks:
                    blocks.append(annotation)
    assert len(fields) > 100
    misread = []
    for name in sorted(fields):
        try:
            search_space.find_domains({"x": {name: [1, 2]}})
        except search_space.SearchSpaceError:
            misread.append(name)
    assert misread == []


def test_uniform_on_an_integer_field_points_to_randint_or_a_grid():
    with pytest.raises(SpecError, match=r"model.layers: .*valid integer.*"
                                        r"\{randint: \[lo, hi\]\}.*\{grid: \[\.\.\.\]\}"):
        study_from_raw(base_raw(model={"layers": {"uniform": [1, 3]}}))
    assert study_from_raw(base_raw(model={"layers": {"randint": [1, 3]}})).domains[0].kind == "randint"


def test_every_grid_point_of_a_sweep_is_length_checked():
    with pytest.raises(SpecError, match=rf"trial \{{model.attention.k={SEQ * 2}\}} is invalid:\n.*k={SEQ * 2} is "):
        study_from_raw(base_raw(model={"attention": {"kind": "linformer", "heads": 2, "k": {"grid": [8, SEQ * 2]}}}))
