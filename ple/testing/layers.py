"""Layers with every parameter random, so every path of the layer shows in its output."""

from __future__ import annotations

from typing import Any

import torch

from ..config import PLEConfig
from ..layer import PLELayer

__all__ = ["random_layer"]


def random_layer(config: PLEConfig, index: int = 0, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 **kwargs: Any) -> PLELayer:
    """A `PLELayer` whose norms and conv are random too (the model starts them at zero).

    Projections are scaled by ``1/sqrt(E)``, norms and conv by 0.3, the table is normal(0, 1).
    ``kwargs`` go to `PLELayer` (``backend``, ``device``, ...).
    """
    layer = PLELayer(config, index, dtype=dtype, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    E = layer.value_proj.weight.shape[1]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if "norm" in name or "conv" in name else 1.0
            if "proj" in name:
                scale = E ** -0.5
            value = torch.randn(p.shape, generator=gen) * scale
            if "norm" in name and config.family == "engram":     # the Engram family scales by w itself
                value += 1.0
            p.copy_(value.to(p.dtype))
    return layer
