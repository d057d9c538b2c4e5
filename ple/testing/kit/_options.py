"""The checks of the kit's keyword options, run before any case is drawn (docs/spec.md sections 9 and 10).

Each option is checked by the helper of its kind in ``ple._checks`` (a wrong Python type is a ``TypeError``,
the right type out of range or set a ``ValueError``, each naming the option), so a mistake reads the same on
every ``check_<op>``: ``max_examples`` an int >= 1; ``seed`` an int or None; ``dtypes`` a non-empty sequence
of float dtypes (`FLOAT_DTYPES`); ``grad`` and ``serving`` bools; ``exact_states`` a bool or None; the caps
(``max_<what>``) ints >= 1 (``max_lookups`` >= 0: a step may look up nothing). The named choices of one
check (``modes``, ``parts``, ``rules``, ``schemes``) are checked where they are defined, with
``_checks.choices_arg``.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _checks

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a check's ``dtypes`` may name."""

_CAP_MINIMUM = {"max_lookups": 0}


def check_options(**options: Any) -> None:
    """Check a ``check_<op>``'s keyword options, by name (see the module docstring)."""
    for name, value in options.items():
        if name == "dtypes":
            _checks.choices_arg(name, value, FLOAT_DTYPES, kind=torch.dtype)
        elif name in ("grad", "serving") or (name == "exact_states" and value is not None):
            _checks.bool_arg(name, value)
        elif name == "seed" and value is not None:
            _checks.int_arg(name, value)
        elif name == "max_examples" or name.startswith("max_"):
            _checks.int_arg(name, value, minimum=_CAP_MINIMUM.get(name, 1))
        elif name not in ("seed", "exact_states"):
            raise AssertionError(f"check_options: no rule for the option {name!r}")
