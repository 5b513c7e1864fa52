"""scripts/venv_cache.sh, which .ci/run uses: a venv copied from the cache is itself once activated (scripts/phase1.sh
sources .venv/bin/activate)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_a_venv_copied_from_the_cache_activates_as_the_copy(tmp_path):
    copy, cache = tmp_path / "copy", tmp_path / "cache"
    script = f"""
set -euo pipefail
. "{REPO}/scripts/venv_cache.sh"
build() {{ :; }}
venv_from_cache "{sys.executable}" "{copy}" "{cache}" testkey build
. "{copy}/bin/activate"
python -c "import sys; print(sys.prefix)"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # the venv was built as cache/building-PID, then renamed: its activate must name the copy, not that folder
    prefix = out.stdout.strip().splitlines()[-1]
    assert os.path.realpath(prefix) == os.path.realpath(copy), out.stdout
