"""Print CHANGELOG.md's section of one version: the notes of its GitHub release (.github/workflows/release.yml).

    python3 scripts/changelog_section.py 0.2.0

A version without a section ("## 0.2.0 (date)") is one line on stderr and exit status 1: no release without notes.
Python's standard library only: the release job runs it with the runner's python3, nothing installed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


def section(text: str, version: str) -> str | None:
    """The lines under "## VERSION ..." up to the next "## " heading, stripped; None without such a heading."""
    m = re.search(rf"^## {re.escape(version)}( [^\n]*)?\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return m.group(2).strip() if m else None


if __name__ == "__main__":
    version = sys.argv[1]
    notes = section(CHANGELOG.read_text(), version)
    if not notes:
        sys.exit(f"error: {CHANGELOG} has no section '## {version} (date)': add one before releasing v{version}")
    print(notes)
