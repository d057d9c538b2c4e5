"""``ple.analysis.probe``: the layer's parts add up to its output, ``out`` is the forward's bit for bit on every backend
and placement, ``rows`` are the n-gram ids, the heads' values sum to the value; ``ple.analysis.gates.plot_gate``
draws the gate."""

from __future__ import annotations

import io

import pytest
import torch
from analysis._placements import PLACEMENTS, TINY, inputs, placed, table_values, twin

from ple import reference as ref
from ple.analysis.gates import plot_gate, token_labels
from ple.analysis.probing import Probe, probe
from ple.analysis.table import ablate
from ple.testing.layers import random_layer
from ple.testing.numerics import TOLERANCES, assert_bitwise_equal, assert_close


def ngram_rows(layer, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L, NH]``: each row of the batch hashed from its start by the reference (on the host)."""
    kw = dict(heads_per_ngram=TINY.heads_per_ngram, eos_token_id=TINY.eos_token_id)
    params = ref.hash_params(layer.config, layer.ple_layer_index)
    return torch.stack([ref.ngram_ids(row, params, **kw) for row in input_ids.cpu()]).to(input_ids.device)


def assert_probe_adds_up(layer, h: torch.Tensor, input_ids: torch.Tensor) -> Probe:
    """Every promise of `probe` on one call: shapes, the forward's bits, the sums, the rows, the heads."""
    p = probe(layer, h, input_ids)
    B, L = input_ids.shape
    M, H, C, NH = TINY.hc_count, TINY.hidden_size, TINY.hc_hidden_size, TINY.num_ngram_heads
    shapes = dict(rows=(B, L, NH), score=(B, L, M), gate=(B, L, M), value=(B, L, H), head_value=(B, L, NH, H),
                  gated=(B, L, C), conv=(B, L, C), out=(B, L, C))
    assert {k: tuple(v.shape) for k, v in p._asdict().items()} == shapes
    assert not any(v.requires_grad for v in p)                                  # no autograd
    with torch.no_grad():
        assert_bitwise_equal(p.out, layer(h, input_ids), name="out against the forward")
    assert_bitwise_equal((p.gated + p.conv) + h, p.out, name="(gated + conv) + hidden_states")
    assert torch.equal(p.rows, ngram_rows(layer, input_ids))
    # s and g as docs/spec.md section 4 defines them, from the key; gated = g * value, stream by stream
    g = torch.sigmoid(p.score.sign() * p.score.abs().clamp_min(ref.gate.GATE_CLAMP).sqrt())
    torch.testing.assert_close(p.gate.double(), g.double(), rtol=2**-7, atol=1e-6)
    for m in range(M):
        torch.testing.assert_close(p.gated[..., m * H:(m + 1) * H].double(), (p.gate[..., m:m + 1] * p.value).double(),
                                   rtol=2**-7, atol=1e-6)
    # each head's share: its row times its columns of value_proj, in the accumulation dtype; summed: the value
    dtype = h.dtype
    acc = torch.promote_types(dtype, torch.float32)
    assert p.head_value.dtype == acc and p.value.dtype == dtype
    values = table_values(layer)                                                # float64 [rows, D]
    D = layer.table.dim
    weight = layer.value_proj.weight.detach().double()
    head64 = torch.stack([values.to(dtype).double()[p.rows[..., k]] @ weight[:, k * D:(k + 1) * D].T
                          for k in range(NH)], dim=2)                           # [B, L, NH, H]
    assert_close(p.head_value, head64.to(acc), name="head_value")
    total = p.head_value.double().sum(dim=2)
    rtol, atol = TOLERANCES.get(dtype, (2**-8, 1e-6))                           # bfloat16: its rounding
    torch.testing.assert_close(p.value.double(), total, rtol=rtol, atol=atol)
    return p


def backend_cases() -> list:
    """(backend, dtype) of every backend and dtype; interpreted Triton in float32 in the quick tier, the other
    dtypes in the deep one."""
    cases: list = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        marks = [pytest.mark.interpreter] + ([] if dtype == torch.float32 else [pytest.mark.deep])
        cases += [pytest.param(backend, dtype, marks=m, id=f"{backend}-{str(dtype)[6:]}")
                  for backend, m in (("reference", []), ("torch", []), ("triton", marks))]
    return cases


@pytest.mark.parametrize("backend, dtype", backend_cases())
def test_parts_add_up_on_every_backend(backend, dtype):
    layer = random_layer(TINY, 0, dtype, seed=2, backend=backend)
    h, ids = inputs(0, dtype)
    assert_probe_adds_up(layer, h, ids)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement(placement, tmp_path):
    dense = random_layer(TINY, 0, torch.bfloat16, seed=3, backend="torch")
    layer = placed(dense, placement, tmp_path)
    h, ids = inputs(1, torch.bfloat16)
    p = assert_probe_adds_up(layer, h, ids)
    same = twin(layer, table_values(layer))                                     # its values in a dense table
    for name, got in probe(same, h, ids)._asdict().items():
        assert_bitwise_equal(getattr(p, name), got, name=name)


@pytest.mark.interpreter
@pytest.mark.parametrize("placement", ["nf4", pytest.param("disk-int8", marks=pytest.mark.deep)])
def test_placements_on_triton(placement, tmp_path):
    layer = placed(random_layer(TINY, 0, torch.float32, seed=4, backend="triton"), placement, tmp_path)
    h, ids = inputs(2, torch.float32)
    assert_probe_adds_up(layer, h, ids)


@pytest.mark.gpu
def test_a_host_table_under_a_cuda_layer():
    layer = random_layer(TINY, 0, torch.bfloat16, seed=4, backend="torch").to("cuda")
    layer.table.offload_()
    h, ids = (t.to("cuda") for t in inputs(2, torch.bfloat16))
    p = probe(layer, h, ids)
    with torch.no_grad():
        assert_bitwise_equal(p.out, layer(h, ids), name="out against the forward")
    assert_bitwise_equal((p.gated + p.conv) + h, p.out, name="(gated + conv) + hidden_states")
    assert torch.equal(p.rows, ngram_rows(layer, ids))
    torch.testing.assert_close(p.head_value.double().sum(dim=2), p.value.double(), rtol=2**-8, atol=1e-6)


def test_probe_of_an_ablated_layer():
    layer = random_layer(TINY, 0, torch.float32, seed=5, backend="torch")
    h, ids = inputs(3, torch.float32)
    with ablate(layer, "zero"):
        p = assert_probe_adds_up(layer, h, ids)
    assert not p.head_value.any() and not p.value.any() and not p.gated.any()


def test_bad_arguments():
    layer = random_layer(TINY, 0, torch.float32, seed=5)
    h, ids = inputs(3, torch.float32)
    with pytest.raises(TypeError, match="^layer: "):
        probe(layer.table, h, ids)
    with pytest.raises(TypeError, match="^hidden_states: "):
        probe(layer, h.double(), ids)
    with pytest.raises(ValueError, match="^input_ids: "):
        probe(layer, h, ids[:, :3])


# ---- plot_gate ---------------------------------------------------------------------------------------------
class ConvertingTokenizer:
    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids]


class DecodingTokenizer:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_plot_gate_draws_the_gate():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import numpy as np

    layer = random_layer(TINY, 0, torch.bfloat16, seed=6)
    h, ids = inputs(4, torch.bfloat16)
    p = probe(layer, h, ids)
    B, L, M = p.gate.shape
    for batch, tokens, tokenizer, labels in [
            (1, ids, ConvertingTokenizer(), [f"<{i}>" for i in ids[1].tolist()]),
            (0, ids[0], DecodingTokenizer(), [f"w{i}" for i in ids[0].tolist()]),
            (0, ids[0].tolist(), None, [str(i) for i in ids[0].tolist()]),
            (1, [f"t{i}" for i in range(L)], None, [f"t{i}" for i in range(L)]),
            (1, None, None, [str(i) for i in range(L)])]:
        fig = plot_gate(p, tokens, tokenizer, batch)
        ax = fig.axes[0]
        image = np.asarray(ax.images[0].get_array())
        assert image.shape == (M, L) and image.dtype == np.float32
        assert np.array_equal(image, p.gate[batch].float().T.numpy())            # the gate's values, exactly
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"stream {m}" for m in range(M)]
        fig.savefig(io.BytesIO(), format="png")                                  # it draws
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    assert plot_gate(p.gate[0], ax=ax) is ax.figure                              # a gate tensor [L, M], given axes
    assert np.array_equal(np.asarray(ax.images[0].get_array()), p.gate[0].float().T.numpy())


def test_plot_gate_bad_arguments():
    pytest.importorskip("matplotlib")
    layer = random_layer(TINY, 0, torch.float32, seed=6)
    h, ids = inputs(4, torch.float32)
    p = probe(layer, h, ids)
    with pytest.raises(ValueError, match="^batch: "):
        plot_gate(p, batch=2)
    with pytest.raises(TypeError, match="^batch: "):
        plot_gate(p, batch=0.0)
    with pytest.raises(ValueError, match="^tokens: .*9"):
        plot_gate(p, ids[0, :4])
    with pytest.raises(ValueError, match="^tokens: "):
        plot_gate(p, tokenizer=ConvertingTokenizer())
    with pytest.raises(TypeError, match="^tokenizer: "):
        plot_gate(p, ids[0], object())
    with pytest.raises(TypeError, match="^tokens: "):
        token_labels([1, "a"])
    with pytest.raises(ValueError, match="^probe: "):
        plot_gate(p.gate[0, 0])
