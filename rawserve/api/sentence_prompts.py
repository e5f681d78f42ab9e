"""A sentence-transformers model's named prompts (`config_sentence_transformers.json`'s
`prompts`, e.g. "query: "): `prompt_name` puts one before each text, on TEI's `/embed`
and on `POST /` where InferenceClient's `feature_extraction(prompt_name=...)` sends it;
without one, the prompt `default_prompt_name` names goes there, as sentence-transformers
puts it, on every embedding route.

Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rawserve.api.served import ServedModel
from rawserve.http.errors import BadRequest


def prompts_of(model: ServedModel) -> Mapping[str, str]:
    loaded = model.serving.loaded
    return loaded.details.get("prompts", {}) if loaded else {}


def prompted(model: ServedModel, texts: Sequence[str], prompt_name: str | None) -> list[str]:
    """`texts`, each after the prompt `prompt_name` names (None: the model's default
    prompt, if it has one); 400 for a name the model's prompts do not have (listing those
    it has)."""
    if prompt_name is None:
        loaded = model.serving.loaded
        prompt_name = loaded.details.get("default_prompt_name") if loaded else None
        if prompt_name is None:
            return list(texts)
    prompts = prompts_of(model)
    prompt = prompts.get(prompt_name)
    if prompt is None:
        if not prompts:
            raise BadRequest(f"prompt_name {prompt_name[:100]!r}: this model names no prompts")
        # in TEI's words: tei-client's `prompt_names()` reads the list out of this message
        listed = ", ".join(f'"{name}"' for name in sorted(prompts))
        raise BadRequest(
            f"prompt_name {prompt_name[:100]!r} is not a prompt of this model. "
            f"Available prompts: [{listed}]"
        )
    return [prompt + text for text in texts]
