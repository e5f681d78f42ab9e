"""text-generation on a causal LM: batched `generate` with left padding, stop sequences,
and token streaming.

Worker process only (imports torch and transformers). One `TokenWatcher` (with the
other hooks a `generate` call is given, in generate_hooks) runs after every decoding
step: it turns each row's new token into text, ends rows that produced a stop sequence,
hands tokens to a streamed request's sink, and stops everything when the server says
the stream's client has gone (a shared integer, checked once a step); under a model's beam
search it follows `generate`'s answers once it is done (beam_search). This module holds
the runner: prompts (a chat's rendered by its `ChatRenderer`, in chat_rendering), the
settings of each request, the answer's shape, and the items it hands the continuous loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch
import transformers

from rawserve.shared.messages import NO_CONTROL, Control, ModelLimits, TokenChunk
from rawserve.shared.token_columns import columns, token_lists
from rawserve.tasks import CHAT_PARAM, check_new_tokens
from rawserve.tasks.text_generation import (
    API_SAMPLING,
    CLOSED_IN_PROMPT,
    OPENED_IN_ANSWER,
    OPENED_IN_PROMPT,
    PROMPT_LISTED,
    PROMPT_TEXT,
    PROMPT_TOP_N,
    REASONING_END,
    REASONING_START,
    THINKING_IN_CONTENT,
    TOKEN_COUNTS_ONLY,
    continues_message,
    first_stop_end,
    min_tokens_past_room,
    returns_full_text,
    stops_after,
)
from rawserve.worker.beam_search import BEAMS_REFUSE_GRAMMARS, BeamStops, beam_count, replay
from rawserve.worker.chat_controls import can_sanitize
from rawserve.worker.chat_rendering import (
    ChatRenderer,
    check_template,
    set_aside_named_faults,
    template_fault,
    template_reads,
)
from rawserve.worker.continuous import (
    NO_TOKENS,
    Generation,
    cache_keyword,
    cache_of,
    end_ids,
    generator_seed,
)
from rawserve.worker.decode_graphs import GraphedDecode
from rawserve.worker.generate_hooks import (
    Adjuster,
    GrammarFollower,
    ScoreRecorder,
    TokenWatcher,
    Watermarker,
    refuse_broken_scores,
    tgi_token,
    top_tokens,
)
from rawserve.worker.grammars import Grammars
from rawserve.worker.model_classes import load_model
from rawserve.worker.runner import (
    NOT_NUMBERS_WHY,
    NotNumbers,
    Runner,
    WrittenForClients,
    dtype_name,
    embedding_rows,
    generation_positions,
    greedy_at_zero_temperature,
)
from rawserve.worker.scores import (
    ScoreAdjustments,
    at_least_the_least_temperature,
    likeliest,
    unusable,
)
from rawserve.worker.template_costs import (
    message_tokens,
    rendered_roles,
    renders_tools_as_json,
    writes_parts,
)
from rawserve.worker.text_pieces import (
    CONTEXT_TOKENS,
    HeldTokens,
    TextPieces,
    generated_text,
    prompt_context,
    text_before,
)

log = logging.getLogger("rawserve.worker")

# The text-generation pipeline's defaults, for what the model's generation config leaves unset.
PIPELINE_DEFAULTS: dict[str, Any] = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
# What `generate` samples with where neither the request nor the model's generation config
# says (transformers' global defaults that change a draw; the others are neutral): the
# continuous loop draws as `generate` would.
GENERATE_DEFAULTS = {"top_k": 50}
# The OpenAI and TGI routes' own (API_SAMPLING), for what the model's generation config
# leaves unset: every token may be drawn, as TGI and vLLM draw (not generate's 50 likeliest).
API_DEFAULTS: dict[str, Any] = {"top_k": 0}
# What a greedy `generate` ignores, warning of it ("generation flags are not valid and may
# be ignored") at every batch: left out where it does not sample (typical_p below 1 samples)
SAMPLING_ONLY = ("top_k", "top_p", "min_p", "typical_p")
# The generation-config settings that change what `generate` makes and that the continuous
# loop does not apply, each with the value that changes nothing (None, or an empty list,
# changes nothing for every one): a model whose config sets one generates statically, one
# `generate` call a batch, so that its answers are still `generate`'s.
UNAPPLIED_SETTINGS: dict[str, Any] = {
    "num_beams": 1,
    "penalty_alpha": None,
    "dola_layers": None,
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "guidance_scale": 1.0,
    "watermarking_config": None,
    "stop_strings": None,
}
# A prompt's scores held at once when it is scored (positions × vocabulary; 64 MiB as
# float32): a 50,257-token vocabulary scores 333 positions a pass, 128,256 scores 130; a
# small one (characters, bytes, amino acids) at most PROMPT_WINDOW positions, so that the
# continuous loop's rows still decode between a chunk's worth of them (a vocabulary of
# 400 scored 41,943 positions a pass: a whole prompt, every stream waiting for it).
PROMPT_SCORES_AT_ONCE = 2**24
PROMPT_WINDOW = 512
# what a client is told when the model's scores at a prompt position are NaN or infinite
# (an overflow, as float16 meets on long inputs): the prompt's tokens have no log
# probabilities to list, and a null one would read as "none before it" (the first token's)
PROMPT_SCORES_FAILED_MESSAGE = (
    f"the model's scores for this input are not numbers {NOT_NUMBERS_WHY} at a token of "
    "its prompt: the prompt's log probabilities cannot be listed"
)
# the end of a chat prompt read for where it leaves a reasoning model's thinking: a tag
# and the white space after it, even spelled a character a token
OPENING_TOKENS = 32
# a prompt's scores: each token's log probability given the ones before it (from the
# second on), and the likeliest tokens at each of those positions, (id, log probability)
PromptScores = tuple[list[float], list[list[tuple[int, float]]]]
# Llama 3.1-3.3's templates refuse an answer of several tool calls, in these words
ONE_CALL_AT_ONCE = "only supports single tool-calls at once"


def run_out(steps: Generator[int, None, Any]) -> Any:
    """What a generator that pauses between its steps returns, run through at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def first_token_held(params: Mapping[str, Any]) -> bool:
    """Whether a reasoning model's answer is held to a grammar from its first token: where
    its thinking stays in the text (`THINKING_IN_CONTENT`), as vLLM's without a reasoning
    parser, it does not think first."""
    return bool(params.get("grammar") and params.get(THINKING_IN_CONTENT))


def lists_tokens(params: dict[str, Any], control: Control) -> bool:
    """Whether a whole answer's details list its tokens, as TGI's do (a stream sends
    them one by one; the OpenAI routes ask for the counts alone where no log
    probabilities are asked)."""
    wanted = bool(params.get("details")) and not params.get(TOKEN_COUNTS_ONLY)
    return control.stream_id is None and wanted


def scores_prompt(params: dict[str, Any]) -> bool:
    """Whether the prompt's tokens are listed with their log probabilities (TGI's
    `decoder_input_details`, which its details carry)."""
    return bool(params.get("decoder_input_details") and params.get("details"))


def asks_sampling(params: dict[str, Any]) -> bool:
    """Whether a temperature (but 1), a top_k (but vLLM's 0, every token), a min_p (but
    0), or a top_p or typical_p (below 1) is asked: TGI samples with them even beside
    do_sample false. A setting at its off value changes nothing (a model that decodes
    greedily stays so). (A min_p alone, on a model whose config decodes greedily, was
    dropped without a word, where a top_p sampled.)"""
    temperature = params.get("temperature")
    below_one = [params.get(name) for name in ("top_p", "typical_p")]
    return (
        temperature not in (None, 1.0)
        or bool(params.get("top_k"))
        or bool(params.get("min_p"))
        or any(value is not None and value < 1.0 for value in below_one)
    )


def ignores_eos(params: Mapping[str, Any]) -> bool:
    """Whether no end of sequence ends the answer (`ignore_eos`): not one held to a grammar,
    whose end is its own, not the model's (it allows the end alone once complete: the
    answer ran on with end tokens to its cap, "length")."""
    return bool(params.get("ignore_eos")) and not params.get("grammar")


def generate_kwargs(
    params: dict[str, Any], defaults: dict[str, Any], api_defaults: dict[str, Any]
) -> dict[str, Any]:
    """generate() options from checked request parameters, on top of `defaults` (the
    pipeline's, for what the model's generation config leaves unset), or on the OpenAI and
    TGI routes `api_defaults` (theirs, likewise) and no pipeline temperature."""
    kwargs: dict[str, Any] = dict(defaults)
    if params.get(API_SAMPLING):
        kwargs.pop("temperature", None)
        kwargs.update(api_defaults)
    for name in (
        "max_new_tokens",
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "repetition_penalty",
        "min_new_tokens",
    ):
        if name in params:
            kwargs[name] = params[name]
    if ignores_eos(params):  # no end of sequence: every row runs to its cap
        kwargs["eos_token_id"] = None
    if params.get("grammar"):  # it says itself when the end may come: none is held back
        kwargs["min_new_tokens"] = 0  # (where it allows the end alone, nothing would be left)
    if asks_sampling(params):  # as TGI reads them (its client sends do_sample false beside)
        kwargs["do_sample"] = True
    greedy_at_zero_temperature(kwargs)
    if not kwargs.get("do_sample"):  # (generate warned of each, for every greedy batch)
        if "temperature" not in params:
            kwargs.pop("temperature", None)  # a default for sampling only (the pipeline's)
        for name in SAMPLING_ONLY:
            kwargs.pop(name, None)
    at_least_the_least_temperature(kwargs)
    return kwargs


class CausalLMRunner(Runner):
    """text-generation on an `AutoModelForCausalLM`: batched with left padding, in the
    Inference API's shapes."""

    def __init__(self, model: str, device: str, torch_dtype: Any, chat_template: str | None = None):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        # --chat-template: for a tokenizer that has none, or to replace its own
        self.template_fault = ""  # why the model's own chat template is not used
        if chat_template is not None:
            tokenizer.chat_template = chat_template
            check_template(tokenizer)
        elif tokenizer.chat_template and (fault := template_fault(tokenizer)):
            # served as a model without one (/v1/completions, /generate), its chats refused
            # in words, not each a 422 that blames its messages
            log.warning(
                "the model's own chat template is not valid Jinja: %s; chats are refused "
                "(--chat-template FILE gives one)",
                fault,
            )
            self.template_fault = fault
            tokenizer.chat_template = None
        for name, fault in set_aside_named_faults(tokenizer).items():
            log.warning(
                "the model's chat template %r is not valid Jinja: %s; set aside (its default "
                "one renders the chats it would have)",
                name,
                fault,
            )
        self.chat = ChatRenderer(tokenizer)
        if tokenizer.chat_template:
            can_sanitize(tokenizer)
        self.model, untrained = load_model("AutoModelForCausalLM", model, dtype=torch_dtype)
        self.model.to(device).eval()
        rows = embedding_rows(self.model)
        super().__init__("text-generation", device, dtype_name(self.model), tokenizer, rows)
        self.untrained = untrained
        generation_config = self.model.generation_config
        if generation_config.temperature == 0.0:
            # greedy, as a request's temperature 0 is: `generate` refuses to sample at 0
            # (and the continuous loop would have sampled at 1); a request that asks to
            # sample draws at the pipeline's temperature
            generation_config.do_sample, generation_config.temperature = False, None
        configured = generation_config.to_diff_dict()
        # a prompt and its new tokens at most (bounded where the config names no positions)
        self.max_positions = generation_positions(self.model.config, tokenizer)
        # a length the generation config sets as `max_length` counts the prompt too, as
        # `generate` reads it; the pipeline's max_new_tokens would override it, so it adds none
        self.total_length: int | None = None
        self.defaults = {k: v for k, v in PIPELINE_DEFAULTS.items() if k not in configured}
        self.api_defaults = {k: v for k, v in API_DEFAULTS.items() if k not in configured}
        if "max_length" in configured and "max_new_tokens" not in configured:
            self.total_length = int(configured["max_length"])
            del self.defaults["max_new_tokens"]
        # whether it samples, said outright: the pipeline's temperature is for sampling only
        self.defaults["do_sample"] = bool({**PIPELINE_DEFAULTS, **configured}["do_sample"])
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.vocabulary = self.model.get_input_embeddings().num_embeddings  # ids it can read
        self.grammars = Grammars(self.tokenizer, self.model.get_output_embeddings().out_features)
        self.send: Callable[[Any], None] | None = None
        self.cancelled_stream: Any = None  # a shared integer: the stream id to stop
        self.decode_graphs = False  # the continuous batch's steps replayed (a GPU)
        # why the continuous loop cannot run this model ("": it can), decided at load
        self.uncached = self._without_kv_cache()
        # the latest prompt scored (its ids and `top_n`) and its scores: a request's `n`
        # choices come as n sequences of one prompt, each asking for its scores
        self._scored: tuple[tuple[int, ...], int, PromptScores] | None = None
        # what the chat template surely adds to a prompt, for the server to count
        self.message_tokens = 0
        self.tools_as_json = False
        self.counted_roles: list[str] = []
        self.parts_written = False
        if tokenizer.chat_template:
            self.counted_roles = rendered_roles(self.chat.text)
            self.parts_written = writes_parts(self.chat.text)
            # a template that leaves messages out adds nothing sure for each one
            self.message_tokens = message_tokens(self.chat.plain_ids) if self.counted_roles else 0
            self.tools_as_json = renders_tools_as_json(self.chat.text)

    def _without_kv_cache(self) -> str:
        """Why the model's forward pass gives the continuous loop no KV cache to keep for
        its rows ("": it gives one), from one token's pass: a model that is no decoder
        (a BERT loaded as BertLMHeadModel without `is_decoder`) returns none, and
        `generate` then reads the whole sequence at every step, which the static path
        runs as it is."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    **{cache_keyword(self.model): transformers.DynamicCache()},
                    use_cache=True,
                )
        except Exception as exc:  # noqa: BLE001 - generate's own path may still serve it
            return f"one token's pass with a KV cache failed ({type(exc).__name__}: {exc})"[:300]
        layers = getattr(cache_of(out), "layers", None)
        if layers and all(getattr(layer, "keys", None) is not None for layer in layers):
            return ""
        return (
            f"the model's forward pass ({type(self.model).__name__}) returns no KV cache, which "
            "continuous batching keeps for every sequence"
        )

    @property
    def unapplied_settings(self) -> list[str]:
        """The model's generation-config settings (`name=value`) that the continuous loop
        does not apply (`UNAPPLIED_SETTINGS`)."""
        config = self.model.generation_config
        return [
            f"{name}={value!r}"
            for name, neutral in UNAPPLIED_SETTINGS.items()
            if (value := getattr(config, name, None)) not in (None, [], neutral)
        ]

    def use_cuda_graphs(self) -> str:
        if unapplied := self.unapplied_settings:  # (rawserve.worker.generating)
            return (
                f"off: the model's generation config sets {', '.join(unapplied)}, so its "
                "batches run statically, through generate"
            )
        if self.uncached:
            return f"off: {self.uncached}, so its batches run statically, through generate"
        if not GraphedDecode.supports(self.model):
            return (
                "off: this model's attention takes no 4D mask, or slides a window (its "
                "decoding steps run as they are)"
            )
        self.decode_graphs = True
        return (
            "on: continuous batching's decoding steps (a graph per bucket of rows and cache "
            "columns) and short prefills (per power of two of rows and tokens); not with "
            "--generation static"
        )

    @property
    def limits(self) -> ModelLimits:
        most = self.max_positions - 1  # after a one-token prompt
        config = self.model.generation_config
        # what `generate` runs to where a request names no length (the pipeline's default
        # unless the model's generation config sets one)
        default = self.defaults.get("max_new_tokens", config.max_new_tokens) or 0
        if self.total_length is not None:  # (the most it leaves: after a one-token prompt)
            default = self.total_length - 1
        return ModelLimits(
            max_new_tokens=most,
            default_new_tokens=min(default, most),
            default_beams=config.num_beams or 1,
        )

    @property
    def details(self) -> dict[str, Any]:
        return {
            "chat_template": bool(self.tokenizer.chat_template),
            "chat_template_invalid": bool(self.template_fault),
            # (so earlier answers' thinking is not counted against the positions)
            "chat_drops_reasoning": REASONING_END in str(self.tokenizer.chat_template),
            # (so an answer calls one tool: a list of calls would be refused the next turn)
            "chat_one_call": ONE_CALL_AT_ONCE in str(self.tokenizer.chat_template),
            # (so OpenAI's reasoning effort is set where the template reads it: gpt-oss's)
            "chat_reads_reasoning_effort": template_reads(self.tokenizer, "reasoning_effort"),
            "thinking": self.thinking,
            "max_input_length": self.max_positions,
            # (so a chat's turns and tools are counted before it is queued)
            "chat_message_tokens": self.message_tokens,
            "chat_tools_json": self.tools_as_json,
            "chat_counted_roles": self.counted_roles,
            "chat_parts_written": self.parts_written,
            "vocabulary": self.vocabulary,  # the token ids a prompt or logit_bias may name
            # (so a Response says what it was sampled with where its request set nothing)
            "sampling": self.openai_sampling,
        }

    @property
    def openai_sampling(self) -> dict[str, Any]:
        """How the OpenAI routes sample a request that sets none of temperature and top_p:
        whether (the generation config's do_sample, else the pipeline's), and, sampling,
        at the config's temperature and top_p, else 1 (not the pipeline's 0.7)."""
        config = self.model.generation_config
        return {
            "do_sample": bool(self.defaults["do_sample"]),
            "temperature": float(config.temperature or 1.0),
            "top_p": float(config.top_p or 1.0),
        }

    @property
    def thinking(self) -> str | None:
        """Where a reasoning model's thinking opens (its template writes `</think>`): in
        the prompt, where the template ends it with `<think>` (QwQ's, DeepSeek-R1's), else
        in the answer, by the model (Qwen3's); None for a model that does not reason."""
        if not self.reasons:
            return None
        try:
            prompt = self.chat.render([{"role": "user", "content": "hi"}], None, {})
        except (WrittenForClients, ValueError):  # (it asks for more than one message)
            return OPENED_IN_ANSWER
        return OPENED_IN_PROMPT if prompt.rstrip().endswith(REASONING_START) else OPENED_IN_ANSWER

    def opening(self, ids: list[int], chat: Any = None) -> str:
        """Where a chat prompt leaves a reasoning model's thinking (its ids: the end will
        do), as its template rendered it for this request: opened (`OPENED_IN_PROMPT`:
        the prompt ends with `<think>`), closed already (`CLOSED_IN_PROMPT`: ends with
        `</think>`, as Qwen3's with `enable_thinking` false), else for the model to open,
        or not; for the model, too, where the `chat` asks for no generation prompt (its
        answer goes on from its last message, a `<think>` there its characters)."""
        if continues_message(chat):
            return OPENED_IN_ANSWER
        end = self.tokenizer.decode(ids[-OPENING_TOKENS:]).rstrip()
        if end.endswith(REASONING_END):
            return CLOSED_IN_PROMPT
        return OPENED_IN_PROMPT if end.endswith(REASONING_START) else OPENED_IN_ANSWER

    def opened(self, params: dict[str, Any], ids: list[int], chat: Any = None) -> str | None:
        """Where a reasoning model's chat answer to the prompt `ids` (of `chat`) opens its
        thinking (`opening`), told to the server with it (a template's settings, such as
        DeepSeek-V3.1's `thinking`, change it from the `thinking` detail); None for other
        answers, and for one a grammar holds from its first token (`THINKING_IN_CONTENT`):
        it has no thinking to count or split."""
        if not params.get(CHAT_PARAM) or not self.reasons or first_token_held(params):
            return None
        return self.opening(ids, chat)

    def thought_tokens(self, token_ids: list[int], context: list[int], opened: str) -> int:
        """How many of a reasoning model's answer's tokens its thinking took, up to the one
        that ends its `</think>` (all where it never closes; none where it does not open),
        as the server splits its text: the fewest whose text holds the tag, found in a
        few decodes (the text of more tokens holds what theirs does)."""

        def text(count: int) -> str:
            return generated_text(self.tokenizer, token_ids[:count], context)

        whole = text(len(token_ids))
        if opened == CLOSED_IN_PROMPT:
            return 0
        if opened != OPENED_IN_PROMPT and not whole.lstrip().startswith(REASONING_START):
            return 0
        if REASONING_END not in whole:
            return len(token_ids)
        low, high = 1, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if REASONING_END in text(middle) else (middle + 1, high)
        return low

    def held_to(
        self, params: dict[str, Any], ids: list[int], chat: Any = None
    ) -> dict[str, Any] | None:
        """The grammar a prompt's answer is held to (None: none): a reasoning model's chat
        answer after its thinking (the grammar's "thinking": where it opens, if it may),
        unless the thinking is kept in the content (`THINKING_IN_CONTENT`)."""
        grammar = params.get("grammar")
        if not grammar or not params.get(CHAT_PARAM) or not self.reasons:
            return grammar
        if first_token_held(params):  # (its thinking kept in the text: none comes first)
            return grammar
        opened = self.opening(ids, chat)
        return grammar if opened == CLOSED_IN_PROMPT else {**grammar, "thinking": opened}

    @property
    def reasons(self) -> bool:
        """Whether the model reasons: its chat template writes `</think>`."""
        return REASONING_END in str(self.tokenizer.chat_template)

    def prompts(self, inputs: list[Any], params: dict[str, Any]) -> Any:
        """The batch's prompts as token ids, left-padded (`prompt_ids` for each)."""
        ids = [self.prompt_ids(item, params) for item in inputs]
        return self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")

    def prompt_ids(self, item: Any, params: dict[str, Any]) -> list[int]:
        """One prompt's token ids (`whole_prompt_ids`), of which TGI's `truncate` keeps
        the last that many (TGI cuts a prompt from the left: what was said last stays). A
        text's or chat's token the model has no embedding for is refused where it is read
        (one cut off is not)."""
        ids = self.whole_prompt_ids(item, params)
        if not ids and not params.get(PROMPT_LISTED):  # (a chat template that renders no text)
            raise ValueError(NO_TOKENS)
        if cut := params.get("truncate"):
            ids = ids[-cut:]
        if params.get(CHAT_PARAM) or not isinstance(item, list):
            self.refuse_unreadable([ids])
        return ids

    def listed_text(self, chat: Any, ids: list[int]) -> str:
        """A listed chat's text as its template writes it; its `ids` decoded where the
        template refuses to write as plain text what it read with the chat's control
        tokens kept as text."""
        try:
            return self.chat.prompt_text(chat)
        except (WrittenForClients, ValueError):
            return str(self.tokenizer.decode(ids))

    def whole_prompt_ids(self, item: Any, params: dict[str, Any]) -> list[int]:
        """One prompt's token ids: a text tokenized, a chat (`{"messages": [...]}`, OpenAI's)
        rendered with the chat template, or ids as they came (OpenAI's completions take
        them; ValueError for one the model has no embedding for)."""
        if params.get(CHAT_PARAM):
            return self.chat.prompt_ids(item)
        if isinstance(item, list):
            unknown = [token_id for token_id in item if not 0 <= token_id < self.vocabulary]
            if unknown:
                raise ValueError(
                    f"the token id {unknown[0]} is not in the model's vocabulary (ids run "
                    f"from 0 to {self.vocabulary - 1})"
                )
            return item
        return list(self.tokenizer(item)["input_ids"])

    def _unasked_new_tokens(self, prompt_length: int) -> int:
        """The new tokens a prompt gets where neither the request nor the model's
        generation config names them: what its `max_length` leaves after the prompt (as
        `generate` counts it), else the pipeline's default."""
        if self.total_length is None:
            return int(PIPELINE_DEFAULTS["max_new_tokens"])
        return max(self.total_length - prompt_length, 0)

    def _check_lengths(self, params: dict[str, Any], longest_prompt: int) -> None:
        """ValueError when the new tokens asked, or a prompt, cannot fit the positions (a
        prompt only scored, max_new_tokens 0, may fill them: no token follows it), or
        when the new tokens asked at the least (`min_new_tokens`) cannot follow the
        prompt in them: cut at the positions, the answer would not hold them."""
        most = self.max_positions - 1
        asked = params.get("max_new_tokens")
        if asked is not None:  # the server refuses it first: a backstop
            check_new_tokens("max_new_tokens", asked, self.limits.max_new_tokens)
        if asked == 0 and longest_prompt > self.max_positions:
            raise ValueError(
                f"the prompt is {longest_prompt} tokens, which is longer than the model's "
                f"context length: it reads at most {self.max_positions} (scored, with no new "
                "token after them)"
            )
        if asked != 0 and longest_prompt > most:
            raise ValueError(
                f"the prompt is {longest_prompt} tokens, which is longer than the model's "
                f"context length: it takes at most {most} to leave room for one new token"
            )
        if asked is None and self.total_length is not None and longest_prompt >= self.total_length:
            raise ValueError(
                f"the prompt is {longest_prompt} tokens, and this model's generation config "
                f"ends an answer at max_length {self.total_length} tokens, the prompt "
                "included: ask for a length (max_new_tokens; OpenAI's max_tokens, or "
                "max_output_tokens) to generate past it"
            )
        least = int(params.get("min_new_tokens") or 0)  # as asked (not the model's own)
        room = self.max_positions - longest_prompt
        if least > room:
            raise ValueError(min_tokens_past_room(least, longest_prompt, self.max_positions))

    # --- one item at a time, for the continuous loop (rawserve.worker.generating) -----------

    def generation(
        self, key: Any, item: Any, params: dict[str, Any], control: Control = NO_CONTROL
    ) -> Generation:
        """One item as a sequence for the continuous loop, with the settings `generate`
        would use for it (ValueError, as `run` gives it, for an input that cannot run)."""
        ids = self.prompt_ids(item, params)
        if not params.get(PROMPT_LISTED):  # (one listed is not read: it may pass them)
            self._check_lengths(params, len(ids))
        kwargs = generate_kwargs(params, self.defaults, self.api_defaults)
        config = self.model.generation_config

        def setting(name: str) -> Any:  # asked, the model's generation config, generate's
            if name in kwargs:
                return kwargs[name]
            configured = getattr(config, name, None)
            return GENERATE_DEFAULTS.get(name) if configured is None else configured

        wants_logprobs = control.stream_id is not None or lists_tokens(params, control)
        asked = setting("max_new_tokens")  # 0: the prompt scored, nothing generated
        generation = Generation(
            key,
            ids,
            max_new_tokens=self._unasked_new_tokens(len(ids)) if asked is None else asked,
            do_sample=bool(setting("do_sample")),
            temperature=setting("temperature") or 1.0,
            top_k=setting("top_k"),
            top_p=setting("top_p"),
            min_p=setting("min_p"),
            typical_p=setting("typical_p"),
            seed=params.get("seed"),
            stop=tuple(params.get("stop", ())),
            repetition_penalty=setting("repetition_penalty"),
            watermark=bool(params.get("watermark")),
            min_new_tokens=int(setting("min_new_tokens") or 0),
            stops_after=stops_after(params),
            ignore_eos=ignores_eos(params),
            adjustments=ScoreAdjustments.asked(params, self.vocabulary),
            compiling=self.grammars.pending(held)
            if (held := self.held_to(params, ids, item))
            else None,
            logprobs=[] if wants_logprobs else None,
            top_n=int(params.get("top_n_tokens") or 0),
        )
        if scores_prompt(params):  # (max_new_tokens 0: its answer is its prompt's scores)
            generation.scoring = self.listing_prefill(generation, params)
        return generation

    def prefill_tokens(self, ids: list[int], params: dict[str, Any]) -> list[dict[str, Any]]:
        """The prompt's tokens as TGI's details list them under `prefill` (TGI's
        `decoder_input_details`): each one's text (what it adds to the prompt's text; a
        special token its own) and its log probability given the ones before it (none for
        the first); with `PROMPT_TOP_N`, the likeliest tokens at each position too."""
        return run_out(self._prefill_in_windows(ids, params))

    def _prefill_in_windows(
        self, ids: list[int], params: dict[str, Any]
    ) -> Generator[int, None, list[dict[str, Any]]]:
        """`prefill_tokens`, pausing after each window of the scoring pass (its positions)."""
        top_n = int(params.get(PROMPT_TOP_N) or 0)
        chosen, top = yield from self._scores_of(ids, top_n)
        pieces = TextPieces(self.tokenizer)
        held = HeldTokens()
        tokens = []
        so_far: list[int] = []  # (grown a token at a time: a slice each would be quadratic)
        for index, token_id in enumerate(ids):
            so_far.append(token_id)
            logprob = chosen[index - 1] if index else None  # nothing before the first
            alternatives = (top[index - 1] if index else []) if top_n else None
            token = tgi_token(self.tokenizer, self.special_ids, token_id, logprob, alternatives)
            tokens += held.add(token, pieces.next_pieces(so_far, last=index == len(ids) - 1))
        return tokens

    def listing_prefill(self, generation: Generation, params: dict[str, Any]) -> Iterator[int]:
        """A sequence's `prefill` (`prefill_tokens`), made a few windows of the scoring pass
        a step of the continuous loop: the rows running decode between them."""
        generation.prefill = yield from self._prefill_in_windows(generation.prompt_ids, params)

    def _scores_of(self, ids: list[int], top_n: int) -> Generator[int, None, PromptScores]:
        """The prompt's scores (`_score_prompt`), reused where the prompt scored last is
        this one: each of a request's `n` choices asks for them, one after another, and
        scoring it again would be a forward pass over the whole prompt per choice."""
        key = tuple(ids)
        if self._scored is not None and self._scored[:2] == (key, top_n):
            return self._scored[2]
        scores = yield from self._score_prompt(ids, top_n)
        self._scored = (key, top_n, scores)
        return scores

    def _score_prompt(self, ids: list[int], top_n: int) -> Generator[int, None, PromptScores]:
        """From a forward pass over the prompt: each token's log probability given the
        ones before it (from the second on), and the `top_n` likeliest tokens there;
        pausing after each window (yielding its positions).

        The pass runs a window of positions at a time over a growing KV cache: the scores
        of a whole prompt at once (positions × vocabulary) would cost more memory than the
        model's cache for it: positions × a vocabulary of 50,000-150,000 tokens, gigabytes
        for a long prompt."""
        chosen: list[float] = []
        top: list[list[tuple[int, float]]] = []
        tensor = torch.tensor([ids], device=self.device)
        cache = None
        keyword = cache_keyword(self.model)  # (a renamed keyword warns)
        at_once = max(1, min(PROMPT_WINDOW, PROMPT_SCORES_AT_ONCE // self.vocabulary))
        # the last token's scores say what would follow the prompt: not needed
        for start in range(0, len(ids) - 1, at_once):
            window = slice(start, min(start + at_once, len(ids) - 1))
            with torch.inference_mode():
                out = self.model(input_ids=tensor[:, window], use_cache=True, **{keyword: cache})
                cache = cache_of(out)
                scores = out.logits[0].float()
                if bool(unusable(scores).any()):  # a log probability of NaN is JSON's null
                    raise NotNumbers(PROMPT_SCORES_FAILED_MESSAGE)
                logprobs = scores.log_softmax(-1)
                following = tensor[0, window.start + 1 : window.stop + 1, None]
                chosen += logprobs.gather(1, following)[:, 0].tolist()
                top += likeliest(logprobs, top_n) or []
            yield window.stop - window.start
        return chosen, top

    def token(
        self,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
    ) -> dict[str, Any]:
        """A sequence's new token in TGI's shape (streamed, or listed in details), its
        text filled in once it is known (`HeldTokens`)."""
        return tgi_token(self.tokenizer, self.special_ids, token_id, logprob, top)

    def finished(
        self,
        generation: Generation,
        item: Any,
        params: dict[str, Any],
        control: Control = NO_CONTROL,
        tokens: list[dict[str, Any]] | None = None,
    ) -> Any:
        """A finished sequence's output, shaped as `run` shapes it."""
        return self._output(
            item,
            params,
            control,
            token_ids=generation.tokens,
            finish_reason=generation.finish_reason or "length",
            prompt_tokens=len(generation.prompt_ids),
            prompt_ids=generation.prompt_ids,
            context=prompt_context(self.tokenizer, generation.prompt_ids),
            tokens=tokens,
            prefill=generation.prefill,
            seed=generation.seed if generation.do_sample else None,
            opened=self.opened(params, generation.prompt_ids, item),
        )

    def _output(
        self,
        prompt: Any,
        params: dict[str, Any],
        control: Control,
        *,
        token_ids: list[int],
        finish_reason: str,
        prompt_tokens: int,
        prompt_ids: list[int],
        context: list[int],
        tokens: list[dict[str, Any]] | None,
        prefill: list[dict[str, Any]] | None = None,
        seed: int | None = None,
        opened: str | None = None,
    ) -> Any:
        """One item's output in the Inference API's shape (TGI's details when asked;
        `context`: the end of its prompt, which its text is decoded after; `seed`: the
        one it sampled with, None for a greedy answer, as TGI answers whatever was sent;
        `opened`: where a reasoning model's thinking opens, `opened`'s)."""
        # the whole decode, as the pipeline does (pieces hold back a cut character)
        text = generated_text(self.tokenizer, token_ids, context)
        begin = 0  # where in the text stop sequences count
        if (after := stops_after(params)) > 1 and params.get("stop"):
            # the start of that token's text, as the tokens list their texts (a character
            # at the token its last byte is, as in a stream: bytes before it no U+FFFDs)
            begin = len(text_before(self.tokenizer, token_ids, after - 1, context))
        if finish_reason == "stop_sequence":  # the text ends with it, as its last piece
            text = text[: first_stop_end(text, params["stop"], begin)]
        if returns_full_text(params):
            text = prompt + text
        output: dict[str, Any] = {"generated_text": text}
        if params.get("details") or control.stream_id is not None:
            output["details"] = {
                "finish_reason": finish_reason,
                "generated_tokens": len(token_ids),
                "prompt_tokens": prompt_tokens,
                "seed": seed,
            }
            if opened is not None:
                output["details"]["thinking"] = opened
                thought = self.thought_tokens(token_ids, context, opened)
                output["details"]["reasoning_tokens"] = thought
            if begin:
                output["details"]["stops_from"] = begin
            if params.get(PROMPT_LISTED):  # the chat token routes' (nothing was run)
                output["details"]["prompt_ids"] = list(prompt_ids)
            if params.get(PROMPT_TEXT):
                output["details"]["prompt_text"] = self.listed_text(prompt, prompt_ids)
            if tokens is not None:  # TGI's: the prompt's tokens only on request
                # as columns: thousands of dicts would take the server's loop to unpickle
                output["details"]["prefill"] = columns(prefill or [])
                if params.get("top_n_tokens"):  # TGI lists them beside the tokens
                    listed = [dict(token) for token in tokens]
                    top = [token.pop("top_tokens", []) for token in listed]
                    output["details"].update(tokens=columns(listed), top_tokens=token_lists(top))
                else:
                    output["details"]["tokens"] = columns(tokens)
        # pipe(x) answers [{"generated_text": ...}] per input
        return output if control.stream_id is not None else [output]

    def bind_stream(self, send: Callable[[Any], None], cancelled_stream: Any) -> None:
        """Where token chunks go (the worker's pipe) and where cancellations come from."""
        self.send, self.cancelled_stream = send, cancelled_stream

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        encoded = self.prompts(inputs, params)
        kwargs = generate_kwargs(params, self.defaults, self.api_defaults)
        # unasked, the length its generation config sets (`self.defaults` leaves it out)
        asked = kwargs.pop("max_new_tokens", self.model.generation_config.max_new_tokens)
        lengths = [int(n) for n in encoded["attention_mask"].sum(-1).tolist()]
        if not params.get(PROMPT_LISTED):  # (one listed is not read: it may pass them)
            self._check_lengths(params, max(lengths))
        # Each row's own cap: a prompt and its new tokens past the positions stop there
        # (finish_reason "length"). Rows with the same cap share a `generate` call, so a
        # batch-mate's long prompt never cuts a short one's room (one call takes one cap).
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(lengths):
            most = self._unasked_new_tokens(length) if asked is None else asked
            cap = max(0, min(most, self.max_positions - length))  # (0: one listed)
            groups.setdefault(cap, []).append(row)
        # A seeded sample repeats whatever runs beside it, as in the continuous loop: one
        # `generate` draws all its rows from one generator, so each seeded row runs alone,
        # from its seed (else its text would change with its batch-mates).
        seeded = "seed" in params and bool(kwargs.get("do_sample"))
        made: dict[int, tuple[list[int], str, Any]] = {}
        if 0 in groups:  # max_new_tokens 0: the prompts scored, nothing generated
            none: list[dict[str, Any]] | None = [] if lists_tokens(params, control) else None
            made.update((row, ([], "length", none)) for row in groups.pop(0))
        calls = [
            (cap, part)
            for cap, rows in groups.items()
            for part in ([[row] for row in rows] if seeded else [rows])
        ]
        for cap, rows in calls:
            width = max(lengths[row] for row in rows)  # the group's own left padding
            group = {name: value[rows, -width:] for name, value in encoded.items()}
            with self._seeded(params["seed"] if seeded else None):
                watcher = self._generate(
                    group,
                    rows,
                    [inputs[row] for row in rows],
                    {**kwargs, "max_new_tokens": cap},
                    params,
                    control,
                )
            for index, row in enumerate(rows):
                tokens = None if watcher.tokens is None else watcher.tokens[index]
                made[row] = (watcher.token_ids[index], watcher.finish_reasons[index], tokens)
        outputs = []
        padded = int(encoded["input_ids"].shape[1])
        for row, prompt in enumerate(inputs):
            token_ids, finish_reason, tokens = made[row]
            # (its last `lengths[row]`: of an empty prompt, none, not the padded row)
            ids = encoded["input_ids"][row, padded - lengths[row] :].tolist()
            prefill = self.prefill_tokens(ids, params) if scores_prompt(params) else None
            outputs.append(
                self._output(
                    prompt,
                    params,
                    control,
                    token_ids=token_ids,
                    finish_reason=finish_reason,
                    prompt_tokens=lengths[row],
                    prompt_ids=ids,
                    context=prompt_context(self.tokenizer, ids),
                    tokens=tokens,
                    prefill=prefill,
                    seed=params.get("seed") if kwargs.get("do_sample") else None,
                    opened=self.opened(params, ids, prompt),
                )
            )
        return outputs

    @contextlib.contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        """Torch's generators seeded with `seed` (None: left as they are) for one
        `generate` call, and given back as they were after it: seeded for good, every
        unseeded sample after it, another client's, drew the same text."""
        if seed is None:
            yield
            return
        with torch.random.fork_rng(devices=[self.device] if self.on_cuda else []):
            torch.manual_seed(generator_seed(seed))
            yield

    def _generate(
        self,
        encoded: dict[str, Any],
        rows: list[int],
        chats: list[Any],
        kwargs: dict[str, Any],
        params: dict[str, Any],
        control: Control,
    ) -> TokenWatcher:
        """One `generate` call over some of the batch's rows (`rows`: their places in the
        batch, which streamed tokens carry); its watcher holds what each row made."""
        stream_id = control.stream_id
        # each row's text decoded after the end of its prompt (left padding: specials)
        ends = encoded["input_ids"][:, -CONTEXT_TOKENS:].tolist()
        opening_ends = encoded["input_ids"][:, -OPENING_TOKENS:].tolist()
        contexts = [prompt_context(self.tokenizer, ids) for ids in ends]
        encoded = {name: value.to(self.device) for name, value in encoded.items()}
        recorder = ScoreRecorder()
        keep_tokens = lists_tokens(params, control)
        wants_logprobs = stream_id is not None or keep_tokens
        on_token = None
        if stream_id is not None and self.send is not None:
            send = self.send
            unheard = {
                index: self.opened(params, row, chats[index])
                for index, row in enumerate(opening_ends)
            }

            def on_token(index: int, token: dict[str, Any]) -> None:
                opened = unheard.pop(index, None)  # (with a row's first token)
                send(TokenChunk(stream_id=stream_id, index=rows[index], token=token, opened=opened))

        def cancelled() -> bool:
            if self.batch_cancelled():
                return True
            flag = self.cancelled_stream
            return stream_id is not None and flag is not None and flag.value == stream_id

        if (beams := beam_count(self.model)) > 1:
            if params.get("grammar"):
                raise ValueError(BEAMS_REFUSE_GRAMMARS.format(beams))
            return self._search_beams(
                encoded,
                kwargs,
                params,
                contexts=contexts,
                keep_tokens=keep_tokens,
                on_token=on_token,
                cancelled=cancelled,
            )
        watcher = self._watcher(
            encoded,
            kwargs,
            params,
            contexts,
            recorder=recorder,
            on_token=on_token,
            cancelled=cancelled,
            keep_tokens=keep_tokens,
            top_n=int(params.get("top_n_tokens") or 0),
        )
        # (before the recorder: the log probabilities follow them)
        processors = self._score_changes(params, kwargs, encoded)
        if params.get("grammar"):
            held = [
                self.held_to(params, row, chat) or params["grammar"]
                for row, chat in zip(opening_ends, chats, strict=True)
            ]
            matchers = [self.grammars.pending(grammar).held() for grammar in held]  # each row's
            processors.append(GrammarFollower(matchers, watcher))
        if wants_logprobs:
            processors.append(recorder)
        self._call_generate(encoded, kwargs, watcher, processors, watcher)
        watcher.let_out_the_rest()
        return watcher

    def _score_changes(
        self, params: dict[str, Any], kwargs: dict[str, Any], encoded: dict[str, Any]
    ) -> list[Any]:
        """The logits processors that change `generate`'s scores for `params`, in TGI's
        order: TGI's watermark, then the repetition penalty (generate's own, which runs
        before any processor it is handed, is then turned off in `kwargs`, in place),
        then OpenAI's bias and penalties and TGI's frequency penalty (`Adjuster`)."""
        processors: list[Any] = []
        if params.get("watermark"):
            config = self.model.generation_config
            penalty = kwargs.get("repetition_penalty", config.repetition_penalty)
            kwargs["repetition_penalty"] = 1.0
            processors.append(Watermarker())
            if penalty not in (None, 1.0):
                processors.append(transformers.RepetitionPenaltyLogitsProcessor(penalty))
        adjustments = ScoreAdjustments.asked(params, self.vocabulary)
        if adjustments is not None:
            width = encoded["input_ids"].shape[1]
            processors.append(Adjuster(adjustments, width, encoded.get("attention_mask")))
        return processors

    def _watcher(
        self,
        encoded: dict[str, Any],
        kwargs: dict[str, Any],
        params: dict[str, Any],
        contexts: list[list[int]],
        **options: Any,
    ) -> TokenWatcher:
        """The `TokenWatcher` of one `generate` call's rows (`options`: where its tokens
        go, and what of them it lists)."""
        return TokenWatcher(
            self.tokenizer,
            end_ids(self.tokenizer, self.model),
            prompt_length=encoded["input_ids"].shape[1],
            batch_size=len(contexts),
            stop=params.get("stop", ()),
            ignore_eos=ignores_eos(params),
            stops_after=stops_after(params),
            max_new_tokens=kwargs["max_new_tokens"],
            contexts=contexts,
            **options,
        )

    def _call_generate(
        self,
        encoded: dict[str, Any],
        kwargs: dict[str, Any],
        watcher: TokenWatcher,
        processors: list[Any],
        stopping: transformers.StoppingCriteria,
        **options: Any,
    ) -> Any:
        """`generate` over `encoded`'s rows, with rawserve's hooks, its scores refused
        where they are not numbers (`refuse_broken_scores`)."""
        head = self.model.get_output_embeddings()
        hook = head.register_forward_hook(refuse_broken_scores(watcher))
        try:
            with torch.inference_mode():
                return self.model.generate(
                    **encoded,
                    **kwargs,
                    **options,
                    pad_token_id=self.tokenizer.pad_token_id,
                    logits_processor=transformers.LogitsProcessorList(processors),
                    stopping_criteria=transformers.StoppingCriteriaList([stopping]),
                )
        finally:
            hook.remove()

    def _search_beams(
        self,
        encoded: dict[str, Any],
        kwargs: dict[str, Any],
        params: dict[str, Any],
        *,
        contexts: list[list[int]],
        keep_tokens: bool,
        on_token: Callable[[int, dict[str, Any]], None] | None,
        cancelled: Callable[[], bool],
    ) -> TokenWatcher:
        """One `generate` call of beam search (rawserve.worker.beam_search): its answers
        walked through a watcher once it is done, each token's log probability the
        model's own after the tokens before it (one pass over the prompt and its answer,
        where tokens are listed or streamed), and a stream's tokens sent then: which beam
        wins is not known before the end."""
        width = encoded["input_ids"].shape[1]
        listed = keep_tokens or on_token is not None
        watcher = self._watcher(
            encoded,
            kwargs,
            params,
            contexts,
            recorder=ScoreRecorder(),  # (none recorded: the answers are scored after)
            cancelled=cancelled,
            keep_tokens=listed,
        )
        processors = self._score_changes(params, kwargs, encoded)
        stops = BeamStops(
            self.tokenizer,
            prompt_width=width,
            contexts=contexts,
            stop=params.get("stop", ()),
            stops_after=stops_after(params),
            cancelled=cancelled,
        )
        # one answer a prompt (its config may ask for more, which the rows could not hold)
        out = self._call_generate(
            encoded,
            kwargs,
            watcher,
            processors,
            stops,
            num_return_sequences=1,
            return_dict_in_generate=True,
        )
        lengths = (out.beam_indices >= 0).sum(-1).tolist()  # (padding follows)
        replay(watcher, out.sequences[:, width:], lengths)
        watcher.let_out_the_rest()
        if listed and watcher.tokens is not None:
            top_n = int(params.get("top_n_tokens") or 0)
            prompts = [
                ids[mask.bool()].tolist()
                for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
            ]
            for row, tokens in enumerate(watcher.tokens):
                self._score_answer(prompts[row], watcher.token_ids[row], tokens, top_n)
                if on_token is not None:
                    for token in tokens:
                        on_token(row, token)
        if not keep_tokens:
            watcher.tokens = None
        return watcher

    def _score_answer(
        self, prompt: list[int], answer: list[int], tokens: list[dict[str, Any]], top_n: int
    ) -> None:
        """An answer's `tokens` given each one's log probability (and the `top_n` likeliest
        tokens at its step) after the prompt and the tokens before it."""
        if not answer:
            return
        chosen, top = run_out(self._score_prompt(prompt + answer, top_n))
        start = len(prompt) - 1  # (the prompt's own tokens' scores come first)
        for at, token in enumerate(tokens):
            token["logprob"] = chosen[start + at]
            if top_n:
                token["top_tokens"] = top_tokens(self.tokenizer, self.special_ids, top[start + at])
