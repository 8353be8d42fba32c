"""InklingConfig: the three config.json dialects, release aliases, round trips, DraftView."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.models import tiny_config
from inkfw.errors import ConfigError
from inkfw.models.inkling.config import InklingConfig, MtpConfig
from inkfw.speculative.draft_view import DraftView

# text fields shared by the dialect tests, in Hugging Face's names
TEXT = dict(
    vocab_size=128,
    unpadded_vocab_size=120,
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    rel_extent=32,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=4,
    swa_head_dim=8,
    sliding_window_size=16,
    d_rel=4,
    log_scaling_n_floor=64,
    log_scaling_alpha=0.25,
    intermediate_size=96,
    moe_intermediate_size=24,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    route_scale=3.0,
    conv_kernel_size=3,
    rms_norm_eps=1e-5,
    logits_mup_width_multiplier=4.0,
    max_position_embeddings=4096,
    bos_token_id=5,
    eos_token_id=[6, 7],
    pad_token_id=0,
)
MTP = dict(num_nextn_predict_layers=3, chain_hidden_post_norm=True, local_layer_ids=[0, 2])


def check_text_fields(c: InklingConfig) -> None:
    assert (c.vocab_size, c.unpadded_vocab_size, c.hidden_size, c.num_layers) == (128, 120, 64, 6)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rel_extent) == (8, 2, 16, 32)
    assert (c.swa_num_heads, c.swa_num_kv_heads, c.swa_head_dim, c.sliding_window) == (4, 4, 8, 16)
    assert (c.d_rel, c.log_scaling_n_floor, c.log_scaling_alpha) == (4, 64, 0.25)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.route_scale) == (8, 3, 1, 3.0)
    assert (c.conv_kernel_size, c.rms_norm_eps, c.logits_mup_width_multiplier) == (3, 1e-5, 4.0)
    assert c.max_position_embeddings == 4096
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (5, [6, 7], 0)
    assert c.eos_token_ids == [6, 7]
    assert c.logits_vocab_size == 120


def check_mtp(c: InklingConfig) -> None:
    assert c.mtp == MtpConfig(num_nextn_predict_layers=3, chain_hidden_post_norm=True, local_layer_ids=[0, 2])


# --------------------------------------------------------------------- dialects
def test_mm_model_dialect():
    raw = {
        "model_type": "inkling_mm_model",
        "architectures": ["InklingForConditionalGeneration"],
        "text_config": dict(TEXT, model_type="inkling_text", local_layer_ids=[0, 1, 3], dense_mlp_idx=2),
        "vision_config": {"hidden_size": 999},  # ignored
        "hidden_size": 12345,  # top-level text fields are ignored for the mm layout
        "mtp_config": dict(MTP),
    }
    c = InklingConfig.from_dict(raw)
    check_text_fields(c)
    check_mtp(c)
    assert c.local_layer_ids == [0, 1, 3]
    assert c.dense_mlp_idx == 2
    assert (c.intermediate_size, c.moe_intermediate_size) == (96, 24)
    assert [c.is_local(i) for i in range(6)] == [True, True, False, True, False, False]
    assert [c.is_moe(i) for i in range(6)] == [False, False, True, True, True, True]


def test_mm_model_without_text_config_is_an_error():
    with pytest.raises(ConfigError, match="text_config"):
        InklingConfig.from_dict({"model_type": "inkling_mm_model", "mtp_config": MTP})


def test_flat_model_dialect():
    raw = dict(TEXT, model_type="inkling_model", local_layer_ids=[5, 1], dense_mlp_idx=1, mtp_config=dict(MTP))
    c = InklingConfig.from_dict(raw)
    check_text_fields(c)
    check_mtp(c)
    assert c.local_layer_ids == [1, 5]  # sorted
    assert c.dense_mlp_idx == 1


def test_flat_model_without_mtp_config_ships_no_depths():
    c = InklingConfig.from_dict(dict(TEXT, model_type="inkling_model"))
    assert c.mtp == MtpConfig()
    assert c.mtp.num_nextn_predict_layers == 0


def test_hf_text_dialect():
    raw = dict(
        TEXT,
        model_type="inkling_text",
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid"],
        mlp_layer_types=["dense", "dense", "dense", "sparse", "sparse", "sparse"],
        num_mtp_layers=3,
        chain_hidden_post_norm=True,
        mtp_local_layer_ids=[0, 2],
        local_layer_ids=None,  # HF saves it as null next to layer_types
    )
    c = InklingConfig.from_dict(raw)
    check_text_fields(c)
    check_mtp(c)
    assert c.local_layer_ids == [0, 2, 3]
    assert c.dense_mlp_idx == 3


def test_hf_text_dialect_without_mtp_fields():
    raw = dict(TEXT, model_type="inkling_text", num_mtp_layers=None, mtp_local_layer_ids=None)
    c = InklingConfig.from_dict(raw)
    assert c.mtp == MtpConfig()


def test_hf_mlp_layer_types_must_be_a_dense_prefix():
    raw = dict(
        TEXT, model_type="inkling_text", mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "sparse"]
    )
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        InklingConfig.from_dict(raw)


def test_hf_all_sparse_and_all_dense():
    all_sparse = InklingConfig.from_dict(dict(TEXT, model_type="inkling_text", mlp_layer_types=["sparse"] * 6))
    assert all_sparse.dense_mlp_idx == 0
    all_dense = InklingConfig.from_dict(dict(TEXT, model_type="inkling_text", mlp_layer_types=["dense"] * 6))
    assert all_dense.dense_mlp_idx == 6
    assert not any(all_dense.is_moe(i) for i in range(6))


def test_mtp_config_wins_over_inline_fields():
    raw = dict(TEXT, model_type="inkling_model", num_mtp_layers=7, mtp_local_layer_ids=[4], mtp_config=dict(MTP))
    check_mtp(InklingConfig.from_dict(raw))


def test_mm_model_with_mtp_fields_only_in_text_config():
    # what Hugging Face writes back for an mm config it loaded: the MTP fields copied into text_config
    raw = {
        "model_type": "inkling_mm_model",
        "text_config": dict(TEXT, num_mtp_layers=3, chain_hidden_post_norm=True, mtp_local_layer_ids=[0, 2]),
    }
    check_mtp(InklingConfig.from_dict(raw))


# ----------------------------------------------------------------- release aliases
def test_release_aliases():
    text = {
        k: v
        for k, v in TEXT.items()
        if k not in ("conv_kernel_size", "max_position_embeddings", "intermediate_size", "moe_intermediate_size")
    }
    text.update(
        sconv_kernel_size=5, model_max_length=2048, dense_mlp_idx=2, dense_intermediate_size=80, intermediate_size=20
    )
    c = InklingConfig.from_dict({"model_type": "inkling_mm_model", "text_config": text, "mtp_config": MTP})
    assert c.conv_kernel_size == 5
    assert c.max_position_embeddings == 2048
    assert c.dense_mlp_idx == 2
    assert c.intermediate_size == 80  # the dense MLP (and MTP block) width
    assert c.moe_intermediate_size == 20  # `intermediate_size` is the experts' width in release configs


def test_intermediate_sizes_without_release_alias():
    c = InklingConfig.from_dict(dict(TEXT, model_type="inkling_model"))
    assert (c.intermediate_size, c.moe_intermediate_size) == (96, 24)


def test_hf_attribute_names_and_inkfw_names_are_both_read():
    text = {
        k: v
        for k, v in TEXT.items()
        if k
        not in (
            "num_attention_heads",
            "num_key_value_heads",
            "swa_num_attention_heads",
            "swa_num_key_value_heads",
            "sliding_window_size",
            "n_routed_experts",
        )
    }
    text.update(
        num_heads=8, num_kv_heads=2, swa_num_heads=4, swa_num_kv_heads=4, sliding_window=16, num_local_experts=8
    )
    check_text_fields(InklingConfig.from_dict(dict(text, model_type="inkling_model")))


def test_default_local_layers():
    assert InklingConfig().local_layer_ids == [i for i in range(66) if i % 6 != 5]
    c = tiny_config(num_layers=13, local_layer_ids=None)
    assert c.local_layer_ids == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12]
    # a config.json naming neither local_layer_ids nor layer_types
    raw = dict(TEXT, model_type="inkling_model", num_hidden_layers=12)
    assert InklingConfig.from_dict(raw).local_layer_ids == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]


def test_release_defaults():
    c = InklingConfig()
    assert (c.num_layers, c.hidden_size, c.vocab_size, c.logits_vocab_size) == (66, 6144, 201024, 200058)
    assert c.local_layer_ids.count(5) == 0 and len(c.local_layer_ids) == 55


@pytest.mark.parametrize("model_type", ["llama", None, "inkling"])
def test_unknown_model_type(model_type):
    raw = dict(TEXT, mtp_config=MTP)
    if model_type is not None:
        raw["model_type"] = model_type
    with pytest.raises(ConfigError, match="unknown model_type") as exc:
        InklingConfig.from_dict(raw, source="some/config.json")
    assert repr(model_type) in str(exc.value)
    assert "some/config.json" in str(exc.value)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_heads"),
        (dict(swa_num_attention_heads=6, swa_num_key_value_heads=4), "swa_num_heads"),
        (dict(local_layer_ids=[0, 6]), "local_layer_ids"),
        (dict(dense_mlp_idx=7), "dense_mlp_idx"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(vocab_size="many"), "invalid value"),
    ],
)
def test_invalid_values(bad, match):
    with pytest.raises(ConfigError, match=match):
        InklingConfig.from_dict(dict(TEXT, model_type="inkling_model", **bad))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param([1, 2], id="not-an-object"),
        pytest.param(dict(TEXT, model_type="inkling_model", num_hidden_layers="six"), id="num_hidden_layers-str"),
        pytest.param(dict(TEXT, model_type="inkling_model", num_hidden_layers=None), id="num_hidden_layers-null"),
        pytest.param(dict(TEXT, model_type="inkling_text", layer_types=5), id="layer_types-int"),
        pytest.param(dict(TEXT, model_type="inkling_text", mlp_layer_types=5), id="mlp_layer_types-int"),
        pytest.param(dict(TEXT, model_type="inkling_model", mtp_config=[3]), id="mtp_config-list"),
        pytest.param(
            dict(TEXT, model_type="inkling_model", mtp_config={"num_nextn_predict_layers": "x"}), id="mtp-depths-str"
        ),
        pytest.param(dict(TEXT, model_type="inkling_model", mtp_config={"local_layer_ids": 3}), id="mtp-local-int"),
        pytest.param(
            dict(TEXT, model_type="inkling_text", layer_types=["hybrid", "hybrid_sliding"]), id="layer_types-length"
        ),
        pytest.param(
            dict(TEXT, model_type="inkling_text", mlp_layer_types=["dense", "sparse"]), id="mlp_layer_types-length"
        ),
    ],
)
def test_malformed_config_is_a_config_error(raw):
    """A malformed config.json is a ConfigError (one sentence for the user), never a raw
    TypeError/ValueError/AttributeError, and never silently read as some other model."""
    with pytest.raises(ConfigError):
        InklingConfig.from_dict(raw, source="x/config.json")


def test_negative_mtp_depths_is_an_error():
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        InklingConfig.from_dict(
            dict(TEXT, model_type="inkling_model", mtp_config=dict(MTP, num_nextn_predict_layers=-1))
        )


def test_from_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(TEXT, model_type="inkling_model", mtp_config=MTP)))
    c = InklingConfig.from_json(p)
    check_text_fields(c)
    check_mtp(c)
    with pytest.raises(ConfigError, match="not found"):
        InklingConfig.from_json(tmp_path / "nope.json")
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        InklingConfig.from_json(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        InklingConfig.from_json(p)


# --------------------------------------------------------------------- round trips
def test_release_dict_layout():
    c = tiny_config()
    out = c.to_release_dict(extra={"vision_config": {"a": 1}, "model_type": "x", "text_config": {}, "mtp_config": {}})
    assert out["model_type"] == "inkling_mm_model"
    assert out["vision_config"] == {"a": 1}
    assert out["text_config"]["model_type"] == "inkling_text"
    assert out["text_config"]["num_hidden_layers"] == 4
    assert out["mtp_config"] == {
        "num_nextn_predict_layers": 3,
        "chain_hidden_post_norm": True,
        "local_layer_ids": [0, 2],
    }
    assert out["architectures"] == ["InklingForConditionalGeneration"]


def test_release_dict_round_trip_tiny():
    c = tiny_config()
    assert InklingConfig.from_dict(c.to_release_dict()) == c
    assert InklingConfig.from_dict(json.loads(json.dumps(c.to_release_dict()))) == c


def test_release_dict_round_trip_release_defaults():
    c = InklingConfig()
    assert InklingConfig.from_dict(json.loads(json.dumps(c.to_release_dict()))) == c


def test_text_dict_round_trip():
    c = tiny_config()
    raw = dict(c.to_text_dict(), mtp_config=dataclasses.asdict(c.mtp))
    assert InklingConfig.from_dict(raw) == c


def test_use_embed_norm_round_trips():
    c = tiny_config(use_embed_norm=False)
    assert InklingConfig.from_dict(c.to_release_dict()).use_embed_norm is False


def test_with_mtp_depths_copies():
    c = tiny_config()
    d = c.with_mtp_depths(5)
    assert d.mtp.num_nextn_predict_layers == 5 and c.mtp.num_nextn_predict_layers == 3
    assert d.mtp.local_layer_ids == c.mtp.local_layer_ids
    assert dataclasses.replace(d, mtp=c.mtp) == c


@st.composite
def configs(draw) -> InklingConfig:
    num_layers = draw(st.integers(1, 8))
    kv = draw(st.integers(1, 3))
    swa_kv = draw(st.integers(1, 3))
    experts = draw(st.integers(1, 6))
    depths = draw(st.integers(0, 4))
    small = st.integers(1, 64)
    maybe_int = st.one_of(st.none(), st.integers(0, 1000))
    floats = st.floats(min_value=1e-6, max_value=100.0, allow_nan=False, allow_infinity=False)
    return InklingConfig(
        vocab_size=draw(st.integers(1, 500)),
        unpadded_vocab_size=draw(st.one_of(st.none(), st.integers(1, 500))),
        hidden_size=draw(small),
        num_layers=num_layers,
        num_heads=kv * draw(st.integers(1, 3)),
        num_kv_heads=kv,
        head_dim=draw(small),
        rel_extent=draw(small),
        swa_num_heads=swa_kv * draw(st.integers(1, 3)),
        swa_num_kv_heads=swa_kv,
        swa_head_dim=draw(small),
        sliding_window=draw(small),
        local_layer_ids=draw(st.one_of(st.none(), st.lists(st.integers(0, num_layers - 1), unique=True))),
        d_rel=draw(small),
        log_scaling_n_floor=draw(st.one_of(st.none(), st.integers(1, 4096))),
        log_scaling_alpha=draw(floats),
        dense_mlp_idx=draw(st.integers(0, num_layers)),
        intermediate_size=draw(small),
        moe_intermediate_size=draw(small),
        n_routed_experts=experts,
        num_experts_per_tok=draw(st.integers(1, experts)),
        n_shared_experts=draw(st.integers(1, 3)),
        route_scale=draw(floats),
        conv_kernel_size=draw(st.integers(1, 6)),
        rms_norm_eps=draw(floats),
        logits_mup_width_multiplier=draw(floats),
        use_embed_norm=draw(st.booleans()),
        max_position_embeddings=draw(st.integers(1, 1 << 20)),
        bos_token_id=draw(maybe_int),
        eos_token_id=draw(st.one_of(maybe_int, st.lists(st.integers(0, 1000), min_size=1, max_size=3))),
        pad_token_id=draw(maybe_int),
        mtp=MtpConfig(
            num_nextn_predict_layers=depths,
            chain_hidden_post_norm=draw(st.booleans()),
            local_layer_ids=sorted(draw(st.sets(st.integers(0, max(depths - 1, 0)), max_size=depths))),
        ),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_round_trip_property(c):
    assert InklingConfig.from_dict(c.to_release_dict()) == c
    assert InklingConfig.from_dict(json.loads(json.dumps(c.to_release_dict()))) == c


# ---------------------------------------------------------------------- DraftView
def test_draft_view_defaults():
    v = DraftView.from_config(tiny_config())
    assert (v.n_predict, v.depths, v.num_draft_tokens, v.prefill_steps) == (3, 3, 3, 3)
    assert v.chain_hidden_post_norm is True
    assert v.local_layer_ids == (0, 2)


@pytest.mark.parametrize(
    "shipped, requested, k, depths, prefill",
    [
        (3, 1, None, 1, 1),
        (3, 2, 5, 2, 2),  # k > D: P = D
        (3, 3, 1, 3, 1),  # k < D: P = k
        (3, 8, 4, 3, 3),  # requested beyond shipped: clipped to the checkpoint
        (1, None, 6, 1, 1),
        (8, None, 2, 8, 2),
    ],
)
def test_draft_view_depths_and_prefill(shipped, requested, k, depths, prefill):
    cfg = tiny_config().with_mtp_depths(shipped)
    v = DraftView.from_config(cfg, requested_depths=requested, num_draft_tokens=k)
    assert v.n_predict == shipped
    assert v.depths == depths
    assert v.num_draft_tokens == (depths if k is None else k)
    assert v.prefill_steps == prefill == min(v.depths, v.num_draft_tokens)


@pytest.mark.parametrize("requested", [None, 1, 4])
def test_draft_view_checkpoint_without_depths(requested):
    with pytest.raises(ConfigError, match="ships no MTP depths"):
        DraftView.from_config(tiny_config().with_mtp_depths(0), requested_depths=requested)


@pytest.mark.parametrize("requested", [0, -2])
def test_draft_view_requested_zero_depths(requested):
    with pytest.raises(ConfigError, match="mtp.depths must be >= 1"):
        DraftView.from_config(tiny_config(), requested_depths=requested)


@pytest.mark.parametrize("k", [0, -1])
def test_draft_view_needs_a_draft_token(k):
    with pytest.raises(ConfigError, match="spec.num_tokens"):
        DraftView.from_config(tiny_config(), num_draft_tokens=k)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 6), st.one_of(st.none(), st.integers(-2, 8)), st.one_of(st.none(), st.integers(-2, 8)))
def test_draft_view_property(shipped, requested, k):
    cfg = tiny_config().with_mtp_depths(shipped)
    depths = shipped if requested is None else min(shipped, requested)
    kk = depths if k is None else k
    if depths < 1 or kk < 1:
        with pytest.raises(ConfigError):
            DraftView.from_config(cfg, requested, k)
        return
    v = DraftView.from_config(cfg, requested, k)
    assert v.depths == depths and v.num_draft_tokens == kk
    assert 1 <= v.prefill_steps == min(depths, kk) <= v.depths
