"""``ple.integrations.transformers``: a patched transformers model computes what the unpatched one does.

A tiny ``Qwen4Exp`` model is built here with random weights (no hub). The model initialises
the PLE norms and conv to zero, which would hide mistakes in them, so they are randomised
(`randomise_ple`).
Both backends run (Triton under the interpreter on the CPU). Needs the ``hf`` extra, which
``.[dev]`` includes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    Qwen4ExpConfig,
    Qwen4ExpForCausalLM,
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpTextConfig,
)
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer  # noqa: E402

from ple.integrations.transformers import (  # noqa: E402
    TransformersPLELayer,
    is_patched,
    patch,
    tiny_config,
    unpatch,
)
from ple.quant import dequantize  # noqa: E402

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)]
EOS = 2


def text_config(**changes) -> Qwen4ExpTextConfig:
    """`tiny_config`: four decoder layers (three GatedDeltaNet, one indexed attention); PLE on decoder layers 1
    and 3; EOS 2."""
    config = tiny_config(**changes)
    assert config.eos_token_id == EOS
    return config


def randomise_ple(model) -> None:
    """The PLE norms and conv at normal(0, 0.5), and token embeddings at normal(0, 4) so the hidden states are
    as large as the PLE term (in bfloat16, ``(h + term) - h`` then differs from ``term``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ple." in name and ("norm_" in name or "conv1d" in name):
                p.normal_(0.0, 0.5)
        model.get_input_embeddings().weight.normal_(0.0, 4.0)


def tiny_model(dtype=torch.float32, *, seed: int = 0, kind: str = "causal", **changes):
    torch.manual_seed(seed)
    if kind == "causal":
        model = Qwen4ExpForCausalLM(text_config(**changes))
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                      num_position_embeddings=16)
        config = Qwen4ExpConfig(text_config=text_config(**changes).to_dict(), vision_config=vision,
                                image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
        model = Qwen4ExpForConditionalGeneration(config)
    randomise_ple(model)
    return model.to(dtype).eval()


def batch(seed: int = 1, B: int = 2, L: int = 9):
    """Token ids with an EOS inside a row, and a left-padded second row (its padding is token 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (B, L), generator=g)
    ids[0, 4] = EOS
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def ple_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if ".ple." in n}


# ---- whole sequences: logits and gradients --------------------------------------------------------------
@pytest.mark.parametrize("backend", [*BACKENDS[:2], pytest.param("triton", marks=[pytest.mark.interpreter,
                                                                                 pytest.mark.deep])])
def test_patched_logits_equal_float32_and_bfloat16_bit_for_bit(backend):
    ids, mask = batch()
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(dtype)
        with torch.no_grad():
            want = model(ids, attention_mask=mask).logits
            patch(model, backend=backend)
            got = model(ids, attention_mask=mask).logits
        assert all(type(m) is TransformersPLELayer for m in (model.model.layers[0].ple, model.model.layers[2].ple))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:                                          # the reference rounds as the model does, and so do the kernels
            assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_returns_the_models_term_bit_for_bit(backend):
    """The swapped module returns the model's module's own value, ``gated + conv``, not ``layer(h) - h``
    (in bfloat16 that differs; the model adding ``h`` back mostly rounds it away, so logits alone miss it)."""
    model = tiny_model(torch.bfloat16)
    original = model.model.layers[2].ple
    ids, mask = batch()
    h = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        want = [original(h, ids, None), original(h, ids, None, conv_mask=mask)]
        patch(model, backend=backend)
        layer = model.model.layers[2].ple
        got = [layer(h, ids, None), layer(h, ids, None, conv_mask=mask.bool())]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g.float() - w.float()).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_gradients_equal(backend):
    ids, mask = batch()
    model = tiny_model(torch.float32).train()
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    want = ple_grads(model)
    model.zero_grad()
    patch(model, backend=backend)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    got = ple_grads(model)
    assert got.keys() == want.keys() and len(got) == 14            # 7 tensors in each of the 2 PLE layers
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_conditional_generation_form_is_patched_too():
    model = tiny_model(torch.float32, kind="conditional")
    ids, mask = batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        patch(model, backend="reference")
        got = model(ids, attention_mask=mask).logits
    assert sum(isinstance(m, TransformersPLELayer) for m in model.modules()) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the model's own cache: generate() and chunked prefill ----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_left_padded_batch_gives_the_same_tokens(backend):
    ids, mask = batch()
    model = tiny_model(torch.bfloat16)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    want = model.generate(ids, **kw)
    patch(model, backend=backend)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def _run_chunks(model, ids, chunks, switch_at=None):
    """Logits of ``ids`` fed through the model's cache in chunks; ``switch_at``: patch after that many chunks."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out, start = [], 0
    for k, n in enumerate(chunks):
        if k == switch_at:
            patch(model, backend="reference")
        with torch.no_grad():
            out.append(model(ids[:, start:start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, dim=1), cache


def test_chunked_prefill_and_decode_through_the_models_cache_bit_for_bit():
    """Chunks shorter than the n-gram context (N - 1 = 2) and the conv state (S = 9), then decode steps, in
    bfloat16: the patched model's logits and the cache's contents equal the unpatched model's, and a cache
    the unpatched model started is continued by the patched one."""
    ids, _ = batch(L=16)
    chunks = [1, 3, 7, 1, 1, 3]
    want, want_cache = _run_chunks(tiny_model(torch.bfloat16), ids, chunks)
    for switch_at in (0, 2):
        got, cache = _run_chunks(tiny_model(torch.bfloat16), ids, chunks, switch_at=switch_at)
        assert torch.equal(got, want), switch_at
        for layer in (0, 2):                                        # the PLE layers' decoder indices
            for state in (1, 2):
                assert torch.equal(cache.get_conv_state(layer, state), want_cache.get_conv_state(layer, state))


# ---- parameters, state_dict, save_pretrained, unpatch ---------------------------------------------------
def test_patch_shares_the_parameters_and_keeps_state_dict_and_save_pretrained(tmp_path):
    model = tiny_model(torch.float32)
    before = model.state_dict()
    params = {n: p for n, p in model.named_parameters()}
    patch(model, backend="reference")
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)          # nothing was copied
    assert all(p is params[n] for n, p in model.named_parameters())                  # optimizers keep working
    ids, mask = batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    loaded = Qwen4ExpForCausalLM.from_pretrained(tmp_path).eval()
    assert not is_patched(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)


def test_unpatch_restores_the_models_modules_with_the_trained_tensors():
    model = tiny_model(torch.float32)
    original = model.model.layers[0].ple
    patch(model, backend="reference")
    assert patch(model, backend="reference") is model and is_patched(model)          # idempotent
    layer = model.model.layers[0].ple
    with torch.no_grad():
        layer.conv1d.weight.add_(1.0)                                 # e.g. an optimizer step
    model.model.layers[0].ple.ple_embedding.register_buffer(
        "layer_multipliers", layer.ple_embedding.layer_multipliers.clone())           # e.g. .to() replaced it
    unpatch(model)
    assert not is_patched(model)
    assert model.model.layers[0].ple is original and type(original) is Qwen4ExpTextPLELayer
    assert original.conv1d.weight is layer.conv1d.weight
    assert original.ple_embedding.layer_multipliers is layer.ple_embedding.layer_multipliers
    assert unpatch(model) is model


def test_patch_refuses_what_it_cannot_patch_and_changes_nothing():
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="backend"):
        patch(model, backend="cuda")
    assert not is_patched(model)
    with pytest.raises(TypeError, match="model"):
        patch(torch.nn.Linear(2, 2))
    no_ple = Qwen4ExpForCausalLM(text_config(ple_layer_ids=None))
    with pytest.raises(ValueError, match="no PLE module"):
        patch(no_ple)
    layer = model.model.layers[0].ple
    with pytest.raises(ValueError, match="hidden_states"):
        patch(model, backend="reference").model.layers[0].ple(
            torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long), None)
    with pytest.raises(TypeError, match="conv_mask"):
        model.model.layers[0].ple(torch.zeros(1, 3, 64), torch.zeros(1, 3, dtype=torch.long), None,
                                  conv_mask=torch.ones(1, 3, dtype=torch.complex64))
    assert type(layer) is Qwen4ExpTextPLELayer


# ---- checkpoints: what `convert` writes, transformers loads right, or it is refused / marked ----------
def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def _table_as(model, dtype):
    """A copy of ``model`` with its PLE tables rounded to ``dtype`` and back (what a cast table holds)."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith("ngram_embedding.weight"):
                p.copy_(p.to(dtype).to(p.dtype))
    return out


def test_converted_checkpoints_load_right_in_transformers_or_are_refused_or_marked(tmp_path):
    from ple import io as pio
    from ple.__main__ import main

    model = tiny_model(torch.float32)
    src = tmp_path / "model"
    model.save_pretrained(src)                                         # tables as split_ngram_parts shards
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    ids, mask = batch()
    want = _logits(model, ids, mask)

    for k, (opts, expected) in enumerate([(["--parts", "0"], model), (["--parts", "5"], model),
                                          (["--table-dtype", "bfloat16"], _table_as(model, torch.bfloat16))]):
        dst = tmp_path / f"ok{k}"
        assert main(["convert", str(src), str(dst), *opts]) == 0
        for name in ("generation_config.json", "tokenizer.json", "chat_template.jinja"):   # every non-weight file
            assert (dst / name).read_bytes() == (src / name).read_bytes(), name
        assert pio.inspect(dst)["ple_only"] == [] and "ple_only" not in (dst / "config.json").read_text()
        loaded = Qwen4ExpForCausalLM.from_pretrained(dst).eval()
        assert torch.equal(_logits(loaded, ids, mask), _logits(expected, ids, mask)), opts

    for k, opts in enumerate([["--table-dtype", "fp8"], ["--table-dtype", "int8"], ["--kv", "merged"]]):
        dst = tmp_path / f"ple{k}"
        assert main(["convert", str(src), str(dst), *opts]) == 2 and not dst.exists()     # refused
        assert main(["convert", str(src), str(dst), *opts, "--ple-only"]) == 0
        report = pio.inspect(dst)
        assert report["ple_only"] and report["ple_only_marked"], opts
        assert "for ple only (marked so" in pio.format_inspect(report)
        assert "ple_only" in (dst / "config.json").read_text()
        layer = pio.load_layer(dst, ple_layer_index=1)                 # ple reads it
        if opts[0] == "--kv":
            assert torch.equal(layer.key_proj.weight, model.model.layers[2].ple.key_proj.weight)
        # Converted back to a float table with separate projections, it is unmarked and transformers
        # holds exactly what ple dequantizes.
        back = tmp_path / f"back{k}"
        assert main(["convert", str(dst), str(back), "--table-dtype", "float32", "--kv", "separate"]) == 0
        assert pio.inspect(back)["ple_only"] == [] and not pio.inspect(back)["ple_only_marked"]
        hf = Qwen4ExpForCausalLM.from_pretrained(back).eval()
        mine = pio.load_layer(dst, ple_layer_index=1, dtype=torch.float32)
        theirs = hf.model.layers[2].ple
        table = mine.table.weight if mine.table.scale is None else \
            dequantize(mine.table.weight, mine.table.scale, torch.float32)
        assert torch.equal(theirs.ple_embedding.ngram_embedding.weight, table)
        assert torch.equal(theirs.value_proj.weight, mine.value_proj.weight)
    assert torch.equal(_logits(Qwen4ExpForCausalLM.from_pretrained(tmp_path / "back2").eval(), ids, mask), want)
