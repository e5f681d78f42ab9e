"""summarization, translation and text2text-generation on an `AutoModelForSeq2SeqLM`
(transformers 5 no longer has pipelines for them).

Worker process only (imports torch and transformers). Tokenize the batch (with the prefix the
model's config names for the task, e.g. T5's "summarize: "), `generate`, decode, and answer
`{"summary_text"}` / `{"translation_text"}` / `{"generated_text"}` per input (a list of them
with `num_return_sequences` > 1), as transformers 4's pipelines did. Their generate() settings,
in order, each over the one before (tests/test_fidelity.py holds the answers to 4.57's):

1. the model's generation config;
2. the pipeline's defaults where the model says nothing: `num_beams=4`, and
   `max_new_tokens=256` unless the model names a length (one past its decoder's
   positions stops at them);
3. the model's `task_specific_params` for the task (for translation: the direction asked
   with src_lang/tgt_lang, else the first the config names), e.g. t5's summarization
   `num_beams=4, min_length=30, no_repeat_ngram_size=3, length_penalty=2`;
4. the caller's parameters.

A `max_length` from step 3 or 4 wins over the default `max_new_tokens`; transformers 4.57
let 256 new tokens win (the README's task table lists this and the other deliberate
differences).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import transformers

from rawserve.shared.messages import NO_CONTROL, Control, ModelLimits
from rawserve.tasks import GENERATE_PARAMS
from rawserve.tasks.seq2seq import OUTPUT_KEYS
from rawserve.worker.long_texts import encode_cut, narrowed_texts
from rawserve.worker.model_classes import load_model
from rawserve.worker.runner import (
    MODEL_SCORES_FAILED_MESSAGE,
    PAD_SIDE,
    UNDECLARED_LENGTH,
    NotNumbers,
    Runner,
    dtype_name,
    embedding_rows,
    greedy_at_zero_temperature,
    undeclared_input_tokens,
)
from rawserve.worker.scores import at_least_the_least_temperature, unusable

# transformers 4.57's Text2TextGenerationPipeline._default_generation_config
PIPELINE_NUM_BEAMS = 4
PIPELINE_MAX_NEW_TOKENS = 256
UNSET_MAX_LENGTH = (None, 20)  # 20 is generate()'s own default: the model named no length
# a tokenizer's own special tokens, which are in its vocabulary but name no language
NAMED_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

log = logging.getLogger("rawserve.generation")


class LengthsSettled(logging.Filter):
    """Leaves out generate()'s "Both `max_new_tokens` and `max_length` seem to have been
    set" (and min's): the lengths are settled here (`settled`), as generate() reads them,
    and it said so at every request naming a length to a model whose generation config
    names one (bart-large-cnn's max_length 142)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "seem to have been set" not in record.getMessage()


LENGTHS_SETTLED = LengthsSettled()


class Abandoned(transformers.StoppingCriteria):
    """Stops every row (and every beam) at the next token once nobody waits for the batch
    (its clients left, or their deadlines passed): `generate` would run it to its length
    while the requests queued behind it met their own 504."""

    def __init__(self, cancelled: Callable[[], bool]):
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        stop = self.cancelled()
        if stop:
            log.info("generation stopped: nobody waits for it (clients gone, deadlines passed)")
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def refuse_unusable_scores(_module: Any, _args: Any, output: Any) -> None:
    """A forward hook: `NotNumbers` where a row's scores for its next token are NaN or
    +inf, or none is finite (the model overflowed, as float16 does on some inputs), read
    before `generate`'s processors touch them. Greedy and beam search took token 0 from
    such a row and answered the text it made (an empty one, often), and sampling blamed a
    temperature the client never set; the input fails alone instead, as the model's fault."""
    logits = output.get("logits") if isinstance(output, dict) else None
    if isinstance(logits, torch.Tensor) and bool(unusable(logits[:, -1].float()).any()):
        raise NotNumbers(MODEL_SCORES_FAILED_MESSAGE)


class Seq2SeqLMRunner(Runner):
    def __init__(self, model: str, task: str, device: str, torch_dtype: Any):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model, padding_side=PAD_SIDE)
        self.model, untrained = load_model("AutoModelForSeq2SeqLM", model, dtype=torch_dtype)
        self.model.to(device).eval()
        self.model.register_forward_hook(refuse_unusable_scores)  # every decoding step's
        logging.getLogger("transformers.generation.utils").addFilter(LENGTHS_SETTLED)
        rows = embedding_rows(self.model)
        super().__init__(task, device, dtype_name(self.model), tokenizer, rows)
        self.untrained = untrained
        # (continuous batching keeps a decoder's rows; an encoder-decoder's run whole)
        self.generation_mode = "static (one generate call per batch): an encoder-decoder model"
        # (transformers 5's configs have the attribute only where the file names it)
        self.task_params: dict[str, Any] = (
            getattr(self.model.config, "task_specific_params", None) or {}
        )
        self.directions = [key for key in self.task_params if key.startswith("translation")]
        # the source language of a tokenizer that keeps one (mBART, NLLB, M2M100)
        self.source_language: str | None = getattr(tokenizer, "src_lang", None)
        # models with absolute positions fail past them: longer inputs are cut there
        self.position_limit: int | None = getattr(
            self.model.config, "max_position_embeddings", None
        )
        # What an input is cut to by default, and refused past when cutting is refused:
        # the positions, or for a model without them (T5's relative positions) the limit
        # its tokenizer declares (512 for t5-*), else T5's 512: an input bounded only by
        # the body size takes the encoder's attention gigabytes (16,000 tokens: 12 GB on a
        # tiny T5, which a 36 KB body asks for)
        declared = tokenizer.model_max_length
        if declared >= UNDECLARED_LENGTH:
            declared = undeclared_input_tokens(self.model.config)
        self.input_limit: int = self.position_limit or declared
        self.defaults = self.pipeline_defaults()

    @property
    def limits(self) -> ModelLimits:
        # the decoder reads its start token and each new token but the last it makes, so
        # it makes as many as its positions (transformers 4's pipeline did; positions - 1
        # refused a BART its last); models with relative positions (T5) have no such bound
        most = self.position_limit
        config = self.model.generation_config
        # what `generate` runs to where a request names no length or beams (its max_length
        # counts the decoder's start token)
        default = self.defaults.get("max_new_tokens", config.max_new_tokens)
        if default is None:
            default = max((config.max_length or 1) - 1, 0)
        return ModelLimits(
            max_input_tokens=self.input_limit,  # inputs are truncated to it by default
            max_new_tokens=most,
            default_new_tokens=default if most is None else min(default, most),
            default_beams=self.defaults.get("num_beams", config.num_beams) or 1,
        )

    @property
    def details(self) -> dict[str, Any]:
        # what an input is cut to by default (/info's, and /tokenize's "truncate")
        return {"translations": sorted(self.directions), "max_input_length": self.input_limit}

    def pipeline_defaults(self) -> dict[str, Any]:
        """Step 2: what the pipeline set where the model's generation config says nothing."""
        configured = self.model.generation_config
        defaults: dict[str, Any] = {}
        if configured.num_beams in (None, 1):
            defaults["num_beams"] = PIPELINE_NUM_BEAMS
        if configured.max_new_tokens is None and configured.max_length in UNSET_MAX_LENGTH:
            # within the decoder's positions (the start token takes one)
            limit = (
                PIPELINE_MAX_NEW_TOKENS + 1 if self.position_limit is None else self.position_limit
            )
            defaults["max_new_tokens"] = min(PIPELINE_MAX_NEW_TOKENS, limit - 1)
        elif self.position_limit is not None and (
            (configured.max_new_tokens or 0) > self.position_limit - 1
            or (configured.max_new_tokens is None and configured.max_length > self.position_limit)
        ):  # the model's own length runs past its decoder's positions: it stops there
            defaults["max_new_tokens"] = self.position_limit - 1
        if configured.pad_token_id is None and self.tokenizer.pad_token_id is not None:
            defaults["pad_token_id"] = self.tokenizer.pad_token_id
        return defaults

    def task_settings(self, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Step 3: the prefix to put before each input, and the task's generate() options."""
        key, options = self.task_key(params)
        settings = dict(self.task_params.get(key, {})) if key else {}
        prefix = settings.pop("prefix", None)
        if prefix is None:
            prefix = getattr(self.model.config, "prefix", None) or ""
        return prefix, {**with_length(settings), **options}

    def task_key(self, params: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """The task_specific_params entry this call reads, and options the languages imply."""
        if self.task != "translation":
            return self.task, {}
        source, target = params.get("src_lang"), params.get("tgt_lang")
        if self.source_language is not None:  # a request's src_lang is its own, not the next's
            self.tokenizer.src_lang = self.source_language
        if source is None and target is None:
            # transformers 4's pipeline("translation") took the first direction named
            return (self.directions[0] if self.directions else None), {}
        key = f"translation_{source}_to_{target}"
        if key in self.task_params:
            return key, {}
        if hasattr(self.tokenizer, "src_lang"):  # mBART, NLLB, M2M100: languages by code
            source = source or self.source_language  # the text's, as when neither is named
            if not (source and target):
                raise ValueError(
                    "this model translates between languages named by code: send tgt_lang "
                    "(and src_lang, the text's, where the model names none)"
                )
            source_id, target_id = self.tokenizer.convert_tokens_to_ids([source, target])
            # (the unknown token: a code not in its vocabulary; "</s>", "<pad>", "<mask>"
            # are tokens of it, but no language: generation was forced to start on them)
            specials = {getattr(self.tokenizer, f"{name}_token_id", None) for name in NAMED_TOKENS}
            for language, token_id in ((source, source_id), (target, target_id)):
                if token_id is None or token_id in specials:
                    raise ValueError(f"this model does not know the language {language!r}")
            self.tokenizer.src_lang = source
            return None, {"forced_bos_token_id": target_id}
        if self.directions:
            # one language named: the one direction that has it, where there is one
            named = [
                direction
                for direction in self.directions
                if (source is None or direction.startswith(f"translation_{source}_to_"))
                and (target is None or direction.endswith(f"_to_{target}"))
            ]
            if len(named) == 1:  # (both named: the exact entry, taken above, or none)
                return named[0], {}
            if len(named) > 1:  # (only one language named: the other decides)
                other = "tgt_lang" if target is None else "src_lang"
                raise ValueError(f"this model translates as {', '.join(named)}: name {other} too")
            asked = " ".join(
                f"{word} {language!r}"
                for word, language in (("from", source), ("to", target))
                if language is not None
            )
            raise ValueError(
                f"this model does not translate {asked} (it names {', '.join(self.directions)})"
            )
        return None, {}  # a one-direction model: the languages change nothing, as in transformers 4

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        prefix, task_options = self.task_settings(params)
        caller = {name: params[name] for name in GENERATE_PARAMS if name in params}
        caller.update(params.get("generate_parameters", {}))
        options = {**self.defaults, **task_options, **with_length(caller)}
        configured = self.model.generation_config
        own = {
            "max_new_tokens": configured.max_new_tokens,
            "max_length": configured.max_length,
            "min_new_tokens": configured.min_new_tokens,
            "min_length": configured.min_length,
        }
        options = settled(options, caller, own)
        self.check_length(caller)
        reading = self.cut(params)
        self.refuse_unread(inputs)
        texts = [prefix + text for text in inputs]

        def encode(items: list[str]) -> Any:
            return self.tokenizer(items, padding=True, return_tensors="pt", **reading)

        if reading["truncation"]:  # a long text cut first (`long_texts`), as it is truncated
            limit = reading["max_length"]
            encoded = encode_cut(encode, texts, narrowed_texts(self.tokenizer, texts, limit), limit)
        else:
            encoded = encode(texts)
        encoded.pop("token_type_ids", None)  # tokenizers that make them; generate() refuses them
        self.refuse_unreadable(encoded["input_ids"])
        length = encoded["input_ids"].shape[1]
        if length > self.input_limit:
            raise ValueError(  # the encoder would fail on it: say so (truncation was refused)
                f"the input is {length} tokens and this model reads at most "
                f"{self.input_limit}: leave out truncation, or set it to true, "
                "longest_first or only_first, to cut it"
            )
        with torch.inference_mode():
            generated = self.model.generate(
                **encoded.to(self.device),
                **options,
                stopping_criteria=transformers.StoppingCriteriaList(
                    [Abandoned(self.batch_cancelled)]
                ),
            )
        texts = decoded(self.tokenizer, generated, params.get("clean_up_tokenization_spaces"))
        key = OUTPUT_KEYS[self.task]
        per_input = len(texts) // len(inputs)
        outputs: list[Any] = []
        for index in range(len(inputs)):
            records = [{key: text} for text in texts[index * per_input : (index + 1) * per_input]]
            outputs.append(records[0] if per_input == 1 else records)
        return outputs

    def refuse_unread(self, inputs: list[str]) -> None:
        """ValueError (a 422) for an input the tokenizer reads as no token at all, as a
        blank one is refused: a T5's, or a BERT tokenizer's, skips control and format
        characters (a byte-level BART reads them), and the model, seeing its task's prefix
        alone, made up an answer. Texts without a letter or a digit are read again (a
        letter is read, as itself or as the unknown token): control characters, combining
        marks, private-use characters, U+FFFD, which such a tokenizer drops."""
        unseen = [text for text in inputs if not any(char.isalnum() for char in text)]
        if unseen and not all(self.tokenizer(unseen, add_special_tokens=False)["input_ids"]):
            raise ValueError(
                "the text reads as no tokens: only control or format characters, which this "
                "model's tokenizer skips"
            )

    def check_length(self, caller: dict[str, Any]) -> None:
        """A length past the decoder's positions would fail inside the model: say so
        (`max_length` counts the decoder's start token; beside `max_new_tokens`, generate
        does not read it)."""
        if self.position_limit is None:
            return
        for name, limit in (
            ("max_new_tokens", self.position_limit),
            ("max_length", self.position_limit + 1),
        ):
            if name == "max_length" and caller.get("max_new_tokens") is not None:
                continue
            if (caller.get(name) or 0) > limit:
                raise ValueError(f"{name} {caller[name]} is over this model's limit of {limit}")

    def cut(self, params: dict[str, Any]) -> dict[str, Any]:
        """The tokenizer's truncation arguments: the caller's strategy, else the input
        limit (transformers 4 did not truncate, and failed on inputs past the positions).
        A strategy cuts at the tokenizer's limit, bounded by the positions: a tokenizer
        saved without one declares ~1e30, which would cut nothing."""
        truncation = params.get("truncation")
        # only_second cuts nothing of a single text (the tokenizer fails on one too long)
        if truncation in ("do_not_truncate", "only_second", False):
            return {"truncation": False}
        if truncation is not None:
            declared = self.tokenizer.model_max_length
            return {"truncation": truncation, "max_length": min(declared, self.input_limit)}
        return {"truncation": True, "max_length": self.input_limit}


def settled(
    options: dict[str, Any], caller: dict[str, Any], own: dict[str, Any] | None = None
) -> dict[str, Any]:
    """generate() options as the causal LM's are read (`options`, made for this call, are
    changed in place): a temperature of 0 is greedy, a tiny one no less than the causal
    LM's least; a least asked past the most that `options`, else the model's `own`
    generation config, set, with no most asked, raises that most; and ValueError, in
    words a client can act on, for what generate() would refuse in its own (it named
    `decoder_input_ids`)."""
    greedy_at_zero_temperature(options)
    at_least_the_least_temperature(options)
    answers, beams = options.get("num_return_sequences") or 1, options.get("num_beams") or 1
    # (beam sampling keeps num_beams answers too: only a sample of one beam draws more)
    if answers > beams and (beams > 1 or not options.get("do_sample")):
        raise ValueError(
            f"num_return_sequences {answers} asks for more answers than num_beams {beams} "
            "keeps: ask for at most num_beams, or set do_sample true and num_beams 1 to "
            "draw them"
        )
    if caller.get("max_length") == 1 and caller.get("max_new_tokens") is None:
        raise ValueError(
            "max_length 1 holds only the decoder's start token, which it counts: ask for "
            "2 or more, or give max_new_tokens"
        )
    least = new_tokens(caller, "min_new_tokens", "min_length")
    if least is None:
        return the_most_asked_wins(options, caller, own)
    most = new_tokens(caller, "max_new_tokens", "max_length")
    if most is None:  # none asked: the model's own most, raised to the least asked
        made = new_tokens(options, "max_new_tokens", "max_length")
        if made is None:  # (a config's max_length: generate() reads it there)
            made = new_tokens(own or {}, "max_new_tokens", "max_length")
        if made is not None and made[1] < least[1]:
            options["max_new_tokens"] = least[1]
    elif least[1] > most[1]:  # (generate() would stop at the most, the least unmet)
        raise ValueError(f"{least[0]} asks for more new tokens than {most[0]} allows")
    return options


def the_most_asked_wins(
    options: dict[str, Any], caller: dict[str, Any], own: dict[str, Any] | None
) -> dict[str, Any]:
    """`options` (changed in place) for a caller that asks no least: where it asks a most,
    a least the task's settings or the model's `own` generation config set past it
    lowered to it, as generate() stops at the most anyway (it warned at every such
    request that the two could not both be met). (That both a max_new_tokens and a
    max_length are set, generate() says too: `LengthsSettled` leaves it out.)"""
    most = new_tokens(caller, "max_new_tokens", "max_length")
    if most is not None:
        least = new_tokens(options, "min_new_tokens", "min_length")
        if least is None:
            least = new_tokens(own or {}, "min_new_tokens", "min_length")
        if least is not None and least[1] > most[1]:  # (lowered where it was set)
            if least[0].startswith("min_new_tokens"):
                options["min_new_tokens"] = most[1]
            else:  # (min_length counts the decoder's start token)
                options["min_length"] = most[1] + 1
    return options


def new_tokens(options: dict[str, Any], new: str, length: str) -> tuple[str, int] | None:
    """The new tokens `options` ask for, as generate() reads them: `new` (max_new_tokens
    or min_new_tokens), else `length` (max_length or min_length), which counts the
    decoder's start token; with the words that asked (None: neither)."""
    if options.get(new) is not None:
        return f"{new} {options[new]}", options[new]
    if options.get(length) is not None:
        asked = options[length]
        return f"{length} {asked} (the decoder's start token and {asked - 1} new)", asked - 1
    return None


def with_length(options: dict[str, Any]) -> dict[str, Any]:
    """A max_length given without max_new_tokens is the length wanted: no default
    max_new_tokens may override it (generate() lets max_new_tokens win when both are set)."""
    if "max_length" in options and "max_new_tokens" not in options:
        return {**options, "max_new_tokens": None}
    return options


def decoded(tokenizer: Any, generated: Any, clean_up: bool | None) -> list[str]:
    """The texts of `generated`, their special tokens left out, and with `clean_up` the
    spaces before punctuation removed as transformers 4.57 did for any tokenizer, whose
    answers these routes give (5 skips it for a BPE one, BART's: `"hello world ."` stayed
    so, the client told nothing)."""
    texts = tokenizer.batch_decode(
        generated, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    return [tokenizer.clean_up_tokenization(text) for text in texts] if clean_up else texts
