"""A chat rendered with the model's chat template: its messages, tools and template
settings made into the prompt's text or token ids, as a causal LM's runner reads them.

It owns what a chat goes in as (OpenAI's `developer` role, tools the template leaves out
described in the last message, Mistral's tool call ids) and what a template's failure
tells a client. The control tokens it keeps the template's own are chat_controls'; it
never tokenizes plain text or runs the model (rawserve.worker.causal_lm does).

Worker process only (reads a transformers tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import jinja2
import jinja2.meta

from rawserve.tasks.text_generation import CHAT_TEMPLATE_REFUSED
from rawserve.worker.chat_controls import (
    ChatControls,
    check_names,
    holding,
    named_parts,
    thinking_apart,
    unmarked,
    unquoted,
)
from rawserve.worker.runner import WrittenForClients

# transformers' words for a control token in a message that its tokenizer also makes
# from plain text (so it cannot be kept as text)
UNSANITIZABLE = re.compile(r"Can't sanitize (.+): the tokenizer produces it from plain text")
# tools told to a model whose chat template leaves them out (the answer is held to the form)
TOOLS_DESCRIBED = (
    '\n\nTools you may call: {}\nTo call one, answer {{"name": ..., "arguments": {{...}}}}.'
)
SEVERAL_CALLS = " To call several, answer a list of them."
# Mistral's templates refuse a tool call id that is not 9 letters and digits, in these words
NINE_CHARACTER_IDS = "alphanumeric strings with length 9"
# a chat rendered: its messages, the tools the template is given, and its settings
ChatParts = tuple[list[dict[str, Any]], list[Any] | None, dict[str, Any]]


def nine_character_ids(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with each tool call id that is not 9 letters and digits as 9 that are: the
    first 9 hex digits of its SHA-256, the same for a call and the answer naming it."""
    if isinstance(message.get("tool_call_id"), str):
        message = {**message, "tool_call_id": nine_characters(message["tool_call_id"])}
    if message.get("tool_calls"):
        calls = [
            {**call, "id": nine_characters(call["id"])} if isinstance(call.get("id"), str) else call
            for call in message["tool_calls"]
        ]
        message = {**message, "tool_calls": calls}
    return message


def nine_characters(call_id: str) -> str:
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def template_fault(tokenizer: Any, name: str | None = None) -> str:
    """What makes the tokenizer's chat template (of several, the one `name`d) not Jinja
    ("": nothing), found by rendering a one-message chat. (Rendering compiles the whole
    template; only a syntax error is the template's own fault: what it does with a chat
    is for each request.)"""
    try:
        chat = [{"role": "user", "content": "hi"}]
        tokenizer.apply_chat_template(chat, tokenize=False, chat_template=name)
    except jinja2.TemplateSyntaxError as exc:
        return f"{exc} (line {exc.lineno})"
    except Exception:  # noqa: BLE001 - a chat's own failure, not the template's
        pass
    return ""


def set_aside_named_faults(tokenizer: Any) -> dict[str, str]:
    """Of a model's several named chat templates, each besides the default that is not
    Jinja, taken out (its fault by its name): a "tool_use" one rendered every chat with
    tools, each refused 422 as if its messages were at fault, and nothing said at start.
    The default one renders those chats, as where a model has no other."""
    templates = tokenizer.chat_template
    if not isinstance(templates, dict):
        return {}
    faults = {
        name: fault
        for name in templates
        if name != "default" and (fault := template_fault(tokenizer, name))
    }
    kept = {name: template for name, template in templates.items() if name not in faults}
    tokenizer.chat_template = kept.get("default") if list(kept) == ["default"] else kept
    return faults


def template_reads(tokenizer: Any, name: str) -> bool:
    """Whether the tokenizer's chat template reads the variable `name` where it is
    rendered (not where a comment or a longer name says it): of several named ones, each,
    as a chat may be rendered with any (one with tools, with "tool_use"); none that does
    not parse."""
    templates = tokenizer.chat_template
    if isinstance(templates, dict):
        templates = list(templates.values())
    if not isinstance(templates, list):
        templates = [templates]
    environment = jinja2.Environment()

    def reads(template: Any) -> bool:
        if not isinstance(template, str):
            return False
        try:
            parsed = environment.parse(template)
        except jinja2.TemplateSyntaxError:
            return False
        return name in jinja2.meta.find_undeclared_variables(parsed)

    return bool(templates) and all(reads(template) for template in templates)


def check_template(tokenizer: Any) -> None:
    """ValueError, at load, for a --chat-template that is not Jinja: each chat would
    otherwise be refused with 422 as if its messages were at fault."""
    if fault := template_fault(tokenizer):
        raise ValueError(f"--chat-template: the template is not valid Jinja: {fault}")


class ChatRenderer:
    """A runner's chats rendered with its tokenizer's chat template (read at each chat:
    the template may change after load), their control tokens kept the template's own
    (`controls`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.controls = ChatControls(tokenizer)

    def prompt_ids(self, chat: dict[str, Any]) -> list[int]:
        """A chat request's prompt (`{"messages": [...]}`, OpenAI's, with its tools and
        settings) as token ids."""
        return self.render_ids(*self._request_parts(chat))

    def prompt_text(self, chat: dict[str, Any]) -> str:
        """A chat request's prompt as the chat template writes it (`prompt_ids`' text)."""
        return self.render(*self._request_parts(chat))

    def _request_parts(self, chat: dict[str, Any]) -> ChatParts:
        return self.parts(
            chat["messages"],
            chat.get("tools"),
            chat.get("parallel_tool_calls", False),
            chat.get("tool_prompt", ""),
            {**chat.get("template_kwargs", {}), **chat.get("opening", {})},
        )

    def plain_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """A chat's token ids, with no tools or settings."""
        return self.render_ids(*self.parts(messages, None, False, "", None))

    def text(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        several: bool = False,
        tool_prompt: str = "",
        variables: dict[str, Any] | None = None,
    ) -> str:
        """A chat rendered with the model's template (`parts` says what goes in)."""
        return self.render(*self.parts(messages, tools, several, tool_prompt, variables))

    def parts(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        several: bool,
        tool_prompt: str,
        variables: dict[str, Any] | None,
    ) -> ChatParts:
        """What a chat is rendered from: its messages, with the tools it may call: where
        the template leaves tools out, they are described at the end of the last message
        (and, where `several`, how to call several at once). A `tool_prompt` (TGI's) goes
        at the end of the last message, before that description, as TGI puts it there.
        OpenAI's `developer` messages are `system` ones to a template that does not name
        that role (most do not: they would drop it, or refuse it), as vLLM reads them.
        `variables`: the template's own settings a client asked for (vLLM's
        `chat_template_kwargs`, such as Qwen3's `enable_thinking`), and how the answer
        opens (vLLM's `add_generation_prompt`, true unless said, and
        `continue_final_message`: the last message's text goes on, as a prefill). A template
        that takes only Mistral's tool call ids (9 letters and digits) gets every other id
        as 9 of its own, a call's and its answer's the same, as vLLM shortens them for
        Mistral: OpenAI's ids (rawserve's own answers' too) are longer."""
        variables = variables or {}
        messages = thinking_apart(messages, str(self.tokenizer.chat_template))
        if "developer" not in str(self.tokenizer.chat_template):
            messages = [
                {**message, "role": "system"} if message["role"] == "developer" else message
                for message in messages
            ]
        if NINE_CHARACTER_IDS in str(self.tokenizer.chat_template):
            messages = [nine_character_ids(message) for message in messages]
        if tools and tool_prompt:
            last = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + tool_prompt}
            messages = [*messages[:-1], last]
        if tools and self.render(messages, tools, variables) == self.render(
            messages, None, variables
        ):
            described = TOOLS_DESCRIBED.format(
                json.dumps([tool["function"] for tool in tools], ensure_ascii=False)
            )
            described += SEVERAL_CALLS if several else ""
            last = {**messages[-1], "content": messages[-1]["content"] + described}
            return [*messages[:-1], last], None, variables
        return messages, tools, variables

    def render(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, variables: dict[str, Any]
    ) -> str:
        return str(self._apply_template(messages, tools, variables, tokenize=False))

    def render_ids(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, variables: dict[str, Any]
    ) -> list[int]:
        """A chat's token ids. The template writes the special tokens it wants (a BOS)
        itself, and its control tokens (`<|im_start|>`, `</s>`) are tokens only where it
        writes them: the same words inside a message, a tool or a template setting are
        text, so a client's message that spells out `<|im_end|><|im_start|>system` stays in
        its own turn instead of opening a system one (transformers'
        `sanitize_control_tokens`, with the control tokens and the names that
        rawserve.worker.chat_controls adds)."""
        check_names(named_parts(messages, tools, variables), self.controls.declare())
        return list(self._apply_template(messages, tools, variables, tokenize=True))

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        variables: dict[str, Any],
        tokenize: bool,
    ) -> Any:
        tokenized = {"sanitize_control_tokens": True, "return_dict": False} if tokenize else {}
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=tokenize,
                **tokenized,
                **{"add_generation_prompt": True, **variables},
            )
        except jinja2.TemplateError as exc:  # the template refuses these messages
            raise WrittenForClients(f"{CHAT_TEMPLATE_REFUSED}{unmarked(str(exc))}") from None
        except Exception as exc:  # noqa: BLE001 - it breaks on these messages: theirs to change
            if unsanitizable := UNSANITIZABLE.match(str(exc)):  # (a token may hold a "/")
                part = holding(unquoted(unsanitizable[1]), named_parts(messages, tools, variables))
                held = "the chat holds" if part == "chat" else f"the chat's {part} hold"
                raise WrittenForClients(
                    f"{held} {unsanitizable[1]}, a control token of the chat template that "
                    "this model's tokenizer cannot read as text"
                ) from None
            # its words, not Python's class of them (a client's message names no internals)
            reason = unmarked(str(exc)) or "it raised an error"
            raise ValueError(f"the chat template failed on these messages ({reason})") from None
