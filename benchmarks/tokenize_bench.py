"""Tokenize benchmark: the streaming pipeline vs raw `encode_batch` of the same tokenizer.

    python benchmarks/tokenize_bench.py [--mb 110] [--work benchmarks/work/tokenize] [--no-single-line]

1. Builds a github-code-like parquet corpus (columns code, repo_name, path, language, license,
   size) from the local Python standard library sources, >= --mb MB of text (cached in --work).
2. Trains the 32K byte-level BPE on all of it (timed).
3. Pre-tokenizes it with `python -m gptlib tokenize --tokenizer-file ...` in a child process:
   wall time (process start to exit, everything included), peak RSS of that process.
4. Times raw `encode_batch_fast` (the call the pipeline makes) of the same tokenizer on the same
   text, preloaded in memory, batches of the pipeline's size (BATCH_CHARS); only the library call
   is timed. Two ways: (a) whole documents, as a hand-written loop would pass them, before the
   pipeline; (b) the very pieces the pipeline encodes (documents cut at <= PIECE_CHARS), after
   it: (b) is the strict measure of what reading, batching and writing cost. Also `encode_batch`
   (with offsets) on whole documents, for reference.
5. Optionally: a 100 MB text file that is one single line, tokenized with the same BPE
   (peak RSS shows a single huge line is handled in pieces).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_corpus(work: Path, target_mb: float, n_files: int = 4) -> list[Path]:
    """Standard library .py files (repeated with a pass number in the path if the stdlib is too
    small) as parquet files shaped like codeparrot/github-code."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = work / "corpus"
    done = out / "DONE.json"
    if done.is_file() and json.loads(done.read_text())["target_mb"] == target_mb:
        return sorted(out.glob("*.parquet"))
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("*.parquet"):
        p.unlink()
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    files = sorted(p for r in roots for p in r.rglob("*.py") if p.is_file())
    rows = {"code": [], "repo_name": [], "path": [], "language": [], "license": [], "size": []}
    total = 0
    target = target_mb * 1e6
    rep = 0
    while total < target:
        for p in files:
            try:
                code = p.read_bytes().decode("utf-8", "replace")
            except OSError:
                continue
            rows["code"].append(code)
            rows["repo_name"].append(f"python/cpython-{rep}")
            rows["path"].append(str(p.relative_to(p.anchor)))
            rows["language"].append("Python")
            rows["license"].append("psf-2.0")
            rows["size"].append(len(code))
            total += len(code.encode())
            if total >= target:
                break
        rep += 1
    table = pa.table(rows)
    per = (table.num_rows + n_files - 1) // n_files
    paths = []
    for i in range(n_files):
        p = out / f"train-{i:05d}-of-{n_files:05d}.parquet"
        pq.write_table(table.slice(i * per, per), p, row_group_size=2000, compression="snappy")
        paths.append(p)
    done.write_text(
        json.dumps({"target_mb": target_mb, "text_bytes": total, "rows": table.num_rows})
    )
    return paths


def read_docs(paths: list[Path]) -> list[str]:
    import pyarrow.parquet as pq

    docs = []
    for p in paths:
        docs.extend(x for x in pq.read_table(p, columns=["code"]).column(0).to_pylist() if x)
    return docs


def batches_of(docs: list[str], chars: int) -> list[list[str]]:
    out, cur, n = [], [], 0
    for d in docs:
        cur.append(d)
        n += len(d)
        if n >= chars:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def time_encode(fn, batches) -> float:
    """Seconds spent in the library call alone (text already in memory, results dropped)."""
    t = time.perf_counter()
    for b in batches:
        fn(b, add_special_tokens=False)
    return time.perf_counter() - t


# Runs `python -m gptlib ARGS` and prints the process's own peak RSS last: VmHWM, the high-water mark of
# its own address space (ru_maxrss would also count the parent's RSS at fork time: Linux keeps it across exec).
_CHILD = (
    "import re, sys\nfrom gptlib.__main__ import main\nrc = main(sys.argv[1:])\n"
    "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
    "print('PEAK_RSS_KB', hwm, file=sys.stderr)\nsys.exit(rc)"
)


def run_child(args: list[str]) -> tuple[float, float, str]:
    """`python -m gptlib ARGS` in a child process: wall seconds, its peak RSS in MB, its output."""
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], cwd=REPO, capture_output=True, text=True
    )
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(
            f"command failed ({r.returncode}): gptlib {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        )
    peak_kb = int(r.stderr.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    return wall, peak_kb / 1024, r.stdout + r.stderr


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--mb", type=float, default=110.0, help="corpus size in MB of text (>= 100 for the figures)"
    )
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "work" / "tokenize"))
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument(
        "--no-single-line", action="store_true", help="skip the 100 MB single-line file"
    )
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    from gptlib.data.encode import BATCH_CHARS
    from gptlib.data.inputs import source
    from gptlib.data.sources import split_text, train_texts
    from gptlib.data.tokenizer import BPETokenizer, load_tokenizer

    t = time.perf_counter()
    paths = build_corpus(work, args.mb)
    text_bytes = json.loads((work / "corpus" / "DONE.json").read_text())["text_bytes"]
    disk = sum(p.stat().st_size for p in paths)
    print(
        f"corpus: {len(paths)} parquet files, {text_bytes / 1e6:.1f} MB of text ({disk / 1e6:.1f} MB on disk), "
        f"built/checked in {time.perf_counter() - t:.1f}s"
    )

    # --- 2. train the tokenizer on the whole corpus (streaming)
    tok_file = work / f"tokenizer_{args.vocab_size}.json"
    sources = [source(p) for p in paths]
    t = time.perf_counter()
    tok = BPETokenizer.train(train_texts(sources, "code", None, []), vocab_size=args.vocab_size)
    train_s = time.perf_counter() - t
    tok_file.write_bytes(tok.to_json_bytes())
    print(
        f"tokenizer: trained {tok.vocab_size:,}-id byte-level BPE on {text_bytes / 1e6:.1f} MB in {train_s:.1f}s "
        f"({text_bytes / 1e6 / train_s:.2f} MB/s)"
    )
    tok = load_tokenizer(tok_file)
    tk = tok._tk

    # --- 4a. raw encode_batch_fast on whole documents, before the pipeline
    docs = read_docs(paths)
    batches = batches_of(docs, BATCH_CHARS)
    raw_docs = time_encode(tk.encode_batch_fast, batches)
    print(
        f"raw encode_batch_fast, whole documents: {raw_docs:.1f}s = {text_bytes / 1e6 / raw_docs:.2f} MB/s"
    )

    # --- 3. the pipeline, in a child process
    out = work / "data"
    # a finished identical dataset would be reused, not redone
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        "tokenize",
        "--input",
        *map(str, paths),
        "--tokenizer-file",
        str(tok_file),
        "--text-column",
        "code",
        "--out",
        str(out),
        "--overwrite",
        "--quiet",
    ]
    wall, rss, log = run_child(cmd)
    m = json.loads((out / "meta.json").read_text())
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    print(f"pipeline: python -m gptlib {' '.join(cmd)}")
    print(
        f"pipeline: {wall:.1f}s wall (process start to exit) = {text_bytes / 1e6 / wall:.2f} MB/s, "
        f"{tokens / wall:,.0f} tokens/s; {m['documents']:,} documents, {tokens:,} tokens "
        f"({m['characters'] / tokens:.2f} chars/token), {m['dtype']}, "
        f"{len(m['splits']['train']['shards'])}+{len(m['splits']['val']['shards'])} shards; peak RSS {rss:.0f} MB"
    )

    # --- 4b. raw on the pipeline's own pieces, and encode_batch (with offsets) for reference
    pieces = [p for d in docs for p, _ in split_text(d)]
    piece_batches = batches_of(pieces, BATCH_CHARS)
    raw_pieces = time_encode(tk.encode_batch_fast, piece_batches)
    print(
        f"raw encode_batch_fast, the pipeline's pieces: {raw_pieces:.1f}s = {text_bytes / 1e6 / raw_pieces:.2f} MB/s"
    )
    raw_std = time_encode(tk.encode_batch, batches)
    print(
        f"raw encode_batch (with offsets), whole documents: {raw_std:.1f}s = {text_bytes / 1e6 / raw_std:.2f} MB/s"
    )
    print(
        f"RATIO pipeline / raw encode_batch_fast on the same pieces: {raw_pieces / wall:.1%} (target >= 85%)"
    )
    print(f"RATIO pipeline / raw encode_batch_fast on whole documents: {raw_docs / wall:.1%}")
    print(
        f"RATIO pipeline / raw encode_batch (with offsets) on whole documents: {raw_std / wall:.1%}"
    )
    del docs, batches, pieces, piece_batches

    # --- 5. one 100 MB line
    if not args.no_single_line:
        line = work / "single_line.txt"
        if not line.is_file() or line.stat().st_size < 100e6:
            with open(line, "w") as f:
                written = 0
                for p in paths:
                    for d in read_docs([p]):
                        s = d.replace("\n", " ")
                        f.write(s)
                        written += len(s)
                        if written >= 100e6:
                            break
                    if written >= 100e6:
                        break
        out1 = work / "data_single_line"
        shutil.rmtree(out1, ignore_errors=True)
        cmd = [
            "tokenize",
            "--input",
            str(line),
            "--tokenizer-file",
            str(tok_file),
            "--out",
            str(out1),
            "--overwrite",
            "--quiet",
        ]
        wall1, rss1, _ = run_child(cmd)
        m1 = json.loads((out1 / "meta.json").read_text())
        t1 = m1["splits"]["train"]["tokens"] + m1["splits"]["val"]["tokens"]
        print(
            f"single line: {line.stat().st_size / 1e6:.0f} MB, no newline: {wall1:.1f}s = "
            f"{line.stat().st_size / 1e6 / wall1:.2f} MB/s, {t1:,} tokens; peak RSS {rss1:.0f} MB"
        )


if __name__ == "__main__":
    main()
