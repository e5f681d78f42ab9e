"""JSON Schemas (OpenAPI 3.1's dialect) of what the routes answer, for `/openapi.json`:
TEI's answers, `POST /`'s per task, the OpenAI answers and stream chunks, the operations
routes', and the error body. Request bodies are not here: each is declared once, with its
checks, as a `fields.Body` beside the route that reads it.

Plain data; server process.
"""

from __future__ import annotations

from rawserve.api.routing import DocContext, Schema
from rawserve.tasks import SingleAnswer, task_rules

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
# --- TEI ----------------------------------------------------------------------------------

VECTOR = {"type": "array", "items": NUMBER}
TEI_EMBED_RESPONSE: Schema = {"type": "array", "items": VECTOR}
TEI_EMBED_ALL_RESPONSE: Schema = {"type": "array", "items": {"type": "array", "items": VECTOR}}
SPARSE_VALUE = {
    "type": "object",
    "required": ["index", "value"],
    "properties": {"index": {"type": "integer", "minimum": 0}, "value": NUMBER},
}
# per input, its vocabulary's words of nonzero weight, by id (TEI's EmbedSparseResponse)
TEI_EMBED_SPARSE_RESPONSE: Schema = {
    "type": "array",
    "items": {"type": "array", "items": SPARSE_VALUE},
}


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


TEI_SIMILARITY_RESPONSE: Schema = {
    "type": "array",
    "items": NUMBER,
    "description": "each sentence's cosine similarity to the source sentence, in order",
}


def ranked(score: str, text: str, text_schema: Schema) -> Schema:
    """A list of ranks, each with its text's index, its score as `score` and, when asked,
    the text as `text`."""
    rank = {
        "type": "object",
        "required": ["index", score],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            score: NUMBER,
            text: text_schema,
        },
    }
    return {"type": "array", "items": rank}


TEI_RERANK_RESPONSE = ranked("score", "text", {"type": "string"})
RANKED_TEXT = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
RERANK_DOCUMENTS_RESPONSE: Schema = {
    "type": "object",
    "required": ["id", "model", "usage", "results"],
    "properties": {
        "id": {"type": "string"},
        "model": {"type": "string"},
        "usage": USAGE,
        "results": ranked("relevance_score", "document", RANKED_TEXT),
    },
}


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
TEI_DECODE_RESPONSE: Schema = {"type": "array", "items": {"type": "string"}}


# --- POST / (the Inference API's shapes, per task) -----------------------------------------


def inference_response(context: DocContext) -> Schema:
    """The answer to one input, or the list of answers to a list of inputs."""
    task = task_rules(context.model.known_task or "")
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
        "models": {"type": "object", "additionalProperties": {"type": "string"}},  # several
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
MODEL: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}
MODELS_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}},
}
TEXT: Schema = {"type": "string"}
DOCUMENT: Schema = {"type": "object", "required": ["openapi", "paths"]}


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
    if context.model.known_task != "text-generation":
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

FINISH = {"enum": ["stop", "length"]}
# a chat's answer may end in the tools' calls (OpenAI's older functions: one call)
CHAT_FINISH = {"enum": ["stop", "length", "tool_calls", "function_call"]}
CALLED = {
    "type": "object",
    "required": ["name", "arguments"],
    "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
}
TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {"id": {"type": "string"}, "type": {"const": "function"}, "function": CALLED},
}
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
            # (a stream's chunks carry null, but its last with `include_usage`)
            "usage": GENERATION_USAGE
            if with_usage
            else {"anyOf": [GENERATION_USAGE, {"type": "null"}]},
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
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                    # a reasoning model's thinking (its content null where it never closed)
                    "reasoning_content": {"type": ["string", "null"]},
                    "reasoning": {"type": ["string", "null"]},  # (the same, newer vLLM's name)
                    "tool_calls": {"type": "array", "items": TOOL_CALL},
                    "function_call": CALLED,
                },
            },
            "finish_reason": CHAT_FINISH,
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
            "finish_reason": {"enum": [*CHAT_FINISH["enum"], None]},
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
