"""A code corpus from local Python sources, written to parquet (one document per .py file, column `text`): the
stand-in for the seeds' github-code that benchmarks/recipes.py's BPE proxy trains on.

    python benchmarks/code_corpus.py --out /tmp/code --mb 80 [ROOT ...]

Without roots: this Python's standard library, then the site-packages of the running environment, in sorted
order, until --mb megabytes of source; files over 1 MB are skipped. Rows are written in groups of ~1,000 files.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def sources(roots: list[Path]):
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            try:
                if path.is_file() and path.stat().st_size <= 1 << 20:
                    yield path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, type=Path, help="folder for the parquet files")
    ap.add_argument("--mb", type=float, default=80.0, help="megabytes of source to write")
    ap.add_argument("roots", nargs="*", type=Path)
    args = ap.parse_args()
    roots = args.roots or [
        Path(sysconfig.get_paths()["stdlib"]),
        Path(sysconfig.get_paths()["purelib"]),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    batch, total, part = [], 0, 0
    for text in sources(roots):
        batch.append(text)
        total += len(text.encode())
        if len(batch) == 1000 or total >= args.mb * 1e6:
            pq.write_table(pa.table({"text": batch}), args.out / f"part-{part:04d}.parquet")
            batch, part = [], part + 1
        if total >= args.mb * 1e6:
            break
    if batch:
        pq.write_table(pa.table({"text": batch}), args.out / f"part-{part:04d}.parquet")
    print(
        f"{total / 1e6:.1f} MB of Python source from {', '.join(map(str, roots))} -> {args.out} ({part + 1} files)"
    )


if __name__ == "__main__":
    main()
