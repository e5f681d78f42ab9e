"""Tiny random transformers models, built locally for tests (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = (
    "the a an test hello world is was good bad great movie film i you we like love hate it "
    "this that not very and or of to in on for with paris france city capital name my what "
    "who where berlin london john mary lives works"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + WORDS + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,?!")

# the prompts a sentence-transformers model may name (TEI's `prompt_name`)
SENTENCE_PROMPTS = {"query": "query: ", "passage": "passage: "}
# A JSON schema the grammar tests hold the tiny models' generations to: short enough that a
# random model's choice of characters, a token a byte, fits a few dozen tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A tool the tool tests offer: small, so that told at the end of a question (a template
# that leaves tools out) it fits a tiny model's positions. Stdlib only above: the client
# scripts in their own environments import it too.
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["paris", "rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# the word a tokenizer is given as a token of its own without the model's embeddings
# growing (`with_tokens_added`)
UNREADABLE_TOKEN = "newword"
# a ChatML-like template, as instruction-tuned models ship them
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

KINDS = (
    "fill-mask",
    "text-classification",
    "token-classification",
    "feature-extraction",
    "sentence-embedding",
    "t5-sentence-embedding",  # a T5 encoder alone, as sentence-t5 and GTR ship
    "dense-sentence-embedding",  # CLS pooling, a Dense layer to 16 numbers: LaBSE's modules
    "splade",  # a sparse encoder: a BERT's masked LM and SpladePooling, as naver's SPLADE
    "question-answering",
    "zero-shot-classification",
    "reranker",
    "text-generation",
    "long-generation",  # the same with 4,096 positions: a generation that runs for seconds
    "short-generation",  # the same with 32 positions: fewer than the warm-up's example takes
    "alibi-generation",  # a Bloom: ALiBi, its config names no positions, its tokenizer no length
    "chat",
    "byte-fallback-generation",  # a Llama with its tokenizer: bytes as <0xNN> tokens
    "sliding-window",  # a Mistral whose attention slides over 4 tokens, shorter than prompts
    "seq2seq",
    "multilingual-translation",  # an M2M100 with NLLB's tokenizer, which keeps a src_lang
    "image-classification",
)


def build(kind: str, folder: Path) -> Path:
    """Save a tiny random model for `kind` into `folder`."""
    import torch

    torch.manual_seed(0)
    if kind == "text-generation":
        return _build_gpt2(folder)
    if kind == "long-generation":
        return _build_gpt2(folder, positions=4096)
    if kind == "short-generation":
        return _build_gpt2(folder, positions=32)
    if kind == "alibi-generation":
        return _build_bloom(folder)
    if kind == "chat":
        return _build_gpt2(folder, chat_template=CHAT_TEMPLATE)
    if kind == "byte-fallback-generation":
        return _build_llama(folder)
    if kind == "sliding-window":
        return _build_mistral(folder)
    if kind == "seq2seq":
        return _build_bart(folder)
    if kind == "multilingual-translation":
        return _build_m2m100(folder)
    if kind == "image-classification":
        return _build_vit(folder)
    if kind == "t5-sentence-embedding":
        return _build_t5_encoder(folder)
    return _build_bert(kind, folder)


def _build_bert(kind: str, folder: Path) -> Path:
    import transformers

    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=128,
    )
    if kind in ("fill-mask", "splade"):
        model = transformers.BertForMaskedLM(config)
    elif kind == "text-classification":
        config.id2label = {0: "NEGATIVE", 1: "POSITIVE"}
        config.label2id = {"NEGATIVE": 0, "POSITIVE": 1}
        model = transformers.BertForSequenceClassification(config)
    elif kind == "token-classification":
        labels = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
        config.id2label = dict(enumerate(labels))
        config.label2id = {label: i for i, label in enumerate(labels)}
        model = transformers.BertForTokenClassification(config)
    elif kind == "reranker":  # a cross-encoder: one relevance score per (query, text) pair
        config.num_labels = 1
        model = transformers.BertForSequenceClassification(config)
    elif kind == "zero-shot-classification":  # an NLI head, as zero-shot needs
        labels = ["contradiction", "neutral", "entailment"]
        config.id2label = dict(enumerate(labels))
        config.label2id = {label: i for i, label in enumerate(labels)}
        model = transformers.BertForSequenceClassification(config)
    elif kind == "question-answering":
        model = transformers.BertForQuestionAnswering(config)
    elif kind in ("feature-extraction", "sentence-embedding", "dense-sentence-embedding"):
        model = transformers.BertModel(config)
    else:
        raise ValueError(kind)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if kind == "sentence-embedding":
        _sentence_transformers_files(folder)
    if kind == "dense-sentence-embedding":
        _sentence_transformers_files(folder, {"pooling_mode": "cls"}, dense_to=16)
    if kind == "splade":
        _sparse_encoder_files(folder)
    return folder


def _build_t5_encoder(folder: Path) -> Path:
    """A T5 encoder alone (`T5EncoderModel`) in a sentence-transformers folder."""
    import transformers

    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    config = transformers.T5Config(
        vocab_size=len(VOCAB),
        d_model=32,
        d_kv=16,
        d_ff=37,
        num_layers=2,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.sep_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    folder.mkdir(parents=True, exist_ok=True)
    transformers.T5EncoderModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _sentence_transformers_files(folder)
    return folder


def _sentence_transformers_files(
    folder: Path, pooling: dict[str, object] | None = None, dense_to: int = 0
) -> None:
    """The files sentence-transformers writes beside the model: mean pooling (or
    `pooling`), with `dense_to` a Dense layer (tanh) to that many numbers, normalized."""
    kinds = ["Transformer", "Pooling", *(["Dense"] * bool(dense_to)), "Normalize"]
    _modules_json(folder, [f"sentence_transformers.models.{kind}" for kind in kinds])
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {"word_embedding_dimension": 32, **(pooling or {"pooling_mode_mean_tokens": True})}
        )
    )
    if dense_to:
        _dense_module(folder / "2_Dense", 32, dense_to)
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": SENTENCE_PROMPTS, "default_prompt_name": None})
    )


def _modules_json(folder: Path, types: list[str]) -> None:
    """modules.json as sentence-transformers writes it: the model at the folder's root,
    each module after it in a folder `N_Class`."""
    modules = [
        {
            "idx": i,
            "name": str(i),
            "path": f"{i}_{kind.rsplit('.', 1)[-1]}" if i else "",
            "type": kind,
        }
        for i, kind in enumerate(types)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))


def _sparse_encoder_files(folder: Path) -> None:
    """The files sentence-transformers writes beside a SparseEncoder's masked LM."""
    kinds = ["MLMTransformer", "SpladePooling"]
    _modules_json(folder, [f"sentence_transformers.sparse_encoder.models.{k}" for k in kinds])
    (folder / "1_SpladePooling").mkdir(exist_ok=True)
    pooling = {
        "pooling_strategy": "max",
        "activation_function": "relu",
        "embedding_dimension": None,
    }
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"model_type": "SparseEncoder", "prompts": {"query": "", "document": ""}})
    )


def _dense_module(folder: Path, in_features: int, out_features: int) -> None:
    """A Dense module's folder as sentence-transformers saves it: its config, and its
    weights under its own names (linear.weight, linear.bias) in model.safetensors."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh",
    }
    (folder / "config.json").write_text(json.dumps(config))
    linear = torch.nn.Linear(in_features, out_features)
    weights = {"linear.weight": linear.weight.data, "linear.bias": linear.bias.data}
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()},
        folder / "model.safetensors",
    )


def bpe_tokenizer():
    """A small byte-level BPE tokenizer (GPT-2 style), trained here on `WORDS`."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = [" ".join(WORDS[i : i + 7]) for i in range(len(WORDS))]
    tokenizer.train_from_iterator(sentences, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def byte_fallback_tokenizer():
    """A small Llama tokenizer (SentencePiece-style BPE, trained here on `WORDS`): a
    character it lacks is spelled as byte tokens, <0x00> to <0xFF>, and its decoder turns
    a run of them into text only where the run is valid UTF-8 as a whole."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers, trainers

    trained = tokenizers.Tokenizer(models.BPE(byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    sentences = [" ".join(WORDS[i : i + 7]) for i in range(len(WORDS))] + ["héllo café 日本"]
    trained.train_from_iterator(sentences, trainer)
    state = json.loads(trained.to_str())["model"]
    learned = sorted(state["vocab"], key=state["vocab"].get)
    names = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *learned]
    merges = [tuple(pair) for pair in state["merges"]]
    vocab = {name: i for i, name in enumerate(dict.fromkeys(names))}
    return transformers.LlamaTokenizer(vocab=vocab, merges=merges)


def _build_llama(folder: Path) -> Path:
    import transformers

    tokenizer = byte_fallback_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _saved(transformers.LlamaForCausalLM(config), tokenizer, folder)


def _build_gpt2(folder: Path, chat_template: str | None = None, positions: int = 256) -> Path:
    import transformers

    tokenizer = bpe_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    return _saved(model, tokenizer, folder)


def _build_bloom(folder: Path) -> Path:
    import transformers

    tokenizer = bpe_tokenizer()
    config = transformers.BloomConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        n_layer=2,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _saved(transformers.BloomForCausalLM(config), tokenizer, folder)


def _saved(model, tokenizer, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _build_mistral(folder: Path) -> Path:
    import torch
    import transformers

    tokenizer = bpe_tokenizer()
    config = transformers.MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=4,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.MistralForCausalLM(config)
    with torch.no_grad():  # sharper scores: greedy choices are never near ties
        model.lm_head.weight.mul_(20)
    return _saved(model, tokenizer, folder)


def _build_bart(folder: Path) -> Path:
    """A tiny BART: serves summarization, translation and text2text-generation."""
    import transformers

    tokenizer = bpe_tokenizer()
    config = transformers.BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    config.task_specific_params = {
        "summarization": {"prefix": "summarize: "},
        "translation_en_to_fr": {"prefix": "translate English to French: "},
    }
    model = transformers.BartForConditionalGeneration(config)
    return _saved(model, tokenizer, folder)


def _build_m2m100(folder: Path) -> Path:
    """A tiny M2M100 with NLLB's tokenizer (its default vocabulary: language codes such
    as eng_Latn and fra_Latn, a few hundred tokens), reading English unless told."""
    import transformers

    tokenizer = transformers.NllbTokenizer(src_lang="eng_Latn")
    sizes = {"layers": 1, "attention_heads": 2, "ffn_dim": 16}
    both_sides = {f"{side}_{key}": n for side in ("encoder", "decoder") for key, n in sizes.items()}
    config = transformers.M2M100Config(
        vocab_size=len(tokenizer),
        d_model=16,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,
        **both_sides,
    )
    return _saved(transformers.M2M100ForConditionalGeneration(config), tokenizer, folder)


def _build_vit(folder: Path) -> Path:
    """A tiny ViT on 32x32 images, with a Pillow-only image processor."""
    import transformers

    labels = ["cat", "dog", "bird"]
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    folder.mkdir(parents=True, exist_ok=True)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    processor = transformers.models.vit.image_processing_pil_vit.ViTImageProcessorPil(
        size={"height": 32, "width": 32}
    )
    processor.save_pretrained(folder)
    return folder


def with_tokens_added(source: str | Path, folder: Path, pad: bool = False) -> str:
    """A copy of the model in `source`, saved in `folder`, whose tokenizer was given tokens
    without `model.resize_token_embeddings` (a common mistake of fine-tuned checkpoints):
    its tokenizer makes ids past the model's embedding table. `pad`: its pad token is one
    of them (`add_special_tokens({"pad_token": ...})`, as GPT-2's fine-tunes add one).
    Returns the token added last, which no embedding reads."""
    import shutil

    import transformers

    shutil.copytree(source, folder)
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    while len(tokenizer) < rows:  # (a vocabulary may leave rows unused)
        tokenizer.add_tokens([f"filler{len(tokenizer)}"])
    if pad:
        tokenizer.add_special_tokens({"pad_token": "<added-pad>"})
    tokenizer.add_tokens([UNREADABLE_TOKEN])
    tokenizer.save_pretrained(folder)
    return UNREADABLE_TOKEN


def worker_config(
    folder: str, task: str | None = None, pooling: str | None = None, **options: object
):
    """The WorkerConfig the server would send for `folder`: the task and pooling read from
    the folder's files (`pooling`: --pooling's), as rawserve.models does before any worker
    starts."""
    from rawserve.models.folder import read_facts
    from rawserve.shared.messages import WorkerConfig

    facts = read_facts(Path(folder), task, pooling)
    return WorkerConfig(
        model=folder,
        task=facts.task,
        pooling=facts.pooling,
        normalize=facts.normalize,
        **options,  # type: ignore[arg-type]
    )
