"""`PLEConfig` (docs/spec.md section 1): validation, derived sizes, loading, presets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from ple import PRESETS, PLEConfig

# The smallest valid set of fields; every case below changes one of them.
BASE = dict(
    vocab_size=50,
    hidden_size=12,
    hc_count=2,
    eos_token_id=3,
    ple_embed_dim=12,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=3,
    ple_layer_ids=(1,),
)


def make(**changes) -> PLEConfig:
    return PLEConfig(**{**BASE, **changes})


# (field, bad value of the right type): each must raise ValueError whose message starts with the field's name.
# A value of the wrong Python type (50.0, True or "12" for an int, "1e-6" for rms_norm_eps, ...) is a TypeError:
# tests/test_error_types.py, with every other argument of the package.
INVALID = [
    ("vocab_size", 0),
    ("vocab_size", -5),
    ("hidden_size", 0),
    ("hc_count", 0),
    ("hc_count", -1),
    ("ple_embed_dim", 0),
    ("ple_embed_dim", 13),  # 13 is not divisible by NH = 6
    ("ple_embed_dim", 9),  # nor is 9
    ("ple_conv_kernel_size", 0),
    ("ple_conv_kernel_size", -1),
    ("ngram_size", 1),
    ("ngram_size", 0),
    ("heads_per_ngram", 0),
    ("ngram_vocab_size_base", 1),
    ("ngram_vocab_size_base", 0),
    ("make_ngram_vocab_size_divisible_by", 0),
    ("seed", -1),
    ("eos_token_id", None),
    ("eos_token_id", []),
    ("eos_token_id", -1),
    ("eos_token_id", 50),
    ("eos_token_id", [50, 3]),
    ("rms_norm_eps", 0.0),
    ("rms_norm_eps", -1e-6),
    ("rms_norm_eps", float("nan")),
    ("rms_norm_eps", float("inf")),
    ("ple_layer_ids", [0]),
    ("ple_layer_ids", [2, -1]),
    ("split_ngram_parts", 0),
]


@pytest.mark.parametrize("field, value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        make(**{field: value})


def test_the_base_config_is_valid():
    # Guards the table above: every failure there comes from the one changed field.
    c = make()
    assert (c.vocab_size, c.hidden_size, c.eos_token_id) == (50, 12, 3)


def test_defaults():
    c = PLEConfig(vocab_size=10, hidden_size=48, hc_count=3, eos_token_id=0)
    assert c.ple_embed_dim == 48  # defaults to hidden_size
    assert c.ple_conv_kernel_size == 4
    assert c.ngram_size == 3
    assert c.heads_per_ngram == 8
    assert c.ngram_vocab_size_base == 20_000_000
    assert c.make_ngram_vocab_size_divisible_by == 128
    assert c.seed == 1234
    assert c.rms_norm_eps == 1e-6
    assert c.split_ngram_parts == 512
    assert c.ple_layer_ids == () and c.num_ple_layers == 0      # no PLE layer, as in transformers


@given(
    N=st.integers(2, 6),
    P=st.integers(1, 5),
    D=st.integers(1, 7),
    K=st.integers(1, 6),
    H=st.integers(1, 40),
    M=st.integers(1, 5),
)
def test_derived_properties(N, P, D, K, H, M):
    NH = (N - 1) * P
    c = PLEConfig(
        vocab_size=100,
        hidden_size=H,
        hc_count=M,
        eos_token_id=99,
        ple_embed_dim=NH * D,
        ple_conv_kernel_size=K,
        ngram_size=N,
        heads_per_ngram=P,
    )
    note(c)
    assert c.num_ngram_heads == NH
    assert c.ngram_head_dim == D
    assert c.hc_hidden_size == M * H
    assert c.conv_dilation == N
    assert c.conv_state_len == (K - 1) * N
    assert c.context_len == N - 1


def test_eos_token_id_list_means_first_entry():
    assert make(eos_token_id=[7, 3, 9]).eos_token_id == 7
    assert make(eos_token_id=(4,)).eos_token_id == 4


def test_ple_layer_ids_are_sorted_and_unique():
    c = make(ple_layer_ids=[9, 2, 5, 2, 9])
    assert c.ple_layer_ids == (2, 5, 9)
    assert c.num_ple_layers == 3
    assert make(ple_layer_ids=4).ple_layer_ids == (4,)


def test_rms_norm_eps_int_is_stored_as_float():
    c = make(rms_norm_eps=1)
    assert isinstance(c.rms_norm_eps, float) and c.rms_norm_eps == 1.0


# A model config.json shaped like the released one: the text part under ``text_config``,
# next to a vision part and top-level keys the layer does not read.
TEXT_CONFIG = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 248320,
    "hidden_size": 2560,
    "hc_count": 4,
    "ple_embed_dim": 2560,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "eos_token_id": [248044, 248046],
    "rms_norm_eps": 1e-6,
    "ple_layer_ids": [2],
    "split_ngram_parts": 128,
    # Unrelated keys:
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "intermediate_size": 9216,
    "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"},
    "layer_types": ["full_attention"] * 40,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
MODEL_CONFIG = {
    "architectures": ["Qwen4ExpForConditionalGeneration"],
    "model_type": "qwen4_exp",
    "text_config": TEXT_CONFIG,
    "vision_config": {"hidden_size": 1152, "depth": 27, "vocab_size": 7},
    "image_token_id": 248056,
    "transformers_version": "5.23.0",
    "hidden_size": 31,  # a top-level decoy that must not be read
}


def test_from_dict_full_model_config_reads_text_config_and_ignores_the_rest():
    c = PLEConfig.from_dict(MODEL_CONFIG)
    assert c == PRESETS["qwen4exp"]
    assert c.eos_token_id == 248044


def test_from_dict_text_config_alone():
    assert PLEConfig.from_dict(dict(TEXT_CONFIG)) == PRESETS["qwen4exp"]


def test_from_dict_leaves_its_argument_alone():
    data = json.loads(json.dumps(MODEL_CONFIG))
    PLEConfig.from_dict(data)
    assert data == json.loads(json.dumps(MODEL_CONFIG))


def test_from_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODEL_CONFIG), encoding="utf-8")
    assert PLEConfig.from_json(path) == PRESETS["qwen4exp"]
    assert PLEConfig.from_json(str(path)) == PRESETS["qwen4exp"]


def test_from_dict_defaults_when_optional_keys_absent():
    c = PLEConfig.from_dict(
        {
            "vocab_size": 10,
            "hidden_size": 32,
            "hc_count": 2,
            "eos_token_id": [1],
            "ple_layer_ids": None,
            "unrelated": {"x": 1},
        }
    )
    assert c.ple_embed_dim == 32 and c.ple_layer_ids == () and c.eos_token_id == 1


def test_missing_ple_layer_ids_means_no_ple_layer_and_building_one_is_an_error():
    """transformers reads a missing (or null) ``ple_layer_ids`` as no PLE layer; so does ple."""
    from ple import PLELayer
    from ple.state import PLECache

    for data in ({"vocab_size": 10, "hidden_size": 8, "hc_count": 2, "eos_token_id": 1},
                 {"vocab_size": 10, "hidden_size": 8, "hc_count": 2, "eos_token_id": 1, "ple_layer_ids": None},
                 {"text_config": {"vocab_size": 10, "hidden_size": 8, "hc_count": 2, "eos_token_id": 1}}):
        c = PLEConfig.from_dict(data)
        assert c.num_ple_layers == 0
        with pytest.raises(ValueError, match="^config: has no PLE layer"):
            PLELayer(c, 0)
        with pytest.raises(ValueError, match="^config: has no PLE layer"):
            PLECache(c, num_slots=4)


@pytest.mark.parametrize("missing", ["vocab_size", "hidden_size", "hc_count", "eos_token_id"])
def test_from_dict_missing_required_field_names_it(missing):
    data = {k: v for k, v in TEXT_CONFIG.items() if k != missing}
    with pytest.raises(ValueError, match=rf"^{missing}\b"):
        PLEConfig.from_dict(data)


def test_from_dict_null_eos_names_it():
    with pytest.raises(ValueError, match=r"^eos_token_id\b"):
        PLEConfig.from_dict({**TEXT_CONFIG, "eos_token_id": None})


def test_from_dict_invalid_value_names_the_field():
    with pytest.raises(ValueError, match=r"^ple_embed_dim\b"):
        PLEConfig.from_dict({**TEXT_CONFIG, "ple_embed_dim": 2561})
    with pytest.raises(ValueError, match=r"^ngram_size\b"):
        PLEConfig.from_dict({"text_config": {**TEXT_CONFIG, "ngram_size": 1}})


def test_from_dict_rejects_non_dict():
    with pytest.raises(TypeError, match=r"^data\b"):
        PLEConfig.from_dict([("vocab_size", 3)])


def test_qwen4exp_preset_is_the_released_model():
    c = PLEConfig.preset("qwen4exp")
    assert c is PRESETS["qwen4exp"] or c == PRESETS["qwen4exp"]
    assert (c.vocab_size, c.hidden_size, c.hc_count, c.ple_embed_dim) == (248320, 2560, 4, 2560)
    assert (c.ple_conv_kernel_size, c.ngram_size, c.heads_per_ngram) == (4, 3, 8)
    assert c.eos_token_id == 248044
    assert c.ple_layer_ids == (2,)
    assert c.split_ngram_parts == 128
    assert (c.ngram_vocab_size_base, c.make_ngram_vocab_size_divisible_by, c.seed) == (20_000_000, 128, 1234)
    # Derived sizes of the notation table.
    assert (c.num_ngram_heads, c.ngram_head_dim, c.hc_hidden_size, c.conv_dilation, c.conv_state_len) == (
        16,
        160,
        10240,
        3,
        9,
    )


def test_tiny_preset_is_small_and_valid():
    c = PLEConfig.preset("tiny")
    assert c == PRESETS["tiny"]
    assert c.hc_hidden_size * c.ple_embed_dim <= 10_000
    assert c.vocab_size <= 10_000


def test_preset_overrides_and_unknown_name():
    c = PLEConfig.preset("tiny", seed=7, ple_layer_ids=[3, 1])
    assert c.seed == 7 and c.ple_layer_ids == (1, 3)
    assert PRESETS["tiny"].seed == 1234  # the preset itself is untouched
    with pytest.raises(ValueError, match=r"^name\b"):
        PLEConfig.preset("qwen5")
    with pytest.raises(ValueError, match=r"^ngram_size\b"):
        PLEConfig.preset("tiny", ngram_size=1)


def test_to_dict_round_trips_through_from_dict():
    for c in PRESETS.values():
        assert PLEConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_from_dict_reads_top_level_keys_beside_text_config():
    cfg = PLEConfig.from_dict({"eos_token_id": [5, 6], "architectures": ["X"],
                               "text_config": {"vocab_size": 100, "hidden_size": 8, "hc_count": 1,
                                               "heads_per_ngram": 2, "ple_embed_dim": 8}})
    assert cfg.eos_token_id == 5 and cfg.vocab_size == 100
    inner_wins = PLEConfig.from_dict({"vocab_size": 7, "eos_token_id": 1,
                                      "text_config": {"vocab_size": 100, "hidden_size": 8, "hc_count": 1,
                                                      "heads_per_ngram": 2, "ple_embed_dim": 8}})
    assert inner_wins.vocab_size == 100
