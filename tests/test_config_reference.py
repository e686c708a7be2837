"""docs/configuration.md's DeepSpeed key reference is the table's: a key in one and not the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

from zeroray.config.deepspeed import TABLE
from zeroray.config.reference import BEGIN, END, reference_markdown

README = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _readme_block() -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "docs/configuration.md lost its generated DeepSpeed key reference"
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def test_readme_reference_is_the_generated_one():
    # Regenerate with: python -m zeroray.config.reference, and paste between the markers.
    assert _readme_block() == reference_markdown()


def test_every_table_key_is_in_the_readme_and_no_other():
    block = _readme_block()
    named = set(re.findall(r"`([a-z0-9_]+(?:\.[a-z0-9_]+)*)`", block))
    keys = set(TABLE)
    assert keys - named == set()
    # Backticked names that are not keys are ZeroConfig fields, aliases and values only.
    fields = {p for e in TABLE.values() for p in getattr(e, "paths", ())}
    assert named - keys - fields <= {"bfloat16", "bf16", "enabled", "zeroray", "lr", "betas", "eps", "weight_decay",
                                      "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "null"}
