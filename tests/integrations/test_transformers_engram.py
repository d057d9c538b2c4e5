"""``ple.integrations.transformers`` refuses the Engram family (docs/engram.md): a ``ValueError`` naming it, and
the model left as it was. Needs the ``hf`` extra, which ``.[dev]`` includes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration  # noqa: E402

import ple  # noqa: E402
from ple.integrations.transformers import TransformersPLELayer, is_patched, patch, tiny_config  # noqa: E402


def engram_config() -> ple.PLEConfig:
    return ple.PLEConfig.engram(vocab_size=64, hidden_size=32, hc_count=2, engram_vocab_size=(101, 103),
                                n_embed_per_ngram=8, n_head_per_ngram=2, layer_ids=(1, 3), pad_id=2)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["causal", "conditional"])
def test_patch_refuses_a_model_whose_config_says_engram(kind):
    torch.manual_seed(0)
    if kind == "causal":
        model = Qwen4ExpForCausalLM(tiny_config(family="engram"))
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                      num_position_embeddings=16)
        config = Qwen4ExpConfig(text_config=tiny_config(family="engram").to_dict(), vision_config=vision,
                                image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
        model = Qwen4ExpForConditionalGeneration(config)
    before = _state(model)
    with pytest.raises(ValueError, match="Engram family") as err:
        patch(model, backend="reference")
    assert str(err.value).startswith("model:")
    assert not is_patched(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_qwen4exp_model_still_patches():
    """The refusal reads the family only: a model without it (the Qwen4Exp default) patches as before."""
    model = Qwen4ExpForCausalLM(tiny_config())
    assert is_patched(patch(model, backend="reference"))


def test_a_transformers_layer_refuses_an_engram_config():
    with pytest.raises(ValueError, match="Engram family") as err:
        TransformersPLELayer(engram_config(), 0, 1, backend="reference")
    assert str(err.value).startswith("config:")
