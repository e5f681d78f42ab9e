"""What a chat template surely adds to a prompt, measured once at load and reported with
the worker's details, so that the server counts it before a chat is queued
(rawserve.api.prompts): the tokens of each message's turn, whether the chat's tools
reach the model as their functions' JSON, and the roles whose texts it writes.

Counted by the messages' texts alone, a chat of 31,000 empty messages was nothing to the
server, and 128 large tools too: the template made them 217,008 and 575,225 tokens, which
only the worker found, after seconds of rendering that stalled every stream beside them.
Both measures are lower bounds, never more than what a template writes: a prompt that
fits must never be refused.

Worker process only: it renders with the runner's own template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

# the roles a chat's messages reach the worker with (a `function` message comes as `tool`)
MEASURED_ROLES = ("system", "developer", "user", "assistant", "tool")
# a tool whose JSON a template that shows tools as JSON writes as it is
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "probe_weather",
        "description": "The weather at a place",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        },
    },
}
WHITESPACE = re.compile(r"\s+")
# a chat (and its tools) rendered as the worker renders it
ChatText = Callable[[list[dict[str, Any]], list[Any]], str]
# alternating messages of a user and answers, more than a template that keeps only the
# last few of a chat writes (a tester's kept the last four, then sixteen)
PROBE_TURNS = 64


def message_tokens(prompt_ids: Callable[[list[dict[str, Any]]], list[int]]) -> int:
    """The fewest tokens the template adds for one more message with empty content, of any
    role, after the first message and at the end of the chat (`prompt_ids`: a chat's ids
    as the worker renders it). Not the first: a first system message may take the place
    of a default one (Qwen2.5's), so costs less. A role the template refuses in every
    place measured is left out (its chats are refused by the template), 0 where none
    renders. A template that adds the same turn to each message costs each that much
    wherever it stands; one that groups a run of messages of a role (Qwen's, of tool
    answers) costs the second of the run less than the first, measured too (counted at
    a turn each, 60 tool answers of 83 tokens were refused as longer than 255)."""
    user = {"role": "user", "content": ""}
    after_answer = [user, {"role": "assistant", "content": ""}]
    costs = []
    for role in MEASURED_ROLES:
        message = probe_message(role, "")
        for before in ([user], after_answer, [user, message], [*after_answer, message]):
            try:
                costs.append(len(prompt_ids([*before, message])) - len(prompt_ids(before)))
            except ValueError:  # the template refuses that role there
                continue
    return max(0, min(costs, default=0))


def probe_message(role: str, content: str) -> dict[str, Any]:
    """A message of `role` for a probe chat; a tool's answers `PROBE_TOOL`'s call (templates
    that pair an answer with its call read its id)."""
    message = {"role": role, "content": content}
    if role == "tool":
        message.update(tool_call_id="probe0000", name=PROBE_TOOL["function"]["name"])
    return message


def rendered_roles(chat_text: ChatText) -> list[str]:
    """The roles whose messages' texts the template writes wherever they stand (`chat_text`:
    a chat rendered as the worker renders it), for the server to count those alone: none
    where it leaves out some of `PROBE_TURNS` messages of users and answers (one that keeps
    the last few: every message's turn and text counted, a chat that fitted was refused);
    a role it leaves out (Phi-3's first template wrote no system message), or refuses, is
    not counted."""
    turns = [
        {"role": ("user", "assistant")[index % 2], "content": f"zqprobe{index}"}
        for index in range(PROBE_TURNS)
    ]
    try:
        if not shows_all(chat_text, turns):
            return []
    except ValueError:
        return []
    roles = ["user", "assistant"]
    for role in MEASURED_ROLES:
        if role in roles:
            continue
        message = probe_message(role, f"zqprobe{role}")
        places = [[*turns[:2], message, *turns[2:]]]  # after an answer
        if role != "tool":
            places.append([message, *turns])  # first
        shown = []
        for chat in places:
            try:
                shown.append(shows_all(chat_text, chat))
            except ValueError:  # refused there: such chats fail in the template
                continue
        if shown and all(shown):
            roles.append(role)
    return roles


def writes_parts(chat_text: ChatText) -> bool:
    """Whether the template writes a message whose content is OpenAI's list of parts (one
    may write string contents alone)."""
    message = {"role": "user", "content": [{"type": "text", "text": "zqprobeparts"}]}
    try:
        return "zqprobeparts" in chat_text([message], [])
    except ValueError:
        return False


def shows_all(chat_text: ChatText, chat: list[dict[str, Any]]) -> bool:
    rendered = chat_text(chat, [])
    return all(message["content"] in rendered for message in chat)


def renders_tools_as_json(chat_text: ChatText) -> bool:
    """Whether a chat's tools reach the model as their functions' JSON (`chat_text`: a
    chat with tools rendered as the worker renders it): the template writes each tool so
    (Qwen's, Llama 3.1's, Mistral's), or leaves tools out and the worker describes them
    so. Spaces and indents aside: the server counts the JSON at its most compact."""
    try:
        rendered = chat_text([{"role": "user", "content": "hi"}], [PROBE_TOOL])
    except ValueError:
        return False
    function = json.dumps(PROBE_TOOL["function"], ensure_ascii=False)
    return WHITESPACE.sub("", function) in WHITESPACE.sub("", rendered)
