"""The one way ``ple.fast`` registers an op with ``torch.library``, and gives its public function the reference's doc.

Each part (``hashing``, ``embedding``, ``gate``, ``conv``, ``training_conv``) ends with
its registrations: `register` wraps ``torch.library.custom_op`` (namespace ``ple``, so
the op is ``torch.ops.ple.<name>``), ``register_fake`` (shapes for tracing) and, for
differentiable ops, ``register_autograd`` (whose backward is itself a registered op).
`twin` gives the public Python function the signature and docstring of its
``ple.reference`` twin, so they exist once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

__all__ = ["register", "twin"]


def register(name: str, impl: Callable, *, fake: Callable, mutates_args=(), backward: Callable | None = None,
             setup_context: Callable | None = None):
    """``torch.ops.ple.<name>`` running ``impl`` (annotated: its annotations are the op's schema).

    ``fake`` gives the outputs' metadata under tracing; ``backward`` / ``setup_context``
    (both or neither) register the op's autograd formula. Returns the op.
    """
    op = torch.library.custom_op(f"ple::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op


def twin(reference: Callable) -> Callable[[Callable], Callable]:
    """Decorator: the decorated public function takes ``reference``'s docstring and signature."""

    def decorate(fn: Callable) -> Callable:
        fn.__doc__ = reference.__doc__
        fn.__signature__ = inspect.signature(reference)
        return fn

    return decorate
