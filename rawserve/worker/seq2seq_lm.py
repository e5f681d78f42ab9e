"""summarization, translation and text2text-generation on an `AutoModelForSeq2SeqLM`
(transformers 5 no longer has pipelines for them).

Worker process only (imports torch and transformers). Tokenize the batch (with the prefix the
model's config names for the task, e.g. T5's "summarize: "), `generate`, decode, and
answer `{"summary_text"}` / `{"translation_text"}` / `{"generated_text"}` per input, as
the removed pipelines and the Inference API did.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from rawserve.shared.messages import ModelLimits
from rawserve.tasks import GENERATE_PARAMS
from rawserve.worker.runner import Runner, dtype_name

DEFAULT_MAX_NEW_TOKENS = 128
OUTPUT_KEYS = {
    "summarization": "summary_text",
    "translation": "translation_text",
    "text2text-generation": "generated_text",
}


class Seq2SeqLMRunner(Runner):
    def __init__(self, model: str, task: str, device: str, torch_dtype: Any):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        self.model = transformers.AutoModelForSeq2SeqLM.from_pretrained(model, dtype=torch_dtype)
        self.model.to(device).eval()
        super().__init__(task, device, dtype_name(self.model), tokenizer)
        self.task_params: dict[str, Any] = self.model.config.task_specific_params or {}
        configured = self.model.generation_config.to_diff_dict()
        # without a length in the model's generation config, generate() stops at 20 tokens
        self.defaults = (
            {}
            if {"max_length", "max_new_tokens"} & set(configured)
            else {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS}
        )
        self.max_length = min(
            self.tokenizer.model_max_length,
            getattr(self.model.config, "max_position_embeddings", None) or 1_000_000,
        )

    @property
    def limits(self) -> ModelLimits:
        # the decoder starts from one token; models with relative positions (T5) have no
        # such bound
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return ModelLimits(
            max_input_tokens=self.max_length,  # inputs are truncated to it by default
            max_new_tokens=positions - 1 if positions else None,
        )

    @property
    def details(self) -> dict[str, Any]:
        return {"translations": sorted(k for k in self.task_params if k.startswith("translation"))}

    def prefix_and_options(self, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The text to put before each input, and generate() options the model implies."""
        if self.task == "summarization":
            return self.task_params.get("summarization", {}).get("prefix", ""), {}
        if self.task != "translation":
            return "", {}
        source, target = params.get("src_lang"), params.get("tgt_lang")
        if source is None and target is None:
            # a model trained for one direction names it in its config
            directions = [k for k in self.task_params if k.startswith("translation")]
            if len(directions) == 1:
                return self.task_params[directions[0]].get("prefix", ""), {}
            return "", {}
        key = f"translation_{source}_to_{target}"
        if key in self.task_params:
            return self.task_params[key].get("prefix", ""), {}
        if hasattr(self.tokenizer, "src_lang") and source and target:  # mBART, NLLB, M2M100
            target_id = self.tokenizer.convert_tokens_to_ids(target)
            if target_id in (None, self.tokenizer.unk_token_id):
                raise ValueError(f"this model does not know the language {target!r}")
            self.tokenizer.src_lang = source
            return "", {"forced_bos_token_id": target_id}
        raise ValueError(f"this model does not translate from {source!r} to {target!r}")

    def run(self, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
        prefix, options = self.prefix_and_options(params)
        truncation = params.get("truncation", "longest_first")
        encoded = self.tokenizer(
            [prefix + text for text in inputs],
            padding=True,
            truncation=False if truncation == "do_not_truncate" else truncation,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        generate_options = {
            **self.defaults,
            **{name: params[name] for name in GENERATE_PARAMS if name in params},
            **params.get("generate_parameters", {}),
            **options,
        }
        with torch.inference_mode():
            generated = self.model.generate(**encoded, **generate_options)
        texts = self.tokenizer.batch_decode(
            generated,
            skip_special_tokens=True,
            clean_up_tokenization_spaces=params.get("clean_up_tokenization_spaces", False),
        )
        key = OUTPUT_KEYS[self.task]
        return [{key: text} for text in texts]
