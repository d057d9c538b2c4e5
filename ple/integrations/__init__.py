"""Integrations with other libraries; each is an optional extra.

* ``ple.integrations.transformers``: `patch` / `unpatch` a transformers ``Qwen4Exp*`` model
  (``pip install 'ple[hf]'``).
* ``ple.integrations.engram``: `token_map` builds DeepSeek's Engram compressed-tokenizer lookup from a
  ``tokenizers`` / transformers tokenizer, for ``PLEConfig.engram(token_map=...)`` (``pip install 'ple[engram]'``
  for the ``tokenizers`` library's normalizers; docs/engram.md).

Importing this package imports none of them.
"""

__all__: list[str] = []
