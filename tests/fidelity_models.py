"""The tiny models of the fidelity comparison (tests/test_fidelity.py), built the same way
every time, with any torch or transformers 5 release.

The reference answers in tests/fidelity_reference.json were computed by transformers 4's
pipelines on these exact weights, so the weights must not depend on torch's random
initialisation (which may change between releases): every tensor is overwritten with values
drawn from numpy's legacy `RandomState`, whose streams numpy keeps stable forever, in
sorted parameter-name order. `fingerprint()` hashes what the answers depend on (weights and
vocabulary); the fixture stores it and the test refuses to compare against different models.
Rebuilding beats committing ~400 KB of binary weights that would hide any drift in the
builder itself.

Plain functions; imports transformers lazily so that the reference script can import the
case list without it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SEED = 17
# BERT-style word pieces: whole words, every letter as a word start and as a continuation
# ("##x"), so any lower-case word splits into pieces (and `align_to_words` matters).
WORDS = (
    "the a an is was good bad great movie film i you we it this that not very and or of to "
    "in on for with paris france city capital name my what who where when berlin london "
    "john mary lives works live work does did summarize translate english german french "
    "romanian"
).split()
SUFFIXES = ["##s", "##ing", "##er", "##ian", "##like", "##athan", "##on"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
PUNCTUATION = list(".,?!:;'-")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + WORDS + LETTERS + ["##" + c for c in LETTERS] + SUFFIXES + PUNCTUATION

# t5-small's task_specific_params, with shorter lengths so that generating stays quick.
T5_TASK_PARAMS = {
    "summarization": {
        "early_stopping": True,
        "length_penalty": 2.0,
        "max_length": 40,
        "min_length": 10,
        "no_repeat_ngram_size": 3,
        "num_beams": 4,
        "prefix": "summarize: ",
    },
    "translation_en_to_de": {
        "early_stopping": True,
        "max_length": 30,
        "num_beams": 4,
        "prefix": "translate English to German: ",
    },
    "translation_en_to_fr": {
        "early_stopping": True,
        "max_length": 30,
        "num_beams": 4,
        "prefix": "translate English to French: ",
    },
    "translation_en_to_ro": {
        "early_stopping": True,
        "max_length": 30,
        "num_beams": 4,
        "prefix": "translate English to Romanian: ",
    },
}

# "t5-tuned": the same T5 with settings in its generation config, as many published models
# have (bart-large-cnn's are of this kind).
T5_GENERATION_CONFIG = {
    "num_beams": 2,
    "max_length": 24,
    "no_repeat_ngram_size": 2,
    "length_penalty": 1.5,
}
MODELS = ("qa-bert", "t5", "t5-tuned")


def build(name: str, folder: Path) -> Path:
    """Save the tiny model `name` (one of MODELS) into `folder`."""
    if name == "qa-bert":
        model, tokenizer = _qa_bert()
    elif name == "t5":
        model, tokenizer = _t5()
    elif name == "t5-tuned":
        model, tokenizer = _t5()
        model.generation_config.update(**T5_GENERATION_CONFIG)
    else:
        raise ValueError(name)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "fingerprint.txt").write_text(fingerprint(model, tokenizer) + "\n")
    return folder


def saved_fingerprint(folder: Path) -> str:
    return (folder / "fingerprint.txt").read_text().strip()


def fingerprint(model: Any, tokenizer: Any) -> str:
    """sha256 of the weights (name, shape, float32 bytes) and the vocabulary."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return digest.hexdigest()


def _tokenizer() -> Any:
    import transformers

    return transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})


def _fill(model: Any, std: float) -> Any:
    """Overwrite every parameter with seeded numpy draws (norm scales around 1)."""
    import numpy as np
    import torch

    rng = np.random.RandomState(SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            values = rng.standard_normal(tuple(parameter.shape)).astype(np.float32)
            if "norm" in name.lower() and name.endswith("weight"):
                values = 1.0 + 0.1 * values
            else:
                values = std * values
            parameter.copy_(torch.from_numpy(values))
    return model.eval()


def _qa_bert() -> tuple[Any, Any]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,  # room for max_seq_len=512
    )
    return _fill(transformers.BertForQuestionAnswering(config), 0.3), _tokenizer()


def _t5() -> tuple[Any, Any]:
    import transformers

    tokenizer = _tokenizer()
    config = transformers.T5Config(
        vocab_size=len(VOCAB),
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.sep_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        task_specific_params=T5_TASK_PARAMS,
    )
    return _fill(transformers.T5ForConditionalGeneration(config), 0.2), tokenizer
