"""`plot_gate`: the gate of a `probe`, per token and stream, as a heatmap (matplotlib, imported only when drawing).

matplotlib is an optional dependency (the ``analysis`` extra, ``pip install 'ple[analysis]'``; the ``dev``
extra has it too): importing this module does not import it;
`plot_gate` does, and says how to install it when it is missing. The figure is a
``matplotlib.figure.Figure`` made without ``pyplot`` (no global state, any backend: show it in a
notebook, or ``fig.savefig(path)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _checks

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_gate", "token_labels"]


def token_labels(tokens: torch.Tensor | Sequence[int] | Sequence[str], tokenizer: Any = None) -> list[str]:
    """Tick labels of ``tokens``: strings as given; token ids (a 1-D tensor or a sequence of ints) through
    ``tokenizer`` (its ``convert_ids_to_tokens(list)`` where it has one, else ``decode([id])`` per token), or
    as their numbers without one. A tokenizer with neither method is a ``TypeError`` naming ``tokenizer``."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(f"tokens: expected token ids [L] (an integer tensor), got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        items: list[Any] = tokens.tolist()
    elif isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens: expected token ids or texts (a tensor or a sequence), got {type(tokens).__name__}")
    else:
        items = list(tokens)
    if all(isinstance(t, str) for t in items):
        return list(items)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        raise TypeError("tokens: expected all token ids (ints) or all texts (str)")
    if tokenizer is None:
        return [str(t) for t in items]
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if callable(convert):
        return [str(t) for t in convert(items)]
    decode = getattr(tokenizer, "decode", None)
    if callable(decode):
        return [str(decode([t])) for t in items]
    raise TypeError(f"tokenizer: expected an object with convert_ids_to_tokens or decode, got "
                    f"{type(tokenizer).__name__}")


def plot_gate(probe: Any, tokens: torch.Tensor | Sequence[int] | Sequence[str] | None = None,
              tokenizer: Any = None, batch: int = 0, *, ax: Axes | None = None) -> Figure:
    """A heatmap of the gate ``g`` of a `probe` (``ple.analysis.probe``): streams down, tokens across.

    ``probe``: what `probe` returns (its ``gate`` ``[B, L, M]``), or the gate tensor itself (``[B, L, M]`` or
    ``[L, M]``). ``batch``: the row of the batch drawn (default 0). The image's data is
    ``gate[batch].T`` (``[M, L]``) as float32, exactly the gate's values (bfloat16 and float16 widen exactly;
    float64 rounds), on a fixed scale of 0 to 1 with a colour bar.

    ``tokens``: the x tick labels, one per token: texts, or token ids (``[L]``, or ``[B, L]`` of which row
    ``batch`` is used) read through ``tokenizer`` (anything with ``convert_ids_to_tokens`` or ``decode``, as
    a transformers tokenizer; see `token_labels`), or shown as numbers without one. Without ``tokens`` the
    ticks are the positions. ``ax``: draw into these axes (the figure returned is theirs); default a new
    figure sized to the sentence.

    Raises: matplotlib missing: ``ImportError``. ``batch`` not an int: ``TypeError``; outside ``[0, B)``:
    ``ValueError``. ``tokens`` of another length than L: ``ValueError``; a ``tokenizer`` without ``tokens``:
    ``ValueError`` naming ``tokens``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:                                              # pragma: no cover (dev extra)
        raise ImportError("plot_gate needs matplotlib: pip install matplotlib (the analysis extra: "
                          "pip install -e '.[analysis]')") from e
    gate = getattr(probe, "gate", probe)
    _checks.tensor("probe", gate, kind="float")
    if gate.dim() == 2:
        gate = gate[None]
    if gate.dim() != 3:
        raise ValueError(f"probe: expected a gate [B, L, M] (or [L, M]), got shape {tuple(gate.shape)}")
    B, L, M = gate.shape  # batch, tokens, streams
    if not (B and L and M):
        raise ValueError(f"probe: nothing to draw in a gate of shape {tuple(gate.shape)}")
    batch = _checks.int_arg("batch", batch, minimum=0, maximum=B - 1)
    labels = None
    if tokens is not None:
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            tokens = tokens[batch]
        labels = token_labels(tokens, tokenizer)
        if len(labels) != L:
            raise ValueError(f"tokens: expected {L} tokens (the probe's length), got {len(labels)}")
    elif tokenizer is not None:
        raise ValueError("tokens: a tokenizer reads token ids: pass the ids as tokens")
    data = gate[batch].detach().to("cpu", torch.float32).T.numpy()        # [M, L]
    if ax is None:
        fig = Figure(figsize=(max(4.0, 0.35 * L + 2.0), max(2.0, 0.45 * M + 1.5)), layout="constrained")
        ax = fig.subplots()
    else:
        fig = cast("Figure", ax.figure)                                   # (a SubFigure's axes draw too)
    image = ax.imshow(data, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(M), [f"stream {m}" for m in range(M)])
    ax.set_xticks(range(L), labels if labels is not None else [str(i) for i in range(L)],
                  rotation=90 if labels is not None else 0)
    ax.set_xlabel("token")
    ax.set_title("gate per token and stream")
    fig.colorbar(image, ax=ax, label="gate")
    return fig
