"""Integrations with other libraries; each is an optional extra.

* ``ple.integrations.transformers``: `patch` / `unpatch` a transformers ``Qwen4Exp*`` model
  (``pip install 'ple[hf]'``).

Importing this package imports none of them.
"""

__all__: list[str] = []
