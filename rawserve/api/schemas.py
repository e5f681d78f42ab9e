"""JSON Schemas (OpenAPI 3.1's dialect) of the bodies the routes read and write, for
`/openapi.json`: the shared pieces, TEI's routes and the operations routes. Each says
exactly what its route's parser takes (a schema narrower than the parser would let an
API fuzzer call a valid request invalid), as functions of the served model where a body
depends on it (its prompts, its labels, the input cap).

Plain data; server process.
"""

from __future__ import annotations

from typing import Any

from rawserve.api.routing import DocContext, Schema
from rawserve.tasks import SingleAnswer, task_rules

NULLABLE_BOOLEAN = {"type": ["boolean", "null"]}
NULLABLE_STRING = {"type": ["string", "null"]}
NUMBER = {"type": "number"}
ERROR: Schema = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "description": "Every error answer but the OpenAI routes': what went wrong, and its kind.",
}
OPENAI_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": NULLABLE_STRING,
                "code": NULLABLE_STRING,
            },
        }
    },
    "description": "The OpenAI routes' error answers: OpenAI's error object.",
}
MODEL_FIELD = {
    "type": ["string", "null"],
    "description": (
        "The served model to use, by name (see GET /v1/models); with one model served, any "
        "name; none: the first that fits the route."
    ),
}


def texts(context: DocContext) -> Schema:
    """One text, or a list of 1 to the input cap of them."""
    return {
        "oneOf": [
            {"type": "string"},
            {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                "maxItems": context.max_inputs,
            },
        ]
    }


def details(context: DocContext) -> dict[str, Any]:
    loaded = context.model.serving.loaded
    return dict(loaded.details) if loaded else {}


def request_object(properties: dict[str, Any], required: tuple[str, ...]) -> Schema:
    return {
        "type": "object",
        "required": list(required),
        "properties": {**properties, "model": MODEL_FIELD},
        "additionalProperties": False,
    }


# --- TEI ----------------------------------------------------------------------------------

TRUNCATION = {
    "truncate": {
        **NULLABLE_BOOLEAN,
        "default": False,
        "description": "Cut inputs longer than the model takes (else: 422).",
    },
    "truncation_direction": {"enum": ["left", "right", "Left", "Right", None], "default": "right"},
}


def prompt_name(context: DocContext) -> Schema:
    prompts = sorted(details(context).get("prompts", {}))
    return {
        "enum": [*prompts, None],
        "description": "A prompt of the model's sentence-transformers configuration, put "
        "before each input.",
    }


def tei_embed_request(context: DocContext) -> Schema:
    dimensions = details(context).get("dimensions") or 65536
    return request_object(
        {
            "inputs": texts(context),
            "normalize": {**NULLABLE_BOOLEAN, "default": True},
            "prompt_name": prompt_name(context),
            "dimensions": {"type": ["integer", "null"], "minimum": 1, "maximum": dimensions},
            **TRUNCATION,
        },
        ("inputs",),
    )


def tei_embed_all_request(context: DocContext) -> Schema:
    return request_object(
        {"inputs": texts(context), "prompt_name": prompt_name(context), **TRUNCATION},
        ("inputs",),
    )


VECTOR = {"type": "array", "items": NUMBER}
TEI_EMBED_RESPONSE: Schema = {"type": "array", "items": VECTOR}
TEI_EMBED_ALL_RESPONSE: Schema = {"type": "array", "items": {"type": "array", "items": VECTOR}}


def tei_predict_request(context: DocContext) -> Schema:
    one_or_pair = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}
    return request_object(
        {
            "inputs": {
                "oneOf": [
                    {"type": "string"},
                    {**one_or_pair, "description": "a text, or a pair of texts"},
                    {
                        "type": "array",
                        "items": one_or_pair,
                        "minItems": 1,
                        "maxItems": context.max_inputs,
                        "description": "a batch of [text] and [text, text]",
                    },
                ]
            },
            "raw_scores": {**NULLABLE_BOOLEAN, "default": False},
            **TRUNCATION,
        },
        ("inputs",),
    )


PREDICTION = {
    "type": "object",
    "required": ["label", "score"],
    "properties": {"label": {"type": "string"}, "score": NUMBER},
}
TEI_PREDICT_RESPONSE: Schema = {
    "anyOf": [
        {"type": "array", "items": PREDICTION},
        {"type": "array", "items": {"type": "array", "items": PREDICTION}},
    ]
}


def tei_rerank_request(context: DocContext) -> Schema:
    return request_object(
        {
            "query": {"type": "string"},
            "texts": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                "maxItems": context.max_inputs,
            },
            "raw_scores": {**NULLABLE_BOOLEAN, "default": False},
            "return_text": {**NULLABLE_BOOLEAN, "default": False},
            **TRUNCATION,
        },
        ("query", "texts"),
    )


TEI_RERANK_RESPONSE: Schema = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["index", "score"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "score": NUMBER,
            "text": {"type": "string"},
        },
    },
}


def tei_tokenize_request(context: DocContext) -> Schema:
    return request_object(
        {
            "inputs": texts(context),
            "add_special_tokens": {**NULLABLE_BOOLEAN, "default": True},
            "prompt_name": prompt_name(context),
        },
        ("inputs",),
    )


TEI_TOKENIZE_RESPONSE: Schema = {
    "type": "array",
    "items": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["id", "text", "special", "start", "stop"],
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "text": {"type": "string"},
                "special": {"type": "boolean"},
                "start": {"type": ["integer", "null"], "minimum": 0},
                "stop": {"type": ["integer", "null"], "minimum": 0},
            },
        },
    },
}
TOKEN_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
    "minItems": 1,
}


def tei_decode_request(context: DocContext) -> Schema:
    return request_object(
        {
            "ids": {
                "oneOf": [
                    TOKEN_IDS,
                    {
                        "type": "array",
                        "items": TOKEN_IDS,
                        "minItems": 1,
                        "maxItems": context.max_inputs,
                    },
                ]
            },
            "skip_special_tokens": {**NULLABLE_BOOLEAN, "default": True},
        },
        ("ids",),
    )


TEI_DECODE_RESPONSE: Schema = {"type": "array", "items": {"type": "string"}}


# --- POST / (the Inference API's shapes, per task) -----------------------------------------


def inference_request(context: DocContext) -> Schema:
    """`{"inputs": X, "parameters": {...}}` as the served task takes it."""
    task = task_rules(context.model.task or "")
    if task is None:  # a custom handler takes any JSON input and any parameters
        return {
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "inputs": {"not": {"type": "array", "maxItems": 0}},
                "parameters": {"type": ["object", "null"]},
                "options": {},
            },
            "additionalProperties": False,
        }
    item = task.check_input.schema
    params = {
        name: {"anyOf": [check.schema, {"type": "null"}]} for name, check in task.params.items()
    }
    properties: dict[str, Any] = {
        "inputs": {
            "oneOf": [
                item,
                {"type": "array", "items": item, "minItems": 1, "maxItems": context.max_inputs},
            ]
        },
        "parameters": {
            "type": ["object", "null"],
            "properties": params,
            "required": sorted(task.required_params),
            "additionalProperties": False,
        },
        "options": {"description": "accepted and ignored (the Inference API's options)"},
    }
    if task.params_at_root:  # InferenceClient sends these beside "inputs"
        properties.update(params)
    if "stream" in task.extra_fields:
        properties["stream"] = {
            **NULLABLE_BOOLEAN,
            "description": "answer text/event-stream, a token an event (one input only)",
        }
    required = ["inputs", *(["parameters"] if task.required_params else [])]
    return {
        "description": f"{task.name}: one input or a list, and the task's parameters",
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
    }


def inference_response(context: DocContext) -> Schema:
    """The answer to one input, or the list of answers to a list of inputs."""
    task = task_rules(context.model.task or "")
    if task is None:
        return {"description": "what the handler answers"}
    item = task.output_schema
    single: Schema
    if task.single_answer == SingleAnswer.LIST:
        single = {"type": "array", "items": item, "minItems": 1, "maxItems": 1}
    elif task.single_answer == SingleAnswer.LIST_OF_LISTS:
        single = {"type": "array", "items": {"type": "array"}, "minItems": 1, "maxItems": 1}
    else:
        single = item
    return {
        "description": f"{task.name}: the answer to one input, or a list of them",
        "anyOf": [single, {"type": "array", "items": item}],
    }


# --- operations and /v1 -------------------------------------------------------------------

STATUS: Schema = {
    "type": "object",
    "required": ["status"],
    "properties": {
        "status": {"type": "string"},
        "task": {"type": ["string", "null"]},
        "elapsed_seconds": NUMBER,
    },
}
INFO: Schema = {
    "type": "object",
    "required": ["task", "ready", "batching", "workers", "model_id", "max_client_batch_size"],
    "properties": {
        "task": {"type": ["string", "null"]},
        "ready": {"type": "boolean"},
        "batching": {"type": "object"},
        "workers": {"type": "array", "items": {"type": "object"}},
        "model_id": {"type": "string"},
        "max_input_length": {"type": "integer", "minimum": 0},
        "max_client_batch_size": {"type": "integer", "minimum": 1},
        "model_type": {"type": "object"},
    },
}
MODELS_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
            },
        },
    },
}
TEXT: Schema = {"type": "string"}
DOCUMENT: Schema = {"type": "object", "required": ["openapi", "paths"]}


def openai_embeddings_request(context: DocContext) -> Schema:
    return request_object(
        {
            "input": texts(context),
            "encoding_format": {"enum": ["float", "base64", None], "default": "float"},
            "dimensions": {"type": ["integer", "null"], "minimum": 1},
            "user": NULLABLE_STRING,
        },
        ("input",),
    )


USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
OPENAI_EMBEDDINGS_RESPONSE: Schema = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer", "minimum": 0},
                    "embedding": {"anyOf": [VECTOR, {"type": "string"}]},
                },
            },
        },
        "model": {"type": "string"},
        "usage": USAGE,
    },
}


def generation_events(context: DocContext) -> Schema | None:
    """An event of a streamed text-generation answer (TGI's shape); None for other tasks."""
    if context.model.task != "text-generation":
        return None
    return {
        "type": "object",
        "required": ["index", "token", "generated_text", "details"],
        "properties": {
            "index": {"type": "integer"},
            "token": {"type": ["object", "null"]},
            "generated_text": NULLABLE_STRING,
            "details": {"type": ["object", "null"]},
        },
    }


# --- OpenAI generation --------------------------------------------------------------------

GENERATION_FIELDS: dict[str, Any] = {
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 4096},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 100},
    "stop": {
        "anyOf": [
            {"type": "null"},
            {"type": "string", "minLength": 1, "maxLength": 200},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 200},
                "maxItems": 16,
            },
        ]
    },
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**32 - 1},
    "stream": NULLABLE_BOOLEAN,
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": NULLABLE_BOOLEAN},
        "additionalProperties": False,
        "description": 'only with "stream": true',
    },
    "n": {"enum": [1, None], "description": "one choice per request"},
    "user": NULLABLE_STRING,
    "frequency_penalty": {"enum": [0, None]},
    "presence_penalty": {"enum": [0, None]},
    "logit_bias": {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]},
}
TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "additionalProperties": False,
}
MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART, "minItems": 1}]
        },
        "name": {"type": "string"},
        "tool_calls": {"type": "null"},
    },
    "additionalProperties": False,
}


def openai_chat_request(context: DocContext) -> Schema:
    return request_object(
        {
            "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
            **GENERATION_FIELDS,
            "max_completion_tokens": GENERATION_FIELDS["max_tokens"],
            "logprobs": {"enum": [False, None]},
            "top_logprobs": {"type": "null"},
            "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
            "functions": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
            "tool_choice": {"enum": ["none", None]},
            "function_call": {"enum": ["none", None]},
            "parallel_tool_calls": NULLABLE_BOOLEAN,
            "response_format": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"const": "text"}},
                        "additionalProperties": False,
                    },
                ]
            },
        },
        ("messages",),
    )


def openai_completion_request(context: DocContext) -> Schema:
    prompt = {"type": "string", "minLength": 1}
    return request_object(
        {
            "prompt": {
                "oneOf": [
                    prompt,
                    {
                        "type": "array",
                        "items": prompt,
                        "minItems": 1,
                        "maxItems": context.max_inputs,
                    },
                ]
            },
            **GENERATION_FIELDS,
            "echo": {"enum": [False, None]},
            "suffix": {"type": "null"},
            "logprobs": {"type": "null"},
            "best_of": {"enum": [1, None]},
        },
        ("prompt",),
    )


FINISH = {"enum": ["stop", "length"]}
GENERATION_USAGE = {**USAGE, "required": ["prompt_tokens", "completion_tokens", "total_tokens"]}


def completion_object(kind: str, choice: Schema, with_usage: bool = True) -> Schema:
    required = ["id", "object", "created", "model", "choices"]
    return {
        "type": "object",
        "required": [*required, *(["usage"] if with_usage else [])],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": GENERATION_USAGE,
        },
    }


OPENAI_CHAT_RESPONSE = completion_object(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
            },
            "finish_reason": FINISH,
        },
    },
)
OPENAI_COMPLETION_RESPONSE = completion_object(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "finish_reason": FINISH,
        },
    },
)
OPENAI_CHAT_CHUNK = completion_object(
    "chat.completion.chunk",
    {
        "type": "object",
        "required": ["index", "delta", "finish_reason"],
        "properties": {
            "delta": {"type": "object"},
            "finish_reason": {**FINISH, "enum": ["stop", "length", None]},
        },
    },
    with_usage=False,
)
OPENAI_COMPLETION_CHUNK = completion_object(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {
            "text": {"type": "string"},
            "finish_reason": {"enum": ["stop", "length", None]},
        },
    },
    with_usage=False,
)
