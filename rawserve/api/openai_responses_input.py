"""OpenAI's Responses API's `input`, read into a chat's messages (as `openai_messages`
reads chat's, for the chat template): a text is the user's message; each message's content
a text or text parts (an earlier answer's `output_text`, an assistant's refusal the text it
answered), joined; an earlier answer's `reasoning` item the next assistant message's
`reasoning_content`. What is not a text message (images, files, function calls and their
outputs) is refused with 400 naming the item and its field, as OpenAI's are
(`input[0].content[1].type`). The rest of the Responses body is `openai_responses`'s.
Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rawserve.api.fields import unicode_text
from rawserve.api.openai_generation import SHOWN_CHARS, shown
from rawserve.api.openai_messages import CACHE_BREAKPOINT
from rawserve.api.routing import DocContext
from rawserve.http.errors import BadRequest

ROLES = ("user", "assistant", "system", "developer")
# the text parts a message's content may hold: the client's, and an earlier answer's
# (sent back as the SDK dumps an output item)
PART_KEYS = {
    "input_text": {"type", "text", CACHE_BREAKPOINT},
    "output_text": {"type", "text", "annotations", "logprobs", CACHE_BREAKPOINT},
    # an assistant's refusal is the text it answered, as chat takes it
    "refusal": {"type", "refusal"},
}
# (an earlier answer's `id`, `status` and `phase`, null or OpenAI's "commentary" or
# "final_answer", come back with it and are dropped)
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
# the input items served: messages, and an earlier answer's thinking sent back
ITEM_TYPES = ("message", "reasoning")
# an earlier answer's reasoning item, sent back as the SDK dumps it
REASONING_ITEM_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}
THOUGHT_PARTS = ("reasoning_text", "summary_text")
INPUT_HELP = (
    '"input" must be a text or a non-empty list of messages {"role", "content"}, each '
    'content a text or a list of {"type": "input_text", "text"} parts (this server serves '
    "text messages only: no images, files or function call outputs)"
)
TEXT_ONLY = "this server serves text messages only: no images, files, tool calls or their outputs"
# what a client used to Chat Completions sends, and what it is here
CHAT_HABITS = {
    "tool": 'a tool\'s output is a "function_call_output" item, which this server does not serve',
    "text": 'Chat Completions\' "text" part is "input_text" here',
}


def read_input(name: str, value: Any, context: DocContext | None) -> list[dict[str, str]]:
    """`input` as a chat's messages: a text is the user's. A malformed item is refused
    naming it and its field (`param` "input[0].content[1].type"), as OpenAI's are."""
    if value is None:
        raise BadRequest(f'"{name}" is required')
    if isinstance(value, str):
        return [{"role": "user", "content": unicode_text(value, '"input"')}]
    if not isinstance(value, list) or not value:
        raise BadRequest(INPUT_HELP)
    messages: list[dict[str, str]] = []
    thought: str | None = None  # a reasoning item's text, for the assistant message after it
    for index, item in enumerate(value):
        at = f"{name}[{index}]"
        if isinstance(item, dict) and item.get("type") == "reasoning":
            thought = reasoning_input(item, at)
            continue
        message = input_message(item, at)
        if thought is not None and message["role"] == "assistant":
            message["reasoning_content"] = thought
        thought = None
        messages.append(message)
    if not messages:
        raise BadRequest(INPUT_HELP)
    return messages


def reasoning_input(item: dict[str, Any], at: str) -> str:
    """An earlier answer's thinking, sent back as a `reasoning` item (`at` in the input):
    its `reasoning_text` parts, else its summary's texts."""
    content = [] if item.get("content") is None else item["content"]
    summary = [] if item.get("summary") is None else item["summary"]
    parts = content or summary
    if (
        not set(item) <= REASONING_ITEM_KEYS
        or not isinstance(content, list)
        or not isinstance(summary, list)
        or not all(
            isinstance(part, dict)
            and part.get("type") in THOUGHT_PARTS
            and isinstance(part.get("text"), str)
            and set(part) == {"type", "text"}
            for part in parts
        )
    ):
        raise BadRequest(
            f'"{at}", a "reasoning" input item, must be {{"type": "reasoning", "summary": '
            '[...], "content": [{"type": "reasoning_text", "text"}]}, as an answer gave it',
            param=at,
        )
    return "".join(unicode_text(part["text"], f'"{at}"') for part in parts)


def input_message(item: Any, at: str) -> dict[str, str]:
    """One message of the input (`at`: where, as "input[2]"), its content's parts joined."""
    if not isinstance(item, dict):
        raise BadRequest(f'"{at}" must be a message {{"role", "content"}}', param=at)
    if (kind := item.get("type", "message")) != "message":
        raise invalid(f"{at}.type", kind, ITEM_TYPES, TEXT_ONLY)
    refuse_unknown(item, MESSAGE_KEYS, at, "a message")
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{at}.role", role, ROLES, habit(role, ""))
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": unicode_text(content, f'"{at}.content"')}
    if not isinstance(content, list) or not content:
        where = f"{at}.content"
        raise BadRequest(f'"{where}" must be a text or a non-empty list of text parts', param=where)
    texts = [part_text(part, role, f"{at}.content[{index}]") for index, part in enumerate(content)]
    return {"role": role, "content": "".join(texts)}


def part_text(part: Any, role: str, at: str) -> str:
    """The text of one part of a `role`'s message (`at`: where, as "input[0].content[1]")."""
    if not isinstance(part, dict):
        raise BadRequest(f'"{at}" must be a part {{"type": "input_text", "text"}}', param=at)
    kind = part.get("type")
    taken = [one for one in PART_KEYS if one != "refusal" or role == "assistant"]
    if kind not in taken:
        why = "only an assistant's message holds a refusal" if kind == "refusal" else TEXT_ONLY
        raise invalid(f"{at}.type", kind, taken, habit(kind, why))
    refuse_unknown(part, PART_KEYS[kind], at, f'a "{kind}" part')
    key = "refusal" if kind == "refusal" else "text"
    if not isinstance(text := part.get(key), str):
        said = "missing" if text is None else shown(text)
        raise BadRequest(f'"{at}.{key}" must be a text (it is {said})', param=f"{at}.{key}")
    return unicode_text(text, f'"{at}.{key}"')


def invalid(at: str, value: Any, supported: Sequence[str], why: str = "") -> BadRequest:
    """A 400 for the field `at` (as "input[0].role") holding `value`, or missing (None),
    where it takes one of `supported`."""
    listed = ", ".join(f'"{one}"' for one in supported)
    said = "is missing" if value is None else f"is {shown(value)}"
    because = f" ({why})" if why else ""
    return BadRequest(f'"{at}" {said}: it takes {listed}{because}', param=at)


def refuse_unknown(item: dict[str, Any], allowed: set[str], at: str, what: str) -> None:
    """A 400 naming the first field of `item` (`at`) that is none of `allowed`."""
    unknown = sorted(str(key)[:SHOWN_CHARS] for key in set(item) - allowed)
    if unknown:
        where = f"{at}.{unknown[0]}"
        listed = ", ".join(f'"{one}"' for one in sorted(allowed))
        raise BadRequest(f'unknown field "{where}": {what} takes {listed}', param=where)


def habit(value: Any, otherwise: str) -> str:
    """What `value` is here, where it is a Chat Completions habit; else `otherwise`."""
    return CHAT_HABITS.get(value, otherwise) if isinstance(value, str) else otherwise
