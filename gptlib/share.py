"""push: a run on the Hub in one commit (all or nothing); the token goes to huggingface_hub only, never to a file."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from gptlib.data.hub import http_status
from gptlib.data.shards import META_FILE
from gptlib.errors import ExportError, again
from gptlib.fsutil import read_jsonl
from gptlib.layout import EVAL_FILE, LOSS_PLOT, SAMPLES_FILE, STATE_FILE

TOKEN_HELP = (
    "use a token with write access (https://huggingface.co/settings/tokens): set HF_TOKEN=hf_..., add it "
    "as the Colab secret HF_TOKEN, or log in once with `hf auth login`"
)


def stage(run_dir, out_dir, repo: str, checkpoint, gguf: bool, license: str, hardware: str) -> Path:
    """The commit's files in out_dir (new or empty), written into a temporary sibling renamed at the end."""
    # here (torch): `python -m gptlib tokenize` never imports it
    from gptlib.inference.export import export_model, gguf_arch, remove_leftovers, write_gguf
    from gptlib.inference.loading import load_run

    out, run_dir = Path(out_dir), Path(run_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--dry-run {out} is not empty; choose a new or empty folder")
    ld = load_run(run_dir, checkpoint)
    # Ollama's hf.co/USER/NAME:F16 finds it by its tag
    gguf_file = f"{repo.split('/')[1]}-F16.gguf" if gguf else ""
    if gguf:
        # a run llama.cpp cannot run: refused before anything is written
        gguf_arch(ld.model.config, ld.tokenizer, "push without --gguf (notebook 04: HUB_GGUF off)")
    remove_leftovers(out)
    tmp = out.parent / f".{out.name}.staging-{os.getpid()}"
    try:
        export_model(ld.model, tmp, ld.tokenizer)
        if gguf:
            write_gguf(ld.model, ld.tokenizer, tmp / gguf_file, "f16", name=repo)
        plot = (run_dir / LOSS_PLOT).is_file()
        if plot:
            shutil.copyfile(run_dir / LOSS_PLOT, tmp / LOSS_PLOT)
        card = model_card(ld, run_dir, repo, license, hardware, gguf_file, plot)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_facts(ld, run_dir: Path) -> dict:
    """What the run's files say about a loaded checkpoint: its data sources, its evaluations, three samples."""
    from gptlib.checkpoint.format import model_sha256

    meta_path = Path(ld.state.data_dir) / META_FILE if ld.state.data_dir else None
    meta = json.loads(meta_path.read_text()) if meta_path and meta_path.is_file() else {}
    paths = [s.get("path", "") for s in meta.get("sources", [])]
    sources = [p if "://" in p else Path(p).name for p in paths]
    datasets = sorted(
        {m[1] for s in sources if (m := re.match(r"hf://datasets/([^/@]+/[^/@]+)", s))}
    )
    # per task, this step's fullest evaluation: canonical data first, then the most items or windows (a quick --limit
    # run after a full one must not stand for it); the newest among equals
    evals: dict[str, dict] = {}
    # only this checkpoint's rows: eval.jsonl outlives a run trained again in its directory. A row without model_sha256
    # (gptlib 0.2's, training's end-of-run HellaSwag too) counts only while no row at the step names another model
    sha = model_sha256(ld.path)
    rows = [r for r in read_jsonl(run_dir / EVAL_FILE) if r.get("step") == ld.step]
    ours = {sha} if any(r.get("model_sha256") not in (None, sha) for r in rows) else {sha, None}
    for r in (r for r in rows if r.get("model_sha256") in ours):
        old = evals.get(r["task"])
        if old is None or _fullest(r) >= _fullest(old):
            evals[r["task"]] = r
    samples = [r for r in read_jsonl(run_dir / SAMPLES_FILE) if r.get("step", 0) <= ld.step]
    steps = sorted({r["step"] for r in samples})
    # the first, middle and last
    shown = {steps[0], steps[len(steps) // 2], steps[-1]} if steps else set()
    data = ", ".join(sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
    return {
        "datasets": datasets,
        "data": data or Path(ld.state.data_dir).name or "not recorded",
        "evals": evals,
        "samples": [r for r in samples if r["step"] in shown],
    }


def _fullest(row: dict) -> tuple[bool, int]:
    return row.get("canonical", True), row.get("n", 0)


def card_metadata(ld, f: dict, name: str, arch: str, license: str, gguf_file: str):
    """The card's YAML header: what the Hub lists the model under, and the scores its model-index shows
    (validation loss, bits per byte, HellaSwag acc_norm), each only where measured."""
    from huggingface_hub import EvalResult, ModelCardData

    st, bpb, hs = ld.state, f["evals"].get("bpb"), f["evals"].get("hellaswag")
    data = f["datasets"][0] if f["datasets"] else Path(st.data_dir or "data").name
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=data,
            dataset_name=f"{data} (validation split)",
            metric_type=kind,
            metric_name=what,
            metric_value=round(v, 4),
        )
        for kind, what, v in (
            ("loss", "validation loss (nats/token)", st.val_loss),
            ("bpb", "bits per byte", bpb["bpb"] if bpb else None),
        )
        if v is not None
    ]
    # the model-index says "HellaSwag validation": only a score on the canonical file is that
    if hs and hs.get("canonical") is True:
        results.append(
            EvalResult(
                task_type="text-generation",
                dataset_type="Rowan/hellaswag",
                dataset_name="HellaSwag",
                dataset_split="validation",
                metric_type="acc_norm",
                metric_value=round(hs["acc_norm"], 4),
            )
        )
    return ModelCardData(
        base_model=origin(st)[1],
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["gptlib", arch] + (["gguf"] if gguf_file else []),
        datasets=f["datasets"] or None,
        model_name=name,
        eval_results=results or None,
    )


def origin(st) -> tuple[str, str | None]:
    """How the weights began: "trained from scratch", or what they were fine-tuned or imported from (following the
    runs' records back while their checkpoints are here), and the Hub model at the start of that chain (base_model)."""
    init, said, hub = st.init_from, [], None
    while init and len(said) < 10:
        if "model" in init:  # import-hf: a Hub id or a local folder
            hub = init["model"] if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", init["model"]) else None
            said.append(f"imported from {init['model']}")
            break
        said.append(f"fine-tuned from the run {Path(init['run']).name} (step {init['step']:,})")
        base = Path(init["path"]) / STATE_FILE
        try:
            init = json.loads(base.read_text()).get("init_from")
        except (OSError, ValueError):
            break
    return ", ".join(said) or "trained from scratch", hub


def _score(row: dict, field: str) -> str:
    """The score, with its standard error where eval.jsonl has one (gptlib 0.3.0 on): a reader of the card can tell
    two models apart only when their scores differ by more than about twice their combined standard errors."""
    se, score = row.get(f"{field}_se"), f"{row[field]:.4f}"
    return score if se is None else f"{score} ± {se:.4f} (standard error)"


def model_card(
    ld, run_dir: Path, repo: str, license: str, hardware: str, gguf_file: str, plot: bool
) -> str:
    """README.md: the Hub's metadata header with the scores, then what the model is, how it did, how to run it."""
    from huggingface_hub import ModelCard

    from gptlib.inference.export import CLASSES, native_arch
    from gptlib.model import model_size

    cfg, st, f, name = ld.config, ld.state, run_facts(ld, run_dir), repo.split("/")[1]
    m, arch = cfg.model, native_arch(cfg.model)
    bpb, hs = f["evals"].get("bpb"), f["evals"].get("hellaswag")
    header = card_metadata(ld, f, name, arch, license, gguf_file)
    val = (
        f"{st.val_loss:.4f} nats/token" if st.val_loss is not None else "not measured at this step"
    )
    hours = (
        f"{st.elapsed_s / 3600:.1f} h" if st.elapsed_s >= 3600 else f"{st.elapsed_s / 60:.1f} min"
    )
    bits = "not run (python -m gptlib eval --task bpb)"
    if bpb:
        bits = f"{_score(bpb, 'bpb')} over {bpb['windows']:,} windows"
    acc = f"{_score(hs, 'acc_norm')} on {hs['n']:,} items" if hs else "not run"
    if hs and hs.get("canonical") is not True:
        acc += f" of {Path(hs.get('data', '')).name or 'a local file'}, not the canonical validation set"
    gguf_use = f"llama.cpp: `llama-cli -hf {repo}`; Ollama: `ollama run hf.co/{repo}:F16`; LM Studio: search {repo}"
    lines = [
        f"# {name}",
        "",
        f"A {model_size(m).params / 1e6:.1f}M-parameter GPT {origin(st)[0]} with "
        f"[gptlib](https://github.com/gptlib/gptlib), exported as a native `{CLASSES[arch]}`.",
        "",
        "## Model",
        "",
        f"- architecture: {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide, context {m.block_size} tokens, "
        f"vocabulary {m.vocab_size} ({ld.tokenizer.kind} tokenizer)",
        f"- recipe: {cfg.recipe} (preset {cfg.preset}): {m.positions} positions, {m.norm}, {m.mlp}"
        f"{', QK-norm' if m.qk_norm else ''}; {cfg.train.optimizer}, {cfg.train.schedule} schedule, peak learning "
        f"rate {cfg.train.learning_rate:g}",
        f"- data: {f['data']}; {st.data.get('train_tokens', 0):,} training tokens",
        f"- training: step {st.step:,}, {st.tokens_seen:,} tokens seen in {hours}, on "
        f"{hardware or 'hardware the run does not record'}",
        "",
        "## Evaluation",
        "",
        f"- validation loss: {val}",
        f"- bits per byte: {bits}",
        f"- HellaSwag acc_norm: {acc} (GPT-2 124M: 0.2955, chance: 0.25)",
        "",
        *(["## Loss curve", "", f"![loss curve]({LOSS_PLOT})", ""] if plot else []),
        "## Samples during training",
        "",
        *[f"step {r['step']:,}:\n```\n{r['text'][:400]}\n```\n" for r in f["samples"]],
        "## Use it",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("{repo}")',
        f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
        "```",
        "",
        *([gguf_use, ""] if gguf_file else []),
        f"gptlib: `python -m gptlib import-hf --model {repo} --out runs/{name}`, then sample, chat, eval or fine-tune.",
        "",
    ]
    return str(ModelCard(f"---\n{header.to_yaml()}\n---\n\n" + "\n".join(lines)))


def hub_error(e: Exception, repo: str) -> ExportError:
    status = http_status(e)
    if status == 401:
        msg = f"the Hub refused the token (HTTP 401: invalid or expired); {TOKEN_HELP}"
    elif status == 403:
        msg = f"the Hub refused to write {repo} (HTTP 403): not yours, or a read-only token; {TOKEN_HELP}"
    else:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        msg = (
            f"pushing {repo} failed ({type(e).__name__}: {first}); nothing was committed (a Hub commit is "
            f"all or nothing): {again()} to finish it"
        )
    return ExportError(msg)


def push(
    run_dir,
    repo: str,
    checkpoint="best",
    private: bool = False,
    gguf: bool = False,
    dry_run=None,
    license: str = "apache-2.0",
    hardware: str = "",
) -> str:
    """One commit to `repo` (USER/NAME, created if missing) -> its URL; dry_run: write the files there instead."""
    import huggingface_hub as hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        # "" fails: a model id without its USER/ is refused
        validate_repo_id(repo if repo.count("/") == 1 else "")
    except HFValidationError:
        msg = f"--repo {repo!r} is not a Hub model id: give USER/NAME (letters, digits, '-', '_', '.')"
        raise ExportError(msg) from None
    if dry_run is not None:
        return str(stage(run_dir, dry_run, repo, checkpoint, gguf, license, hardware))
    token = hub.get_token()
    if not token:
        raise ExportError(f"no Hugging Face token to push {repo} with: {TOKEN_HELP}")
    api = hub.HfApi(token=token)
    try:
        me = api.whoami()
    except Exception as e:  # noqa: BLE001 - huggingface_hub's and the network's errors, in one line
        raise hub_error(e, repo) from None
    owner, name = repo.split("/")
    if owner not in {me["name"], *(o["name"] for o in me.get("orgs", []))}:
        raise ExportError(
            f"{repo} belongs to someone else: the token is {me['name']}'s; push to {me['name']}/{name}"
        )
    message = f"gptlib push: {Path(run_dir).name} checkpoint {checkpoint}"
    with tempfile.TemporaryDirectory(prefix="gptlib-push-") as tmp:
        folder = stage(run_dir, Path(tmp) / "repo", repo, checkpoint, gguf, license, hardware)
        ops = [hub.CommitOperationAdd(p.name, str(p)) for p in sorted(folder.iterdir())]
        try:
            url = api.create_repo(repo, private=private, exist_ok=True)
            api.create_commit(repo, ops, commit_message=message)
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, repo) from None
    return str(url)
