"""push: one commit to the Hugging Face Hub with the transformers export, the GGUF file, the loss curve and a model
card built from the run. The Hub is a recording HfApi (huggingface_hub's own class, its network methods answered
here after their arguments are bound to the real signatures); the files, the card (parsed by
huggingface_hub.ModelCard), the token's sources (HF_TOKEN, Colab's secret through a fake google.colab, a saved
login) and the refusals are the real code's. --dry-run DIR is the commit's files: the push must upload exactly them.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest

from gptlib.__main__ import main
from tests.conftest import TINY
from tests.fakes import _hub_error
from tests.gguf_kit import bpe_data, bpe_run, tree_digest

hub = pytest.importorskip("huggingface_hub")
TOKEN = "hf_SecretTokenThatMustNeverBeWritten"


class RecordingHub:
    """What the Hub saw: the tokens, repositories created and commits ({path in repo: bytes}); `fail` maps a
    method name to an exception it raises once."""

    def __init__(self, user="alice", orgs=()):
        self.user, self.orgs, self.fail = user, list(orgs), {}
        self.tokens, self.repos, self.commits = [], {}, []

    def api(self):
        rec, real = self, hub.HfApi

        def answered(name, *args, **kw):
            # a call the real HfApi accepts
            inspect.signature(getattr(real, name)).bind(None, *args, **kw)
            if name in rec.fail:
                raise rec.fail.pop(name)

        class Api(real):
            def __init__(self, *args, **kw):
                super().__init__(*args, **kw)
                rec.tokens.append(kw.get("token"))

            def whoami(self, *args, **kw):
                answered("whoami", *args, **kw)
                return {"name": rec.user, "orgs": [{"name": o} for o in rec.orgs]}

            def create_repo(self, *args, **kw):
                answered("create_repo", *args, **kw)
                repo = args[0] if args else kw["repo_id"]
                rec.repos.setdefault(repo, {"private": kw.get("private")})
                return hub.RepoUrl(f"https://huggingface.co/{repo}")

            def create_commit(self, *args, **kw):
                answered("create_commit", *args, **kw)
                repo, ops = args[:2]
                files = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in ops}
                rec.commits.append({"repo": repo, "message": kw["commit_message"], "files": files})

        return Api


@pytest.fixture
def recording(monkeypatch, tmp_path):
    rec = RecordingHub(orgs=["alices-lab"])
    monkeypatch.setattr(hub, "HfApi", rec.api())
    monkeypatch.setattr(hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return rec


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_text):
    """A BPE gpt2 run, validated at its last step, with bits per byte and HellaSwag evaluated."""
    from gptlib.evaluation.evaluate import evaluate_run
    from tests.test_evaluate import shakespeare_items, write_jsonl

    root = tmp_path_factory.mktemp("push")
    run = bpe_run(bpe_data(small_text, root / "data"), root / "run", steps=4)
    write_jsonl(root / "hs.jsonl", shakespeare_items(small_text.read_text(), 8))
    evaluate_run(run, "bpb", limit=4, device="cpu", progress=False)
    evaluate_run(run, "hellaswag", data=root / "hs.jsonl", device="cpu", progress=False)
    return run


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_push_is_one_commit_of_the_dry_run_files_with_a_card_the_hub_parses(
    run, recording, tmp_path, capsys
):
    before = tree_digest(run)
    dry = tmp_path / "dry"
    rc, out, err = cli(
        capsys,
        "push",
        "--run-dir",
        run,
        "--repo",
        "alice/tiny-gpt",
        "--gguf",
        "--dry-run",
        dry,
        "--hardware",
        "2-core CPU",
    )
    assert rc == 0 and f"wrote the commit files to {dry}" in out
    assert recording.tokens == [] and recording.commits == []  # a dry run never reaches the Hub
    files = {p.name: p.read_bytes() for p in dry.iterdir()}
    assert set(files) == {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "loss.png",
        "tiny-gpt-F16.gguf",
    }

    rc, out, err = cli(
        capsys,
        "push",
        "--run-dir",
        run,
        "--repo",
        "alice/tiny-gpt",
        "--gguf",
        "--private",
        "--hardware",
        "2-core CPU",
    )
    assert (rc, err) == (0, "") and "pushed to https://huggingface.co/alice/tiny-gpt" in out
    (commit,) = recording.commits
    # exactly the dry run's bytes
    assert commit["repo"] == "alice/tiny-gpt" and commit["files"] == files
    assert recording.repos == {"alice/tiny-gpt": {"private": True}} and set(recording.tokens) == {
        TOKEN
    }
    assert not any(TOKEN.encode() in b for b in files.values()) and TOKEN not in out + err
    assert tree_digest(run) == before

    card = hub.ModelCard.load(dry / "README.md")
    d = card.data
    assert (d.license, d.library_name, d.pipeline_tag) == (
        "apache-2.0",
        "transformers",
        "text-generation",
    )
    assert "gguf" in d.tags and "gpt2" in d.tags and d.model_name == "tiny-gpt"
    found = {(r.metric_type, r.dataset_name): r.metric_value for r in d.eval_results}
    from gptlib.fsutil import read_jsonl
    from gptlib.inference.loading import load_run

    evals = {r["task"]: r for r in read_jsonl(run / "eval.jsonl")}
    assert found["loss", "data (validation split)"] == round(
        load_run(run, "best").state.val_loss, 4
    )
    assert found["bpb", "data (validation split)"] == round(evals["bpb"]["bpb"], 4)
    # a score on a local HellaSwag-shaped file is not "HellaSwag validation" in the model-index: the text says what
    assert ("acc_norm", "HellaSwag") not in found and not evals["hellaswag"]["canonical"]
    text = card.text
    assert "GPT trained from scratch with" in text
    for part in (
        "2 layers, 2 heads, 64 wide",
        "recipe: gpt2",
        "4,096 tokens seen",
        "2-core CPU",
        f"bits per byte: {evals['bpb']['bpb']:.4f} ± {evals['bpb']['bpb_se']:.4f} (standard error) over 4 windows",
        f"acc_norm: {evals['hellaswag']['acc_norm']:.4f} ± {evals['hellaswag']['acc_norm_se']:.4f} (standard "
        "error) on 8 items of hs.jsonl, not the canonical validation set",
        "![loss curve](loss.png)",
        "step 4:",
        "AutoModelForCausalLM.from_pretrained",
        "ollama run hf.co/alice/tiny-gpt:F16",
        "gptlib import-hf --model alice/tiny-gpt",
    ):
        assert part in text, part


def test_the_card_gives_the_fullest_scores_and_where_the_weights_came_from(
    run, tmp_path, monkeypatch
):
    """A quick `eval --limit` after a full one: the card keeps the full one (it took the last row). The canonical
    HellaSwag file's score is in the model-index as HellaSwag validation. A fine-tune of an imported model says so,
    with the Hub model as base_model (it said "trained from scratch")."""
    import json
    import shutil

    from gptlib.inference.loading import load_run
    from gptlib.share import model_card

    r = tmp_path / "run"
    shutil.copytree(run, r)
    rows = [json.loads(x) for x in (r / "eval.jsonl").read_text().splitlines()]
    full = {x["task"]: x for x in rows}
    quick = [{**full["bpb"], "bpb": 9.0, "n": 1, "windows": 1}]
    canonical = [{**full["hellaswag"], "canonical": True, "n": 10042, "acc_norm": 0.31}]
    lines = rows + canonical + quick + [{**canonical[0], "n": 20, "acc_norm": 0.5}]
    (r / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ld = load_run(r)
    base = tmp_path / "base_state"
    base.mkdir()
    (base / "state.json").write_text(json.dumps({"init_from": {"model": "openai-community/gpt2"}}))
    ld.state.init_from = {"run": "/content/runs/gpt2-base", "path": str(base), "step": 0}
    card = hub.ModelCard(model_card(ld, r, "alice/chat", "mit", "", "", False))
    found = {(e.metric_type, e.dataset_name): e.metric_value for e in card.data.eval_results}
    assert found["bpb", "data (validation split)"] == round(full["bpb"]["bpb"], 4)
    assert found["acc_norm", "HellaSwag"] == 0.31 and "on 10,042 items (GPT-2" in card.text
    assert card.data.base_model == "openai-community/gpt2"
    assert (
        "GPT fine-tuned from the run gpt2-base (step 0), imported from openai-community/gpt2 with"
        in card.text
    )


def test_the_token_comes_from_a_saved_login(run, recording, tmp_path, monkeypatch, capsys):
    """Without HF_TOKEN, huggingface_hub's own get_token (a saved login; on Colab also the HF_TOKEN secret)."""
    monkeypatch.delenv("HF_TOKEN")
    saved = tmp_path / "token"  # where `hf auth login` (huggingface_hub.login) keeps it
    saved.write_text("hf_saved_login")
    monkeypatch.setattr(hub.constants, "HF_TOKEN_PATH", str(saved))
    assert cli(capsys, "push", "--run-dir", run, "--repo", "alice/tiny")[0] == 0
    assert recording.tokens == ["hf_saved_login"] and len(recording.commits) == 1


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, char_data):
    from gptlib.training.loop import train

    run = tmp_path_factory.mktemp("char") / "run"
    train(char_data, run, overrides=TINY, max_steps=2, progress=False, log=lambda s: None)
    return run


def test_bad_input_is_one_line_and_changes_nothing(
    run, char_run, recording, tmp_path, monkeypatch, capsys
):
    no_ckpt = tmp_path / "no-checkpoint"
    shutil.copytree(run, no_ckpt, ignore=shutil.ignore_patterns("checkpoints"))
    taken = tmp_path / "taken"
    (taken / "x").mkdir(parents=True)
    push = ("push", "--run-dir", run, "--repo")
    cases = [  # (arguments, what the Hub does, a part of the one line)
        ((*push, "not a repo id"), {}, "is not a Hub model id"),
        ((*push, "alice/x/y"), {}, "is not a Hub model id"),
        (
            (*push, "bob/tiny"),
            {},
            "bob/tiny belongs to someone else: the token is alice's; push to alice/tiny",
        ),
        (
            (*push, "alice/tiny"),
            {"whoami": _hub_error("HfHubHTTPError", "https://hf.co/api/whoami-v2", 401)},
            "the Hub refused the token (HTTP 401",
        ),
        (
            (*push, "alices-lab/tiny"),
            {"create_commit": _hub_error("HfHubHTTPError", "https://hf.co/api/x", 403)},
            "the Hub refused to write alices-lab/tiny (HTTP 403)",
        ),
        (
            (*push, "alice/tiny"),
            {"create_commit": ConnectionResetError("Connection reset by peer")},
            "nothing was committed (a Hub commit is all or nothing): run the same command again",
        ),
        (("push", "--run-dir", no_ckpt, "--repo", "alice/tiny"), {}, "no-checkpoint"),
        (  # notebook 04's HUB_GGUF is on by default, and notebook 02's run is a char run
            ("push", "--run-dir", char_run, "--repo", "alice/tiny", "--gguf"),
            {},
            "char tokenizer; llama.cpp's tokenizers are subword ones: push without --gguf "
            "(notebook 04: HUB_GGUF off)",
        ),
        (
            ("push", "--run-dir", run, "--repo", "alice/tiny", "--dry-run", taken),
            {},
            f"--dry-run {taken} is not empty",
        ),
        (
            ("export-gguf", "--run-dir", char_run, "--out", tmp_path / "c.gguf"),
            {},
            "char tokenizer",
        ),
    ]
    digests = {d: tree_digest(d) for d in (run, char_run, no_ckpt, taken)}
    for args, fail, says in cases:
        recording.fail = dict(fail)
        rc, out, err = cli(capsys, *args)
        assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and says in err, (
            args,
            err,
        )
        assert TOKEN not in err + out and recording.commits == [] and recording.fail == {}, args
        assert {d: tree_digest(d) for d in digests} == digests and not (
            tmp_path / "c.gguf"
        ).exists()
    monkeypatch.delenv("HF_TOKEN")
    rc, out, err = cli(capsys, *push, "alice/tiny")
    assert (
        rc == 2
        and err.startswith("error: no Hugging Face token to push alice/tiny")
        and err.count("\n") == 1
    )
    # the network failed mid-upload above: the same command finishes it, in one commit
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli(capsys, *push, "alice/tiny")[0] == 0 and [c["repo"] for c in recording.commits] == [
        "alice/tiny"
    ]


def test_the_card_gives_only_the_pushed_checkpoints_scores(run, tmp_path):
    """The same run directory trained again from scratch (notebook 03 with the same RUN_NAME after deleting its
    checkpoints) keeps eval.jsonl: the first model's rows at the same step are not the pushed model's scores (the card
    showed them). A row without model_sha256 (training's end-of-run HellaSwag, gptlib before 0.3.0) counts only where
    no row at that step names another checkpoint."""
    import json

    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.fsutil import read_jsonl
    from gptlib.inference.loading import load_run
    from gptlib.share import model_card

    def card(r):
        return hub.ModelCard(model_card(load_run(r), r, "alice/again", "mit", "", "", False))

    r = tmp_path / "run"
    shutil.copytree(run, r)
    first = {x["task"]: x for x in read_jsonl(r / "eval.jsonl")}
    # as training writes it (no hash); the retrained model's own end-of-run row could be such a row too
    unhashed = {**first["hellaswag"], "acc_norm": 0.9, "acc_norm_se": 0.01, "n": 99}
    del unhashed["model_sha256"]
    with (r / "eval.jsonl").open("a") as f:
        f.write(json.dumps(unhashed) + "\n")
    shutil.rmtree(r / "checkpoints")
    bpe_run(run.parent / "data", r, extra=["seed=7"])
    again = card(r)
    said = again.text.split("## Evaluation")[1].split("##")[0]
    assert "- bits per byte: not run" in said and "- HellaSwag acc_norm: not run" in said, said
    assert [e.metric_type for e in again.data.eval_results] == ["loss"]

    (now,) = evaluate_run(r, "bpb", limit=4, device="cpu", progress=False)
    assert now["model_sha256"] != first["bpb"]["model_sha256"] and now["bpb"] != first["bpb"]["bpb"]
    found = {e.metric_type: e.metric_value for e in card(r).data.eval_results}
    assert found["bpb"] == round(now["bpb"], 4)

    # rows of gptlib before 0.3.0, none naming a checkpoint: the card keeps using them
    old = tmp_path / "old"
    shutil.copytree(run, old)
    rows = [{k: v for k, v in x.items() if k != "model_sha256"} for x in first.values()]
    (old / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert f"bits per byte: {first['bpb']['bpb']:.4f} ±" in card(old).text


def test_a_failed_upload_in_notebook_04_says_to_run_the_cell_again(run, recording, monkeypatch):
    """Notebook 04's push cell, the connection dropped mid-commit: the error said 'run the same command again', a
    command the notebook user never ran. In a notebook it says to run the cell again; nothing was committed."""
    from types import SimpleNamespace

    from gptlib import push
    from gptlib.errors import ExportError

    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(__import__("sys").modules, "IPython", kernel)
    recording.fail = {"create_commit": ConnectionResetError("Connection reset by peer")}
    with pytest.raises(ExportError, match="all or nothing\\): run this cell again to finish it"):
        push(run, "alice/tiny", gguf=False)
    assert recording.commits == []
