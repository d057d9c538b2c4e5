"""The one way ``ple.fast`` registers an op with ``torch.library``, and gives its public function the reference's doc.

Each part (``hashing``, ``embedding``, ``gate``, ``conv``, ``training_conv``, ``prefill``) ends with
its registrations: `register` wraps ``torch.library.custom_op`` (namespace ``ple``, so
the op is ``torch.ops.ple.<name>``), ``register_fake`` (shapes for tracing) and, for
differentiable ops, ``register_autograd`` (whose backward is itself a registered op).
`twin` gives the public Python function the signature and docstring of its
``ple.reference`` twin, so they exist once (a docstring of its own is appended under "Triton backend
notes:"), and refuses CPU tensors when the kernels are compiled (`check_runnable`: a clear
``ValueError`` instead of Triton's "0 active drivers").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..backends import twin as _twin

__all__ = ["register", "twin", "INTERPRETED", "check_runnable"]

_F = TypeVar("_F", bound=Callable[..., Any])

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels were defined under the interpreter (Triton reads ``TRITON_INTERPRET`` when a kernel
is defined, i.e. when ``ple.fast`` is first imported; setting it later changes nothing)."""


def check_runnable(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``ValueError`` if the call's tensors are on the CPU while the kernels are compiled (not interpreted):
    Triton's own error there is "0 active drivers"."""
    if INTERPRETED:
        return
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            if t.device.type == "cpu":
                raise ValueError(
                    f"{name}: the tensors are on the CPU, where ple.fast's Triton kernels cannot run compiled; "
                    f"move them to a CUDA device, or set TRITON_INTERPRET=1 before the first `import ple.fast` "
                    f"(or anything importing Triton) to run the kernels in Triton's interpreter, or use "
                    f"ple.reference")
            return


def register(name: str, impl: Callable[..., Any], *, fake: Callable[..., Any], mutates_args: str | tuple[str, ...] = (),
             backward: Callable[..., Any] | None = None,
             setup_context: Callable[..., Any] | None = None) -> torch.library.CustomOpDef:
    """``torch.ops.ple.<name>`` running ``impl`` (annotated: its annotations are the op's schema).

    ``fake`` gives the outputs' metadata under tracing; ``backward`` / ``setup_context``
    (both or neither) register the op's autograd formula. Returns the op.
    """
    op = torch.library.custom_op(f"ple::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op


def twin(reference: Callable[..., Any]) -> Callable[[_F], _F]:
    """``ple.backends.twin`` with `check_runnable` as its guard: the public op takes ``reference``'s docstring
    (its own appended as notes) and signature, and refuses CPU tensors while the kernels are compiled."""
    return _twin(reference, guard=check_runnable)
