"""The key table of docs/migrating-from-verl.md, rendered from :mod:`tandem.verl.keys`.

``python -m tandem.verl.key_table`` prints it; a test checks the docs hold exactly this text.
"""

from __future__ import annotations

from tandem.verl.keys import MISSING, RULES, Rule


def _cell(rule: Rule) -> str:
    if rule.kind == "noted":
        return f"accepted, note: {rule.note}"
    if rule.kind == "required value":
        allowed = " or ".join(f"`{v}`" for v in rule.only)
        return f"only {allowed}; anything else is an error (tandem lacks {rule.why})"
    key, _, rest = rule.to.partition(" ")
    target = f"`{key}` {rest}".rstrip() if "." in key else rule.to
    return f"{target} (read with related keys)" if rule.kind == "joint" else target


def key_table_markdown() -> str:
    """One row per verl key: its default, and what it becomes in tandem."""
    rows = ["| verl key | verl default | tandem |", "|---|---|---|"]
    for rule in RULES:
        default = "" if rule.default is MISSING else f"`{rule.default}`"
        rows.append(f"| `{rule.key}` | {default} | {_cell(rule)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(key_table_markdown(), end="")
