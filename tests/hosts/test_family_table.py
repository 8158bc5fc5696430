"""The family table in docs/hosts.md is what the code does today: regenerated and compared.

Every causal-LM config class transformers ships is built tiny offline and served on torch_native
(``family_table.py`` says how each is classified); no entry may fail at a forward, and the table in the
docs must be the one this run generates (``python tests/hosts/family_table.py --write`` rewrites it).
"""

from __future__ import annotations

import family_table


def test_the_family_table_in_the_docs_is_regenerated_identically_and_nothing_fails():
    table = family_table.rows()
    failing = [r.line() for r in table if r.verdict == "fails"]
    assert not failing, "families that fail at a forward:\n" + "\n".join(failing)
    assert sum(r.verdict == "served" for r in table) >= 60
    text = family_table.render(table)
    current = family_table.current_doc_table()
    if text != current:
        import difflib
        diff = "\n".join(difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/hosts.md", "generated",
                                              lineterm="", n=0))
        raise AssertionError("docs/hosts.md's family table is stale; run `python tests/hosts/family_table.py "
                             "--write`:\n" + diff)


def test_categories_cover_every_refusal():
    """Every refusal in the table has a named category (none falls through to 'other')."""
    text = family_table.current_doc_table()
    assert "| refused | other:" not in text
