"""What a sentence-transformers folder says of its vectors: its prompts, how it reads a
text, and the modules after its transformer (pooling, Dense layers, normalization)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, TypeGuard

from rawserve.models.json_files import json_file, json_object, read_json


def sentence_transformers_prompts(model_dir: Path) -> dict[str, str]:
    """The prompts a sentence-transformers folder names (TEI's `prompt_name`): name → text."""
    prompts = sentence_transformers_config(model_dir).get("prompts") or {}
    return {str(name): str(text) for name, text in prompts.items()}


def sentence_transformers_default_prompt(model_dir: Path) -> str | None:
    """The prompt sentence-transformers puts before every text not given another: the
    name `default_prompt_name` says, where it is one of the folder's prompts."""
    name = sentence_transformers_config(model_dir).get("default_prompt_name")
    return name if name in sentence_transformers_prompts(model_dir) else None


def sentence_transformers_config(model_dir: Path) -> dict[str, Any]:
    return json_file(model_dir / "config_sentence_transformers.json")


def sentence_transformers_reading(model_dir: Path) -> tuple[int | None, bool]:
    """(max_seq_length, do_lower_case) as sentence_bert_config.json says: the tokens a text
    is cut at (None: the tokenizer's and the model's limit) and whether it is lowercased."""
    config = json_file(model_dir / "sentence_bert_config.json")
    return config.get("max_seq_length"), bool(config.get("do_lower_case"))


# sentence-transformers' pooling modes, by the switch an older Pooling config sets for
# each (a current one names them in `pooling_mode`)
POOLING_SWITCHES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = set(POOLING_SWITCHES.values())
# The modules an embedding folder may chain, in this order: the model at the folder's root,
# one Pooling, Dense layers on the pooled vector, Normalize; or a sparse encoder's masked
# language model and its SpladePooling. Another (LayerNorm, a Router, ...) changes the
# vectors in a way rawserve does not compute, so such a folder is refused rather than
# answered with other vectors.
SERVED_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
OWN_MODULES = "sentence_transformers."  # the package whose modules these are
SPARSE_MODULES = {"MLMTransformer": "Transformer", "SpladePooling": "Pooling"}  # (their ranks)
MASKED_LM_TASK = "fill-mask"  # a Transformer module's transformer_task for a SPLADE model's
SPLADE_STRATEGIES = ("max", "sum")  # how SpladePooling gathers a text's tokens
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")  # log(1 + relu(logit)), or log1p of that again
# the activations a Dense module may name (sentence-transformers saves the torch.nn
# class's full name; one without arguments to build is all it may be)
DENSE_ACTIVATIONS = frozenset(
    "Identity Tanh ReLU GELU Sigmoid SiLU LeakyReLU ELU Softplus Mish Hardtanh Softsign".split()
)
DENSE_ACTIVATION = "torch.nn.modules.activation.Tanh"  # sentence-transformers' default
DENSE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # as it looks for them, in order
SENTENCE_VECTOR = "sentence_embedding"  # the one feature a Dense module may read and write


def dense_activation_names(name: str) -> tuple[str, ...]:
    """The names sentence-transformers may save of torch.nn's activation `name`: its
    module's (torch.nn.modules.activation.Tanh, .linear.Identity) or torch.nn's own."""
    if name not in DENSE_ACTIVATIONS:
        return ()
    module = "linear" if name == "Identity" else "activation"
    return (f"torch.nn.modules.{module}.{name}", f"torch.nn.{name}")


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module: activation(W x + b) of the pooled vector x,
    plus x (through a projection where the sizes differ) when `residual`."""

    path: str  # its folder, in the model's: config.json and its weights
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a torch.nn class's name (DENSE_ACTIVATIONS)
    residual: bool = False


@dataclass(frozen=True)
class SpladePooling:
    """A sparse encoder's pooling of its masked language model's logits: a vocabulary-wide
    vector, each word's weight the `strategy` (max or sum) over the text's tokens of
    log(1 + relu(logit)) (`activation` log1p_relu: log1p of that again)."""

    strategy: str = "max"
    activation: str = "relu"


@dataclass(frozen=True)
class SentenceModules:
    """What a sentence-transformers folder does after its transformer: the pooling mode
    ("none" without one: token vectors; "splade": a sparse encoder's, as `splade` says),
    the Dense layers after it, and normalization."""

    pooling: str = "none"
    dense: tuple[DenseModule, ...] = ()
    normalize: bool = False
    splade: SpladePooling | None = None


def sentence_modules(model_dir: Path) -> SentenceModules:
    """The modules a sentence-transformers folder chains; SentenceModules() for another.
    Raises ValueError for a folder whose vectors rawserve would not compute as it does."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return SentenceModules()
    pooling, normalize = "mean", False
    dense: list[DenseModule] = []
    splade, masked_lm = None, False
    order: list[str] = []  # the kinds seen, to refuse a chain out of the order computed
    listed = read_json(modules_file)
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        raise ValueError("its modules.json is not a list of modules (objects with a type)")
    for module in listed:
        module_type, named = str(module.get("type", "")), own_name(module)
        path = module_path(module)
        kind = SPARSE_MODULES.get(named, named)
        if kind not in SERVED_MODULES:
            raise ValueError(
                f"its sentence-transformers module {named or module_type or '?'} ({path}) "
                f"is not served: rawserve computes {', '.join(SERVED_MODULES)} only"
            )
        if order and SERVED_MODULES.index(kind) < SERVED_MODULES.index(order[-1]):
            raise ValueError(
                f"its sentence-transformers module {named} ({path}) comes after {order[-1]}: "
                f"rawserve computes them in the order {', '.join(SERVED_MODULES)}"
            )
        if kind == "Transformer" and path:
            raise ValueError(
                f"its transformer is in {path}/, not the folder's root: it is not served"
            )
        if kind == "Transformer":
            masked_lm = named == "MLMTransformer" or transformer_task(model_dir) == MASKED_LM_TASK
        if named == "Pooling":
            if not (model_dir / path / "config.json").is_file():
                raise ValueError(
                    f"its Pooling module has no {path + '/' if path else ''}config.json to "
                    "say how it pools: copy it too, or download the model again"
                )
            pooling = pooling_mode(model_dir, json_file(model_dir / path / "config.json"))
        if named == "SpladePooling":
            pooling, splade = "splade", splade_pooling(json_file(model_dir / path / "config.json"))
        if kind == "Dense" and splade is not None:
            raise ValueError(f"its Dense module ({path}) after SpladePooling is not served")
        if kind == "Dense":
            dense.append(dense_module(model_dir, path, dense[-1] if dense else None))
        normalize = normalize or kind == "Normalize"
        order.append(kind)
    if dense and "Pooling" not in order:
        raise ValueError("its Dense module has no Pooling before it: it is not served")
    if masked_lm != (splade is not None):
        raise ValueError(
            "its masked language model has no SpladePooling after it: it is not served"
            if masked_lm
            else "its SpladePooling has no masked language model (MLMTransformer) before it"
        )
    return SentenceModules(pooling, tuple(dense), normalize, splade)


def own_name(module: dict[str, Any]) -> str:
    """A module's class name where it is sentence-transformers' own ("" for another
    package's class, whose name says nothing of what it computes)."""
    module_type = str(module.get("type", ""))
    return module_type.rsplit(".", 1)[-1] if module_type.startswith(OWN_MODULES) else ""


def module_path(module: dict[str, Any]) -> str:
    """A module's folder in the model's, as modules.json names it; ValueError for one
    outside it (an absolute path, or one through ..), as sentence-transformers refuses."""
    given = str(module.get("path") or "")
    path = PurePosixPath(given)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"its sentence-transformers module's path {given} is outside its folder: "
            "it is not served"
        )
    return given.strip("/")


def module_folders(model_dir: Path) -> tuple[str, ...]:
    """The folders below the model's that its modules.json names (a Pooling's config, a
    Dense layer's weights); () where there are none or it cannot be read (read again
    later, it is refused then, saying why)."""
    return tuple(path for path in _module_paths(model_dir / "modules.json") if path)


def dense_paths(modules_file: Path) -> tuple[str, ...]:
    """The folders modules.json names for its Dense modules (a Hub download keeps their
    weights: LaBSE's are a pytorch_model.bin alone); () where it cannot be read."""
    return _module_paths(modules_file, "Dense")


def _module_paths(modules_file: Path, kind: str | None = None) -> tuple[str, ...]:
    """The folders of the modules `modules_file` lists (of the `kind` named, if one);
    () where it cannot be read."""
    try:
        modules = read_json(modules_file)
        return tuple(module_path(m) for m in modules if kind in (None, own_name(m)))
    except (OSError, ValueError, AttributeError, TypeError):
        return ()


def pooled_as(modules: SentenceModules, pooling: str, masked_lm: bool) -> SentenceModules:
    """A folder's modules with --pooling's mode in place of its own pooling (`masked_lm`:
    whether the model is a masked language model, which splade pools); ValueError where
    the model cannot be pooled so."""
    if pooling == "splade" and not masked_lm:
        raise ValueError(
            "--pooling splade: it is not a masked language model (a ...ForMaskedLM), whose "
            "logits SPLADE pools"
        )
    if pooling == "splade" and modules.dense:
        raise ValueError("--pooling splade: its Dense module would follow SpladePooling")
    if modules.splade is not None and pooling != "splade":
        raise ValueError(f"--pooling {pooling}: it is a sparse encoder, pooled by SPLADE")
    splade = (modules.splade or SpladePooling()) if pooling == "splade" else None
    return replace(modules, pooling=pooling, splade=splade)


def transformer_task(model_dir: Path) -> str:
    """What a Transformer module runs the model as (sentence_bert_config.json's
    transformer_task; a SPLADE model's is fill-mask); feature-extraction unless it says."""
    config = json_file(model_dir / "sentence_bert_config.json")
    return str(config.get("transformer_task") or "feature-extraction")


def splade_pooling(config: dict[str, Any]) -> SpladePooling:
    """A SpladePooling module's config read; ValueError for one rawserve does not compute."""
    strategy = config.get("pooling_strategy", "max")  # (null: refused, as it refuses it)
    activation = config.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise ValueError(
            f"its SpladePooling ({strategy}, {activation}) is not served: its strategy one of "
            f"{', '.join(SPLADE_STRATEGIES)}, its activation one of {', '.join(SPLADE_ACTIVATIONS)}"
        )
    return SpladePooling(strategy, activation)


def dense_module(model_dir: Path, path: str, before: DenseModule | None) -> DenseModule:
    """The Dense module in `path` as its config.json says (`before`: the one it follows);
    ValueError for one rawserve does not compute, or whose weights are not there."""
    config_file = model_dir / path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"its Dense module ({path}) has no config.json")
    config = json_object(config_file)
    in_features, out_features = config.get("in_features"), config.get("out_features")
    if not (is_size(in_features) and is_size(out_features)):
        raise ValueError(f"its Dense module ({path}) names no in_features and out_features")
    activation = config.get("activation_function", DENSE_ACTIVATION)
    name = str(activation).rsplit(".", 1)[-1]
    if activation not in dense_activation_names(name):
        raise ValueError(
            f"its Dense module ({path}) has the activation {activation}, which is not served: "
            f"one of torch.nn's {', '.join(sorted(DENSE_ACTIVATIONS))}"
        )
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, SENTENCE_VECTOR):
            raise ValueError(
                f"its Dense module ({path}) reads or writes {config[key]}, not the sentence "
                "vector: it is not served"
            )
    if not any((model_dir / path / name).is_file() for name in DENSE_WEIGHTS):
        raise ValueError(
            f"its Dense module ({path}) holds no weights ({' or '.join(DENSE_WEIGHTS)})"
        )
    if before is not None and before.out_features != in_features:
        raise ValueError(
            f"its Dense module ({path}) takes {in_features} numbers where the one before it "
            f"gives {before.out_features}"
        )
    bias, residual = config.get("bias", True), config.get("use_residual", False)
    return DenseModule(path, in_features, out_features, bool(bias), name, bool(residual))


def is_size(value: object) -> TypeGuard[int]:
    """A positive whole number, as JSON writes one (not `true`, which Python counts as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def pooling_mode(model_dir: Path, config: dict[str, Any]) -> str:
    """The one mode a Pooling config names; ValueError for what rawserve does not pool."""
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for switch, mode in POOLING_SWITCHES.items() if config.get(switch)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if not modes:
        raise ValueError(
            f"its pooling names no mode: one of {', '.join(sorted(POOLING_MODES))} is served"
        )
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(
            f"its pooling {'+'.join(map(str, modes))} is not served: "
            f"one of {', '.join(sorted(POOLING_MODES))}"
        )
    if config.get("include_prompt") is False and any(
        sentence_transformers_prompts(model_dir).values()
    ):
        raise ValueError("its pooling leaves its prompts out (include_prompt false): not served")
    return modes[0]
