"""The bodies of TEI's routes, each declared once (`fields.Body`): what `/openapi.json` says
of a field and how the handler reads it come from the same `Field`. Also the readers of
TEI's input forms: texts, texts or token ids, a text or a pair, token ids.

TEI's routes ignore fields they do not use (TEI's clients send some that only some
servers read). Blank text is 422, as on every route. Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rawserve.api.bodies import check_client_batch
from rawserve.api.fields import (
    Body,
    Field,
    Fields,
    flag,
    item_name,
    one_of,
    read_string,
    texts_schema,
    unicode_text,
    whole,
)
from rawserve.api.openai_generation import is_token_ids, refuse_unknown_ids
from rawserve.api.prompt_cuts import cut_fields
from rawserve.api.routing import DocContext, Schema
from rawserve.http.errors import BadRequest, EmptyInput, UnprocessableInput
from rawserve.tasks.checks import BlankInput, not_blank, prompt, visible
from rawserve.tasks.registry import TASKS

DIRECTIONS = ("left", "right", "Left", "Right")  # TEI takes both spellings
MAX_TOKEN_ID = 2**32 - 1
MAX_DIMENSIONS = 65536


def details(context: DocContext) -> Mapping[str, Any]:
    loaded = context.model.serving.loaded
    return loaded.details if loaded else {}


def max_inputs(context: DocContext | None) -> int:
    assert context is not None, "inputs are read within the route's context"
    return context.max_inputs


# --- the inputs ------------------------------------------------------------------------


def read_texts(name: str, value: Any, context: DocContext | None) -> list[str]:
    return text_inputs(value, max_inputs(context))


def read_texts_to_tokenize(name: str, value: Any, context: DocContext | None) -> list[str]:
    """/tokenize's `inputs`, each checked as the model's task checks its input: a zero-width
    space is a prompt a generation model reads as tokens (as vLLM's body lists it here),
    where an encoder reads nothing of it."""
    texts = text_inputs(value, max_inputs(context), checked=False)
    task = TASKS.get(context.model.known_task or "") if context else None
    check = not_blank if task is not None and task.check_input is prompt else visible
    return [
        checked_text(text, item_name('"inputs"', index, len(texts)), "inputs", check)
        for index, text in enumerate(texts)
    ]


def text_inputs(value: Any, max_inputs: int, checked: bool = True) -> list[str]:
    """`inputs` as a list of texts: one text, or a non-empty list of them; each `checked`
    as a model may take it (`checked_text`)."""
    texts = [value] if isinstance(value, str) else value
    if texts == []:
        raise EmptyInput('"inputs" must be a text or a non-empty list of texts')
    if not isinstance(texts, list):
        raise BadRequest('"inputs" must be a text or a non-empty list of texts')
    if not all(isinstance(text, str) for text in texts):
        if is_token_ids(texts) or all(is_token_ids(item) for item in texts):
            raise BadRequest('"inputs" as token ids is not supported: send the text')
        raise BadRequest('"inputs" must be a text or a non-empty list of texts')
    check_client_batch(len(texts), max_inputs)
    return checked_texts(texts, '"inputs"') if checked else texts


def read_embed_inputs(name: str, value: Any, context: DocContext | None) -> list[str | list[int]]:
    """`inputs` of /embed and /embed_all: a text, one list of the model's token ids, or a
    non-empty list of texts and lists of ids, mixed as TEI takes them (its `Input`). 422
    for a blank text, a list of no ids or an id past the model's vocabulary."""
    if not isinstance(value, list) or all(isinstance(item, str) for item in value):
        return [*text_inputs(value, max_inputs(context))]
    inputs = [value] if is_token_ids(value) else value
    refusal = BadRequest(
        f'"{name}" must be a text, a list of token ids, or a non-empty list of texts '
        "and lists of token ids"
    )
    # (a list's first value tells ids from what is no input, before the count: each list
    # read whole first, 200,000 of them held the event loop 99 ms for a 413)
    if not all(isinstance(item, str) or looks_like_ids(item) for item in inputs):
        raise refusal
    check_client_batch(len(inputs), max_inputs(context))
    if not all(isinstance(item, str) or is_token_ids(item) for item in inputs):
        raise refusal
    if [] in inputs:
        where = item_name(f'"{name}"', inputs.index([]), len(inputs))
        raise UnprocessableInput(f"a token array of {where} has no ids", param=name)
    assert context is not None
    refuse_unknown_ids(inputs, details(context).get("vocabulary"), name)
    return [
        checked_text(item, item_name(f'"{name}"', index, len(inputs)), name)
        if isinstance(item, str)
        else item
        for index, item in enumerate(inputs)
    ]


def looks_like_ids(item: Any) -> bool:
    """A list that is token ids as far as its first value tells."""
    return isinstance(item, list) and (not item or type(item[0]) is int)


def embed_inputs_schema(context: DocContext) -> Schema:
    text = {"type": "string"}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    mixed = {"anyOf": [text, ids]}
    listed = {"type": "array", "items": mixed, "minItems": 1, "maxItems": context.max_inputs}
    return {"oneOf": [text, ids, listed]}


def predict_inputs(value: Any, max_inputs: int) -> tuple[list[Any], bool]:
    """TEI's /predict inputs: a text, a pair `[text, text]`, or a batch of `[text]` and
    `[text, text]` (at most `max_inputs`, counted before any text is read: 160,000 of
    them, each read, held the event loop a quarter of a second for a 413); the items to
    classify, and whether it was a batch."""
    refusal = BadRequest(
        '"inputs" must be a text, a pair [text, text], or a list of [text] and [text, text]'
    )
    if isinstance(value, str):
        return [checked_text(value, '"inputs"')], False
    if value == []:
        raise EmptyInput('"inputs" must not be an empty list')
    if not isinstance(value, list):
        raise refusal
    if all(isinstance(item, str) for item in value):
        if len(value) > 2:
            raise refusal
        return [sequence(value)], False
    if not all(isinstance(item, list) and 1 <= len(item) <= 2 for item in value):
        raise refusal
    if not all(isinstance(text, str) for item in value for text in item):
        raise refusal
    check_client_batch(len(value), max_inputs)  # (its shape known: each text not read yet)
    return [
        sequence(item, item_name('"inputs"', index, len(value))) for index, item in enumerate(value)
    ], True


def sequence(texts: list[str], name: str = '"inputs"') -> str | dict[str, str]:
    """One text, or a pair as the classifier takes it."""
    for text in texts:
        checked_text(text, name, "inputs")
    if len(texts) == 1:
        return texts[0]
    return {"text": texts[0], "text_pair": texts[1]}


def id_inputs(value: Any, max_lists: int) -> list[list[int]]:
    """`ids`: one list of token ids, or a non-empty list of them."""
    refusal = BadRequest('"ids" must be a list of token ids, or a non-empty list of such lists')
    if value == []:
        raise EmptyInput(refusal.message)
    if not isinstance(value, list):
        raise refusal
    lists = value if all(isinstance(item, list) for item in value) else [value]
    check_client_batch(len(lists), max_lists)
    for ids in lists:
        if not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in ids
        ):
            raise refusal
    return lists


def checked_text(
    value: str,
    name: str,
    param: str | None = None,
    check: Callable[[str, str], str] = visible,
) -> str:
    """A text as a model may take it: valid Unicode (else 400), not blank (else 422), nor
    (an encoder's) of invisible characters alone; `name` says where it is in the body,
    `param` its field (`name` unquoted if None)."""
    unicode_text(value, name)
    try:
        return check(value, f"a text of {name}")
    except BlankInput as exc:
        raise UnprocessableInput(str(exc), param=param or name.strip('"')) from None


def checked_texts(texts: list[str], name: str) -> list[str]:
    """Each of the texts of field `name` checked, a refusal saying which it was."""
    param = name.strip('"')
    return [
        checked_text(text, item_name(name, index, len(texts)), param)
        for index, text in enumerate(texts)
    ]


def read_predict_inputs(
    name: str, value: Any, context: DocContext | None
) -> tuple[list[Any], bool]:
    return predict_inputs(value, max_inputs(context))


def predict_schema(context: DocContext) -> Schema:
    one_or_pair = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}
    batch = {"type": "array", "items": one_or_pair, "minItems": 1, "maxItems": context.max_inputs}
    return {
        "oneOf": [
            {"type": "string"},
            {**one_or_pair, "description": "a text, or a pair of texts"},
            {**batch, "description": "a batch of [text] and [text, text]"},
        ]
    }


def read_similarity_inputs(
    name: str, value: Any, context: DocContext | None, ignore_unknown: bool = False
) -> tuple[str, list[str]]:
    """`{"source_sentence": text, "sentences": [text, ...]}`: the source and the others; the
    source counts as an input against the client batch cap, as TEI counts it. Other keys
    beside them are ignored where the body's unknown fields are (TEI's), else refused."""
    refusal = BadRequest('"inputs" must be {"source_sentence": text, "sentences": [text, ...]}')
    keys = {"source_sentence", "sentences"}
    if not isinstance(value, dict) or not keys <= set(value):
        raise refusal
    if not ignore_unknown and set(value) != keys:
        raise refusal
    source, sentences = value["source_sentence"], value["sentences"]
    if isinstance(source, str) and sentences == []:  # TEI types an empty list apart
        raise EmptyInput('"sentences" must not be an empty list')
    if not isinstance(source, str) or not isinstance(sentences, list) or not sentences:
        raise refusal
    if not all(isinstance(sentence, str) for sentence in sentences):
        raise refusal
    check_client_batch(len(sentences) + 1, max_inputs(context))
    checked = checked_texts(sentences, '"sentences"')
    return checked_text(source, '"source_sentence"'), checked


def similarity_inputs_schema(context: DocContext, ignore_unknown: bool = False) -> Schema:
    sentences = {"type": "array", "items": {"type": "string"}, "minItems": 1}
    return {
        "type": "object",
        "required": ["source_sentence", "sentences"],
        "properties": {
            "source_sentence": {"type": "string"},
            "sentences": {**sentences, "maxItems": context.max_inputs - 1},
        },
        "additionalProperties": ignore_unknown,
    }


def read_ids(name: str, value: Any, context: DocContext | None) -> list[list[int]]:
    return id_inputs(value, max_inputs(context))


def ids_schema(context: DocContext) -> Schema:
    token_id = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
    ids: Schema = {"type": "array", "items": token_id, "minItems": 1}
    many = {"type": "array", "items": ids, "minItems": 1, "maxItems": context.max_inputs}
    return {"oneOf": [ids, many]}


def read_query(name: str, value: Any, context: DocContext | None) -> str:
    if value is None:
        raise BadRequest(f'"{name}" is required')
    if not isinstance(value, str):
        raise BadRequest(f'"{name}" must be a string')
    return value


def read_rerank_texts(
    name: str, value: Any, context: DocContext | None, items: str = "strings"
) -> list[str]:
    if value is None:
        raise BadRequest(f'"{name}" is required')
    if value == []:
        raise EmptyInput(f'"{name}" must be a non-empty list of {items}')
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise BadRequest(f'"{name}" must be a non-empty list of {items}')
    check_client_batch(len(value), max_inputs(context))
    return value


def rerank_texts_schema(context: DocContext) -> Schema:
    many = {"type": "array", "items": {"type": "string"}, "minItems": 1}
    return {**many, "maxItems": context.max_inputs}


def read_documents(name: str, value: Any, context: DocContext | None) -> list[str]:
    """The `documents` of Cohere's, Jina's and vLLM's rerank: texts, or objects holding
    one as `text` (Cohere's first API took both)."""
    if isinstance(value, list):
        value = [item.get("text") if isinstance(item, dict) else item for item in value]
    return read_rerank_texts(name, value, context, 'strings or {"text": string} objects')


def documents_schema(context: DocContext) -> Schema:
    document = {
        "anyOf": [
            {"type": "string"},
            {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
        ]
    }
    return {"type": "array", "items": document, "minItems": 1, "maxItems": context.max_inputs}


def prompt_name_schema(context: DocContext) -> Schema:
    return {"enum": [*sorted(details(context).get("prompts", {})), None]}


def documented_dimensions(context: DocContext) -> int:
    """The model's vector size, where it alone serves the route."""
    return int((not context.shared and details(context).get("dimensions")) or MAX_DIMENSIONS)


# --- the bodies ------------------------------------------------------------------------

INPUTS = Field(texts_schema, read_texts, reads_null=True, required=True)
EMBED_INPUTS = Field(embed_inputs_schema, read_embed_inputs, reads_null=True, required=True)
PROMPT_NAME = Field(
    prompt_name_schema,
    read_string,
    description="A prompt of the model's sentence-transformers configuration, put before "
    "each input.",
)
# As TEI's (its auto-truncate, on by default since TEI 1.9): an input longer than the model takes
# is cut unless `truncate: false` asks for the 422
TRUNCATION = {
    "truncate": flag(True, "Cut inputs longer than the model takes (false: 422)."),
    "truncation_direction": one_of(DIRECTIONS, "right"),
}
EMBED = Body(
    {
        "inputs": EMBED_INPUTS,
        "normalize": flag(True),
        "prompt_name": PROMPT_NAME,
        "dimensions": whole(1, MAX_DIMENSIONS, documented_dimensions),
        **TRUNCATION,
    },
    ignore_unknown=True,
)
EMBED_ALL = Body(
    {"inputs": EMBED_INPUTS, "prompt_name": PROMPT_NAME, **TRUNCATION}, ignore_unknown=True
)
EMBED_SPARSE = EMBED_ALL  # (the same fields: TEI's EmbedSparseRequest)
PREDICT = Body(
    {
        "inputs": Field(predict_schema, read_predict_inputs, reads_null=True, required=True),
        "raw_scores": flag(False),
        **TRUNCATION,
    },
    ignore_unknown=True,
)
RANK_COUNT = ("top_n", "top_k")  # return only the best n (Cohere's and others' names)
RERANK = Body(
    {
        "query": Field({"type": "string"}, read_query, reads_null=True, required=True),
        "texts": Field(rerank_texts_schema, read_rerank_texts, reads_null=True, required=True),
        "raw_scores": flag(False),
        "return_text": flag(False),
        **{name: whole(1, MAX_TOKEN_ID) for name in RANK_COUNT},
        **TRUNCATION,
    },
    ignore_unknown=True,
)

# The rerank API of Cohere, Jina, vLLM and Infinity (litellm's `cohere/`, `hosted_vllm/`
# and `infinity/` providers post it): `documents` for TEI's `texts`; `top_n` 0 is all,
# as vLLM reads it. Fields of theirs not read here are ignored, as on TEI's routes.
RERANK_DOCUMENTS = Body(
    {
        "query": Field({"type": "string"}, read_query, reads_null=True, required=True),
        "documents": Field(documents_schema, read_documents, reads_null=True, required=True),
        "top_n": whole(0, MAX_TOKEN_ID),
        "return_documents": flag(True, "Each result's document, as `document.text`."),
        **TRUNCATION,
        **cut_fields("as `truncate` says"),  # vLLM's
    },
    ignore_unknown=True,
)


def similarity_body(ignore_unknown: bool) -> Body:
    """TEI's /similarity body (`ignore_unknown`: as TEI, fields it does not use are
    ignored), or the same body on the Inference API's `POST /`, which refuses unknown
    fields and parameters as it does for every task, and takes its `options`."""
    parameters_body = Body(
        {"prompt_name": PROMPT_NAME, **TRUNCATION},
        ignore_unknown=ignore_unknown,
        with_model=False,
    )

    def read_parameters(name: str, value: Any, context: DocContext | None) -> Fields:
        """`parameters`, each of them checked (400 naming it)."""
        if value is not None and not isinstance(value, dict):
            raise BadRequest(f'"{name}" must be an object')
        parameters = parameters_body.read(value or {})
        for field in parameters_body.names:
            parameters.value(field, context)
        return parameters

    def parameters_schema(context: DocContext) -> Schema:
        return {"anyOf": [parameters_body.schema(context), {"type": "null"}]}

    def read_inputs(name: str, value: Any, context: DocContext | None) -> tuple[str, list[str]]:
        return read_similarity_inputs(name, value, context, ignore_unknown)

    def inputs_schema(context: DocContext) -> Schema:
        return similarity_inputs_schema(context, ignore_unknown)

    fields = {
        "inputs": Field(inputs_schema, read_inputs, reads_null=True, required=True),
        "parameters": Field(parameters_schema, read_parameters, reads_null=True),
    }
    if not ignore_unknown:
        fields["options"] = Field({"type": ["object", "null"]})
    return Body(fields, ignore_unknown=ignore_unknown, with_model=ignore_unknown)


SIMILARITY = similarity_body(ignore_unknown=True)
INFERENCE_SIMILARITY = similarity_body(ignore_unknown=False)
TOKENIZE = Body(
    {
        "inputs": Field(texts_schema, read_texts_to_tokenize, reads_null=True, required=True),
        "add_special_tokens": flag(True),
        "prompt_name": PROMPT_NAME,
        # (TEI's lists a text whole: a client counts a document's tokens to know where to
        # cut it; `truncate: true` cuts it as the model would)
        "truncate": flag(False, "Cut inputs longer than the model takes."),
        "truncation_direction": TRUNCATION["truncation_direction"],
    },
    ignore_unknown=True,
)
DECODE = Body(
    {
        "ids": Field(ids_schema, read_ids, reads_null=True, required=True),
        "skip_special_tokens": flag(True),
    },
    ignore_unknown=True,
)


def truncation(fields: Fields) -> dict[str, Any]:
    """The worker parameters of TEI's `truncate` (default true, but on `/tokenize`;
    false: too long is 422) and `truncation_direction`."""
    return {
        "truncate": fields.value("truncate"),
        "truncation_direction": fields.value("truncation_direction").lower(),
    }


def rank_count(fields: Fields, texts: int) -> int:
    """How many ranks to answer: `top_n` (or `top_k`) best ones, else all of them."""
    given = {value for name in RANK_COUNT if (value := fields.value(name)) is not None}
    if len(given) > 1:
        raise BadRequest('"top_n" and "top_k" say different counts: send one')
    return min(given.pop(), texts) if given else texts
