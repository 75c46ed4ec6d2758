"""DeFINE and adaptive input embeddings: the papers' parameter counts, shapes, tying, training, errors."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from models import LanguageModel, ModelConfig
from models.embeddings import AdaptiveInput, DeFINEEmbedding, GroupLinear, split_mix
from tests.training import fit, next_token_loss

V, D = 40, 32
N_IN, WIDTH, DEPTH, G_MAX = 16, 64, 3, 4  # linear spacing 16 -> 64 in 3 steps is exact: no rounding


def define_cfg(**knobs) -> ModelConfig:
    block = {"kind": "define", "input_dim": N_IN, "width": WIDTH, "depth": DEPTH, "g_max": G_MAX, **knobs}
    return ModelConfig(d_model=D, layers=1, ffn=2 * D, max_seq_len=32, attention={"kind": "mha", "heads": 2},
                       embedding=block)


def paper_groups(transform: str) -> list[int]:
    """Fig. 2: LT g = 1, GLT g constant, HGT g_l = max(floor(g_max / 2^(l-1)), 1) for l = 1..N."""
    if transform == "lt":
        return [1] * DEPTH
    if transform == "glt":
        return [G_MAX] * DEPTH
    return [max(G_MAX // 2 ** (layer - 1), 1) for layer in range(1, DEPTH + 1)]


def paper_widths() -> list[int]:
    """HGT "linearly samples the space between n and k" for its N layers."""
    return [N_IN + (WIDTH - N_IN) * layer // DEPTH for layer in range(1, DEPTH + 1)]


@pytest.mark.parametrize("transform", ["lt", "glt", "hgt"])
def test_transform_parameters_follow_the_papers_formula(transform):
    """Fig. 2d: LT sum n_l k_l, GLT sum n_l k_l / g, HGT sum n_l k_l / g_l (plain stacks, no input link)."""
    cfg = define_cfg(transform=transform, skip="none").embedding
    emb = DeFINEEmbedding(cfg, V, D, tie_output=False)
    k = paper_widths()
    n = [N_IN] + k[:-1]
    expected = sum(n_l * k_l // g_l for n_l, k_l, g_l in zip(n, k, paper_groups(transform)))
    counts = emb.parameter_counts()
    assert counts["transform"] == expected
    assert counts["map"] == V * N_IN and counts["reduce"] == WIDTH * D


def test_hgt_sits_between_lt_and_glt_and_the_mixer_adds_the_input_links():
    def transform_params(**knobs) -> int:
        return DeFINEEmbedding(define_cfg(**knobs).embedding, V, D, tie_output=False).parameter_counts()["transform"]

    lt, glt, hgt = (transform_params(transform=t, skip="none") for t in ("lt", "glt", "hgt"))
    assert glt < hgt < lt
    k, g = paper_widths(), paper_groups("hgt")
    n_mixed = [N_IN] + [N_IN + k_prev for k_prev in k[:-1]]  # layers l > 1 also read e_i
    assert transform_params(transform="hgt", skip="mix") == sum(a * b // c for a, b, c in zip(n_mixed, k, g))
    assert transform_params(transform="hgt", skip="concat") == transform_params(transform="hgt", skip="mix")


def test_group_linear_is_a_block_diagonal_matrix():
    layer = GroupLinear(12, 8, groups=4)
    dense = torch.block_diag(*layer.weight.detach())  # [12, 8], one (3 x 2) block per group
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), x @ dense)
    assert sum(p.numel() for p in layer.parameters()) == 12 * 8 // 4


def test_split_mix_gives_group_j_chunk_j_of_both_inputs():
    e, h = torch.arange(4.0)[None], 100 + torch.arange(6.0)[None]
    mixed = split_mix(e, h, groups=2).view(2, -1)
    torch.testing.assert_close(mixed[0], torch.cat([e[0, :2], h[0, :3]]))
    torch.testing.assert_close(mixed[1], torch.cat([e[0, 2:], h[0, 3:]]))


@pytest.mark.parametrize("skip", ["none", "concat", "mix", "residual"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_define_shapes_and_tied_output(skip, tie):
    cfg = define_cfg(skip=skip).embedding
    emb = DeFINEEmbedding(cfg, V, D, tie_output=tie)
    tokens = torch.randint(0, V, (3, 7))
    assert emb(tokens).shape == (3, 7, D)
    weight = emb.output_weight()
    if tie:
        assert weight.shape == (V, D)
    else:
        assert weight is None  # input_dim != d_model and no projection: the model uses its own Linear


def test_define_without_reduce_needs_width_equal_to_d_model():
    with pytest.raises(ValidationError, match="model.embedding.width"):
        define_cfg(reduce=False)
    cfg = define_cfg(reduce=False, width=D).embedding
    emb = DeFINEEmbedding(cfg, V, D, tie_output=True)
    assert emb.parameter_counts()["reduce"] == 0 and emb(torch.randint(0, V, (2, 3))).shape == (2, 3, D)


def test_tiny_model_with_define_learns_a_repeat_task():
    """Sequences repeat their first half; a causal LM can predict the second half from the first."""
    torch.manual_seed(0)
    cfg = define_cfg(transform="hgt", skip="mix").model_copy(update={"dropout": 0.0})
    model = LanguageModel(cfg, V, causal=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    half = torch.randint(0, V, (16, 8))
    tokens = torch.cat([half, half], dim=1)
    losses = fit(lambda _: next_token_loss(model, tokens), opt, steps=30)
    assert losses[-1] < 0.7 * losses[0], losses


def test_adaptive_input_shapes_parameter_count_and_tied_rows():
    cutoffs, factor = [10, 25], 4.0
    cfg = ModelConfig(d_model=D, embedding={"kind": "adaptive", "cutoffs": cutoffs, "factor": factor}).embedding
    emb = AdaptiveInput(cfg, V, D)
    bounds = [0, *cutoffs, V]
    dims = [int(D / factor**i) for i in range(len(bounds) - 1)]
    expected = sum((hi - lo) * d + d * D for lo, hi, d in zip(bounds, bounds[1:], dims))  # tables + projections
    assert sum(p.numel() for p in emb.parameters()) == expected
    tokens = torch.tensor([[0, 9, 10, 24, 25, V - 1]])
    out = emb(tokens)
    assert out.shape == (1, 6, D)
    weight = emb.output_weight()
    assert weight.shape == (V, D)
    torch.testing.assert_close(out[0] / emb.scale, weight[tokens[0]])  # the output layer scores the inputs


def test_adaptive_input_reads_nothing_back_from_the_device():
    """Each band's tokens are kept by a mask, not gathered: a gather reads the band's count back from the device
    (three waits a band at every step on a GPU, a graph break under torch.compile). Fake tensors have no values, so
    such a read raises here; the values are the previous test's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = ModelConfig(d_model=D, embedding={"kind": "adaptive", "cutoffs": [10, 25]}).embedding
    with FakeTensorMode():
        emb = AdaptiveInput(cfg, V, D)
        emb(torch.randint(0, V, (2, 8))).sum().backward()
    assert all(p.grad is not None for p in emb.parameters())


def test_adaptive_input_language_model_runs_with_a_tied_head():
    model = LanguageModel(ModelConfig(d_model=D, layers=1, ffn=2 * D, max_seq_len=16,
                                      attention={"kind": "mha", "heads": 2},
                                      embedding={"kind": "adaptive", "cutoffs": [8, 20]}), V, causal=True)
    assert not hasattr(model.head, "proj")  # tied: no separate V x d_model output matrix
    assert model(torch.randint(0, V, (2, 9))).shape == (2, 9, V)


@pytest.mark.parametrize(
    "embedding, field",
    [({"kind": "define", "input_dim": 18, "g_max": 4}, "model.embedding.input_dim"),
     ({"kind": "define", "width": 66, "g_max": 4}, "model.embedding.width"),
     ({"kind": "define", "depth": 0}, "model.embedding.depth"),
     ({"kind": "adaptive", "cutoffs": [20, 10]}, "model.embedding.cutoffs"),
     ({"kind": "adaptive", "cutoffs": [10], "factor": 0.5}, "model.embedding.factor"),
     ({"kind": "adaptive", "cutoffs": [2, 4, 6, 8], "factor": 4.0}, "model.embedding")],
)
def test_bad_embedding_blocks_fail_naming_the_field(embedding, field):
    with pytest.raises(ValidationError, match=field):
        ModelConfig(d_model=D, embedding=embedding)


def test_adaptive_cutoff_beyond_the_vocabulary_is_refused():
    cfg = ModelConfig(d_model=D, embedding={"kind": "adaptive", "cutoffs": [10, V]}).embedding
    with pytest.raises(ValueError, match="model.embedding.cutoffs"):
        AdaptiveInput(cfg, V, D)


def _define_reference(emb: DeFINEEmbedding, tokens_BT: torch.Tensor) -> torch.Tensor:
    """DeFINE with split-and-mix written out group by group (Sec. 3.3, Fig. 2c): in layers l > 1, group j's
    matrix reads [chunk j of e_i, chunk j of h], not a chunk of the plain concatenation [e_i, h]."""
    e_NI = emb.table(tokens_BT).flatten(0, 1)
    h_NK = e_NI
    for layer_index, (layer, g) in enumerate(zip(emb.expand, emb.cfg.groups())):
        outs = []
        for j in range(g):
            e_j, h_j = e_NI.chunk(g, -1)[j], h_NK.chunk(g, -1)[j]
            x_j = h_j if layer_index == 0 else torch.cat([e_j, h_j], -1)
            outs.append(x_j @ layer.weight[j])
        h_NK = torch.nn.functional.gelu(torch.cat(outs, -1))
    return emb.norm(emb.reduce(h_NK)).view(*tokens_BT.shape, -1)


def test_define_mix_equals_the_group_by_group_reference_and_differs_from_concat():
    torch.manual_seed(0)
    mix = DeFINEEmbedding(define_cfg(skip="mix").embedding, V, D, tie_output=False).double()
    concat = DeFINEEmbedding(define_cfg(skip="concat").embedding, V, D, tie_output=False).double()
    concat.load_state_dict(mix.state_dict())  # same shapes: only the wiring of e_i into the groups differs
    assert mix.cfg.groups()[1] > 1  # layer 2 has several groups, where mix and concat disagree
    tokens = torch.randint(0, V, (3, 7))
    expected = _define_reference(mix, tokens)
    torch.testing.assert_close(mix(tokens), expected)
    assert not torch.allclose(concat(tokens), expected, atol=1e-3)


def test_define_residual_adds_each_later_layer_to_its_input():
    """skip: residual is h_l = h_{l-1} + GELU(F_l(h_{l-1})) for l > 1 (the first layer has no residual: it
    changes the width), written out group by group."""
    torch.manual_seed(0)
    emb = DeFINEEmbedding(define_cfg(skip="residual").embedding, V, D, tie_output=False).double()
    tokens = torch.randint(0, V, (3, 7))
    h_NK = emb.table(tokens).flatten(0, 1)
    for layer_index, (layer, g) in enumerate(zip(emb.expand, emb.cfg.groups())):
        out = torch.nn.functional.gelu(torch.cat([x_j @ layer.weight[j] for j, x_j in enumerate(h_NK.chunk(g, -1))], -1))
        h_NK = h_NK + out if layer_index > 0 else out
    assert len(emb.expand) >= 3  # two residual layers, so "from the second layer on" is pinned
    torch.testing.assert_close(emb(tokens), emb.norm(emb.reduce(h_NK)).view(3, 7, -1))


def test_standard_embedding_scales_the_table_by_sqrt_d_model():
    from models.embeddings import StandardEmbedding

    emb = StandardEmbedding(V, D)
    tokens = torch.randint(0, V, (2, 5))
    torch.testing.assert_close(emb(tokens), emb.table.weight[tokens] * D**0.5)
    assert emb.output_weight() is emb.table.weight


def test_define_with_input_dim_equal_to_d_model_ties_its_table_directly():
    cfg = ModelConfig(d_model=N_IN, layers=1, ffn=32, max_seq_len=32, attention={"kind": "mha", "heads": 2},
                      embedding={"kind": "define", "input_dim": N_IN, "width": WIDTH, "depth": DEPTH,
                                 "g_max": G_MAX}).embedding
    emb = DeFINEEmbedding(cfg, V, N_IN, tie_output=True)
    assert emb.output_projection is None and emb.output_weight() is emb.table.weight
