"""gptlib: train GPT-style language models from scratch, on a laptop CPU or a Colab GPU.

The names below are what the notebooks, the README and docs import. Each loads on first use (PEP 562): `import gptlib`
has no side effects, and `python -m gptlib tokenize` never imports torch (0.14 s to import what it needs, against
1.6 s for every module below, measured on a 2-core CPU). Editors follow the same names to their definitions through
the static imports under TYPE_CHECKING (tests/test_facade.py keeps the two lists equal).
"""

from typing import TYPE_CHECKING

# the one place it is set: pyproject.toml reads it; notebooks install the tag v<it>
__version__ = "0.3.0"

# The name -> the module that defines it, along the data's path.
_WHERE = {
    # text -> token shards (gptlib/data/)
    "prepare": "gptlib.data.prepare",
    "prepare_text": "gptlib.data.prepare",
    "print_summary": "gptlib.data.summary",
    "decoded_sample": "gptlib.data.summary",
    "source_inputs": "gptlib.data.catalog",
    "fetch_tinyshakespeare": "gptlib.data.download",
    "find_dataset": "gptlib.data.shards",
    # the model's config, training (gptlib/training/)
    "ModelConfig": "gptlib.config",
    "train": "gptlib.training.loop",
    "StartOptions": "gptlib.training.resume",
    "plan_run": "gptlib.training.throughput",
    "samples_html": "gptlib.training.logs",
    "loss_png": "gptlib.training.logs",
    "html_table": "gptlib.training.logs",
    "LivePlot": "gptlib.training.logs",
    "run_title": "gptlib.training.logs",
    "hellaswag_figure": "gptlib.training.logs",
    "runs_figure": "gptlib.training.logs",
    # a trained run at work (gptlib/inference/)
    "load_run": "gptlib.inference.loading",
    "find_run": "gptlib.inference.loading",
    "find_runs": "gptlib.inference.loading",
    "checkpoint_table": "gptlib.inference.loading",
    "checkpoint_label": "gptlib.inference.loading",
    "Engine": "gptlib.inference.engine",
    "SamplingConfig": "gptlib.inference.engine",
    "export_hf": "gptlib.inference.export",
    "export_gguf": "gptlib.inference.export",
    "import_hf": "gptlib.inference.hf_import",
    "push": "gptlib.share",
    # how good a checkpoint is (gptlib/evaluation/)
    "evaluate_run": "gptlib.evaluation.evaluate",
    "format_table": "gptlib.evaluation.evaluate",
    # notebook views, Colab, devices
    "Playground": "gptlib.widgets",
    "ChatBox": "gptlib.widgets",
    "parse_list": "gptlib.widgets",
    "enable_colab_widgets": "gptlib.widgets",
    "colab": "gptlib.colab",
    "resolve_device": "gptlib.runtime",
    "GptlibError": "gptlib.errors",
}

if TYPE_CHECKING:
    from gptlib import colab
    from gptlib.config import ModelConfig
    from gptlib.data.catalog import source_inputs
    from gptlib.data.download import fetch_tinyshakespeare
    from gptlib.data.prepare import prepare, prepare_text
    from gptlib.data.shards import find_dataset
    from gptlib.data.summary import decoded_sample, print_summary
    from gptlib.errors import GptlibError
    from gptlib.evaluation.evaluate import evaluate_run, format_table
    from gptlib.inference.engine import Engine, SamplingConfig
    from gptlib.inference.export import export_gguf, export_hf
    from gptlib.inference.hf_import import import_hf
    from gptlib.inference.loading import (
        checkpoint_label,
        checkpoint_table,
        find_run,
        find_runs,
        load_run,
    )
    from gptlib.runtime import resolve_device
    from gptlib.share import push
    from gptlib.training.logs import (
        LivePlot,
        hellaswag_figure,
        html_table,
        loss_png,
        run_title,
        runs_figure,
        samples_html,
    )
    from gptlib.training.loop import train
    from gptlib.training.resume import StartOptions
    from gptlib.training.throughput import plan_run
    from gptlib.widgets import ChatBox, Playground, enable_colab_widgets, parse_list


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'gptlib' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_WHERE[name])
    return module if module.__name__ == f"gptlib.{name}" else getattr(module, name)


def __dir__():
    return sorted([*globals(), *_WHERE])
