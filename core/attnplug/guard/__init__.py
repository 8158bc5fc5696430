"""The static guard: report every read of the base ``attention_backend`` field.

Why: an operator may set ``--prefill-attention-backend`` and
``--decode-attention-backend`` and leave the base ``--attention-backend``
unset. A decision that reads only the base field then answers from a field
nobody set. Every decision must read the pair ``attention_backends()`` and pick
the half it needs; this module proves, without importing anything, that a list
of decision files never reads the base field at all (see ``docs/guard.md``).

What counts as a read (``attr`` is ``"attention_backend"`` unless told):

* ``X.attention_backend`` in a load context, whatever ``X`` is -- a chain, a
  local alias, a call result, a parameter -- and as the target of ``+=``;
* ``getattr(X, NAME[, default])``, ``hasattr(X, NAME)``,
  ``inspect.getattr_static``, ``object.__getattribute__(X, NAME)``,
  ``X.__getattribute__(NAME)``, and any alias of those bound in the file;
* ``operator.attrgetter(NAME)`` (also a dotted path ending in, or passing
  through, the field) and ``operator.itemgetter(NAME)``;
* a mapping view keyed by the field: ``vars(X)[NAME]``, ``X.__dict__[NAME]``,
  ``d[NAME]``, ``d.get(NAME)`` / ``.pop`` / ``.setdefault``, and
  ``NAME in vars(X)`` / ``NAME in X.__dict__``;
* ``match`` patterns ``case C(attention_backend=...)`` and
  ``case {"attention_backend": ...}``.

``NAME`` is the field name as a string constant, or anything the file folds
to it: a name bound to it anywhere in the file (``FIELD = "attention_backend"``,
tuple assignment, walrus, class attribute, ``self.field = ...``), a
concatenation or constant f-string, or a loop variable over a literal
tuple/list/set of strings that contains it.

Not reads: assignment (``X.attention_backend = v``, ``setattr``), ``del``,
keyword arguments (``replace(cfg, attention_backend=v)``), dict-literal keys,
other attribute names (``attention_backends()``, ``prefill_attention_backend``,
``attention_backend_str``), and text in comments, docstrings or other strings.

Only the standard library is imported; nothing checked is ever imported.
"""

from __future__ import annotations

from .analysis import ALLOW_COMMENT, DEFAULT_ATTR, Finding, ParseProblem, default_reason
from .files import (
    AllowEntry, GuardError, GuardReport, assert_no_base_field_reads, check, find_base_field_reads, parse_allow,
)

__all__ = [
    "ALLOW_COMMENT",
    "DEFAULT_ATTR",
    "AllowEntry",
    "Finding",
    "GuardError",
    "GuardReport",
    "ParseProblem",
    "assert_no_base_field_reads",
    "check",
    "default_reason",
    "find_base_field_reads",
    "parse_allow",
]
