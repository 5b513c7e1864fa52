"""Streaming tokenize through a URL at 2 GB: throughput vs raw `encode_batch_fast`, flat memory,
kill -9 and resume.

    python benchmarks/hub_tokenize_bench.py [--gb 2.0] [--file-mb 200] [--kills 3] [--seed 0]
                                            [--work benchmarks/work/hub] [--shard-tokens 20000000]

1. Builds (once, cached in --work) a github-code-like parquet corpus of --gb GB of text in files of
   --file-mb MB: Python standard library sources, each pass over them recombined (every file's lines
   rotated at a seeded point) so no document repeats exactly; columns code, repo_name, path, ...
2. Trains a 32,768-id byte-level BPE on 100 MB of it (train_texts' sample).
3. `python -m gptlib tokenize --input file:///.../corpus --tokenizer-from ...` in a child process,
   the whole corpus served through a file:// URL (the fsspec path that hf:// takes): wall time from
   process start to exit, peak RSS (VmHWM) of the child.
4. Raw `encode_batch_fast` of the same tokenizer on the very pieces the pipeline encodes (documents
   cut at PIECE_CHARS, batches of BATCH_CHARS), read ahead batch by batch; only the library call is
   timed. The ratio (4) / (3) is the pipeline's efficiency (target >= 0.85).
5. Peak RSS of the same command on the first file only (--file-mb MB): memory must be flat as the
   input grows (both runs fill several shards of --shard-tokens, so both hold full shard buffers).
   The same file through a local path gives byte-identical shards.
6. kill -9 of the same command at --kills random points (seeded), each time re-running it, then
   letting it finish: every shard byte-identical to the uninterrupted run of (3).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_CHILD = (
    "import re, sys\nfrom gptlib.__main__ import main\nrc = main(sys.argv[1:])\n"
    "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
    "print('PEAK_RSS_KB', hwm, file=sys.stderr)\nsys.exit(rc)"
)


def log(msg: str) -> None:
    print(msg, flush=True)


def build_corpus(work: Path, gb: float, file_mb: float) -> list[Path]:
    """Recombined standard library sources as parquet files of ~file_mb MB of text each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = work / "corpus"
    done = out / "DONE.json"
    want = {"gb": gb, "file_mb": file_mb, "version": 1}
    if (
        done.is_file()
        and {k: v for k, v in json.loads(done.read_text()).items() if k in want} == want
    ):
        return sorted(out.glob("*.parquet"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if p.is_file())
    texts = []
    for p in files:
        try:
            texts.append((str(p.relative_to(p.anchor)), p.read_bytes().decode("utf-8", "replace")))
        except OSError:
            continue
    rng = random.Random(1234)
    total, target, per_file, n_files, rep = 0, gb * 1e9, file_mb * 1e6, 0, 0
    rows: dict[str, list] = {
        k: [] for k in ("code", "repo_name", "path", "language", "license", "size")
    }
    in_file = 0
    while total < target:
        for path, code in texts:
            lines = code.splitlines(keepends=True)
            k = rng.randrange(len(lines)) if rep and lines else 0
            doc = "".join(lines[k:] + lines[:k])
            for col, v in zip(
                rows, (doc, f"python/cpython-{rep}", path, "Python", "psf-2.0", len(doc))
            ):
                rows[col].append(v)
            n = len(doc.encode())
            total += n
            in_file += n
            if in_file >= per_file or total >= target:
                pq.write_table(
                    pa.table(rows),
                    out / f"train-{n_files:05d}.parquet",
                    row_group_size=2000,
                    compression="snappy",
                )
                rows = {k: [] for k in rows}
                n_files += 1
                in_file = 0
            if total >= target:
                break
        rep += 1
    done.write_text(json.dumps(dict(want, text_bytes=total, files=n_files)))
    return sorted(out.glob("*.parquet"))


def start_child(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_child(args: list[str]) -> tuple[float, float, float]:
    """`python -m gptlib ARGS` in a child: wall seconds, its peak RSS in MB, its CPU seconds (user + system,
    all threads: on a machine shared with other jobs this moves far less than the wall time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = start_child(args)
    out, err = p.communicate()
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"command failed ({p.returncode}): gptlib {' '.join(args)}\n{out}\n{err}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, int(err.rsplit("PEAK_RSS_KB", 1)[1].split()[0]) / 1024, cpu


def shard_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.bin"))}


def raw_encode_seconds(paths: list[Path], tk, batch_chars: int) -> tuple[float, float, int]:
    """encode_batch_fast on the pipeline's pieces, batch by batch; only the library call is timed:
    (wall seconds, CPU seconds of all threads, tokens)."""
    import pyarrow.parquet as pq

    from gptlib.data.sources import split_text

    spent, cpu, n_tokens, batch, n = 0.0, 0.0, 0, [], 0

    def run(b):
        nonlocal spent, cpu, n_tokens
        t, c = time.perf_counter(), time.process_time()
        enc = tk.encode_batch_fast(b, add_special_tokens=False)
        spent += time.perf_counter() - t
        cpu += time.process_time() - c
        n_tokens += sum(len(e.ids) for e in enc)

    for p in paths:
        for rb in pq.ParquetFile(p).iter_batches(batch_size=1024, columns=["code"]):
            for doc in rb.column(0).to_pylist():
                for piece, _ in split_text(doc or ""):
                    batch.append(piece)
                    n += len(piece)
                    if n >= batch_chars:
                        run(batch)
                        batch, n = [], 0
    if batch:
        run(batch)
    return spent, cpu, n_tokens


def kill_and_resume(
    args: list[str], out: Path, kills: int, full_wall: float, seed: int
) -> list[str]:
    """SIGKILL the command at `kills` random points, re-running it each time, then let it finish."""
    rng = random.Random(seed)
    notes = []
    shutil.rmtree(out, ignore_errors=True)
    for i in range(kills):
        delay = rng.uniform(0.08, 0.30) * full_wall
        p = start_child(args)
        time.sleep(delay)
        if p.poll() is not None:
            raise SystemExit(f"kill {i + 1}: the run finished before the kill at {delay:.0f}s")
        p.send_signal(signal.SIGKILL)
        p.communicate()
        state = json.loads((out / "prepare_state.json").read_text())
        notes.append(
            f"kill {i + 1}: SIGKILL after {delay:.1f}s of this attempt; state lists "
            f"{len(state['shards']['train'])} train / {len(state['shards']['val'])} val shards, "
            f"{state['emitted']['train'] + state['emitted']['val']:,} tokens, input at file "
            f"{state['resume']['file']} row {state['resume']['doc']}"
        )
        log(notes[-1])
    wall, _, _ = run_child(args)
    notes.append(f"final run (resumed) to the end: {wall:.1f}s")
    log(notes[-1])
    return notes


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    import pyarrow
    import tokenizers

    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GB RAM, load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; python {platform.python_version()}, "
        f"tokenizers {tokenizers.__version__}, pyarrow {pyarrow.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gb", type=float, default=2.0, help="corpus size in GB of text")
    ap.add_argument(
        "--file-mb",
        type=float,
        default=200.0,
        help="text per parquet file (and the small run's size)",
    )
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="chooses the kill points")
    ap.add_argument("--shard-tokens", type=int, default=20_000_000)
    ap.add_argument("--work", default=str(REPO / "benchmarks" / "work" / "hub"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout
    log(f"# command: python benchmarks/hub_tokenize_bench.py {' '.join(sys.argv[1:])}".rstrip())
    log(f"# date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  commit: {commit.strip()}")
    log(f"# machine: {machine()}")

    from gptlib.data.encode import BATCH_CHARS
    from gptlib.data.inputs import source
    from gptlib.data.sources import train_texts
    from gptlib.data.tokenizer import BPETokenizer, load_tokenizer

    t = time.perf_counter()
    paths = build_corpus(work, args.gb, args.file_mb)
    info = json.loads((work / "corpus" / "DONE.json").read_text())
    disk = sum(p.stat().st_size for p in paths)
    log(
        f"corpus: {len(paths)} parquet files, {info['text_bytes'] / 1e9:.2f} GB of text ({disk / 1e9:.2f} GB on disk), "
        f"built/checked in {time.perf_counter() - t:.0f}s"
    )

    tok_file = work / "tokenizer_32768.json"
    if not tok_file.is_file():
        sources = [source(p) for p in paths]
        t = time.perf_counter()
        tok = BPETokenizer.train(train_texts(sources, "code", 100_000_000, []), vocab_size=32768)
        tok_file.write_bytes(tok.to_json_bytes())
        log(
            f"tokenizer: 32,768-id BPE trained on a 100 MB sample in {time.perf_counter() - t:.0f}s"
        )
    tk = load_tokenizer(tok_file)._tk

    common = [
        "--tokenizer-from",
        str(tok_file),
        "--text-column",
        "code",
        "--shard-tokens",
        str(args.shard_tokens),
        "--quiet",
    ]
    url = (work / "corpus").resolve().as_uri() + "/*.parquet"  # not DONE.json beside them
    full = work / "data_url"
    shutil.rmtree(full, ignore_errors=True)
    cmd = ["tokenize", "--input", url, *common, "--out", str(full)]
    log(f"pipeline: python -m gptlib {' '.join(cmd)}")
    wall, rss_full, cpu_full = run_child(cmd)
    m = json.loads((full / "meta.json").read_text())
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    text_mb = info["text_bytes"] / 1e6
    log(
        f"pipeline: {wall:.1f}s wall = {text_mb / wall:.2f} MB/s of text, {tokens / wall:,.0f} tokens/s; "
        f"{m['documents']:,} documents, {tokens:,} tokens, {len(m['splits']['train']['shards'])}+"
        f"{len(m['splits']['val']['shards'])} shards; peak RSS {rss_full:.0f} MB; CPU {cpu_full:.1f}s "
        f"(load average now {os.getloadavg()[0]:.2f})"
    )

    raw, raw_cpu, raw_tokens = raw_encode_seconds(paths, tk, BATCH_CHARS)
    log(
        f"raw encode_batch_fast, the pipeline's pieces: {raw:.1f}s = {text_mb / raw:.2f} MB/s, CPU {raw_cpu:.1f}s "
        f"({raw_tokens:,} tokens without the end-of-text ids; load average now {os.getloadavg()[0]:.2f})"
    )
    log(
        f"RATIO pipeline / raw encode_batch_fast on the same pieces: {raw / wall:.1%} by wall time (target >= 85%), "
        f"{raw_cpu / cpu_full:.1%} by CPU time"
    )

    small = work / "data_small_url"
    shutil.rmtree(small, ignore_errors=True)
    wall_s, rss_small, _ = run_child(
        ["tokenize", "--input", paths[0].resolve().as_uri(), *common, "--out", str(small)]
    )
    ms = json.loads((small / "meta.json").read_text())
    log(
        f"small run: {paths[0].name} ({args.file_mb:.0f} MB of text) through file://: {wall_s:.1f}s, "
        f"{len(ms['splits']['train']['shards'])}+{len(ms['splits']['val']['shards'])} shards; peak RSS "
        f"{rss_small:.0f} MB"
    )
    log(
        f"RSS peak {rss_small:.0f} MB at {args.file_mb:.0f} MB vs {rss_full:.0f} MB at {text_mb / 1e3:.1f} GB "
        f"(difference {rss_full - rss_small:+.0f} MB; target < 1024 MB and flat)"
    )
    local = work / "data_small_local"
    shutil.rmtree(local, ignore_errors=True)
    run_child(["tokenize", "--input", str(paths[0]), *common, "--out", str(local)])
    same = shard_hashes(local) == shard_hashes(small)
    log(f"the same file through a local path: shards byte-identical to file://: {same}")

    killed = work / "data_killed"
    notes = kill_and_resume(cmd[:-1] + [str(killed)], killed, args.kills, wall, args.seed)
    a, b = shard_hashes(killed), shard_hashes(full)
    log(
        f"KILL -9 x{args.kills} then resume: {len(a)} shard files, byte-identical to the uninterrupted run: {a == b}"
    )
    del notes
    if not (same and a == b):
        raise SystemExit("MISMATCH")


if __name__ == "__main__":
    main()
