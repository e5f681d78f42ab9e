"""Per-task input rules and output shaping, in one place."""

from __future__ import annotations

import math
import re

import pytest

from rawserve.api.inference import (
    parse_binary_body,
    parse_json_body,
    parse_text_body,
    takes_binary_body,
)
from rawserve.http.errors import BadRequest, UnprocessableInput
from rawserve.tasks import (
    CUSTOM_TASK,
    TASKS,
    InvalidRequest,
    batch_key,
    check_generation_length,
    check_params,
    onnx_unfit,
    shape_answer,
    split_outputs,
)
from rawserve.tasks.rules import UNKNOWN_POSITIONS_NEW_TOKENS


def test_raw_text_is_one_input():
    parsed = parse_text_body("fill-mask", "test [MASK]")
    assert parsed.inputs == ["test [MASK]"] and parsed.params == {} and not parsed.is_list


def test_json_list_is_split_into_items():
    parsed = parse_json_body(
        "fill-mask", {"inputs": ["a [MASK]", "b [MASK]"], "parameters": {"top_k": 2}}
    )
    assert (
        parsed.inputs == ["a [MASK]", "b [MASK]"]
        and parsed.params == {"top_k": 2}
        and parsed.is_list
    )


@pytest.mark.parametrize(
    "document",
    [
        {"inputs": "x", "parameters": {"unknown": 1}},
        {"inputs": "x", "parameters": {"top_k": 0}},
        {"inputs": "x", "parameters": {"top_k": True}},
        {"inputs": "x", "parameters": []},
        {"inputs": "x", "options": "x"},  # (the Inference API's options: an object)
        {"inputs": 5},
        {"inputs": []},
        {"inputs": ["x", 5]},
        {"input": "x"},
        ["x"],
        "x",
        {"inputs": "x", "extra": 1},
    ],
)
def test_invalid_documents_are_400(document):
    with pytest.raises(BadRequest):
        parse_json_body("fill-mask", document)


def test_required_parameters():
    with pytest.raises(BadRequest, match="candidate_labels"):
        parse_text_body("zero-shot-classification", "hello")
    parsed = parse_json_body(
        "zero-shot-classification", {"inputs": "hi", "parameters": {"candidate_labels": ["a", "b"]}}
    )
    assert parsed.params == {"candidate_labels": ["a", "b"]}


@pytest.mark.parametrize(
    ("task", "parameters"),
    [
        ("zero-shot-classification", {"candidate_labels": ["a", "  "]}),
        ("zero-shot-classification", {"candidate_labels": "\t"}),
        ("fill-mask", {"targets": [" "]}),
        ("token-classification", {"ignore_labels": ["O", " "]}),
        ("zero-shot-classification", {"candidate_labels": ["\u200b", "b"]}),
        ("zero-shot-classification", {"candidate_labels": "\ufeff\u200d, b"}),
        ("fill-mask", {"targets": ["\u200b", "b"]}),
    ],
)
def test_a_label_or_target_of_spaces_is_refused_as_an_empty_one_is(task, parameters):
    """A zero-shot label of spaces was scored as a label, where "" was refused; so was
    one of only format characters (a zero-width space), and a fill-mask target of one
    beside another was dropped unsaid."""
    text = "hi [MASK]" if task == "fill-mask" else "hi"
    with pytest.raises(BadRequest, match="none blank"):
        parse_json_body(task, {"inputs": text, "parameters": parameters})


def test_another_tasks_parameters_say_which_task_takes_them():
    """An NLI model served as text-classification (its task read from its architecture)
    was sent zero-shot's candidate_labels: "unknown parameter(s)", with no word of the
    task that takes them."""
    document = {"inputs": "hi", "parameters": {"candidate_labels": ["a", "b"]}}
    with pytest.raises(BadRequest, match="candidate_labels is a parameter of zero-shot-"):
        parse_json_body("text-classification", document)
    with pytest.raises(BadRequest) as refused:  # no task's: no word of one
        parse_json_body("text-classification", {"inputs": "hi", "parameters": {"tpo_k": 1}})
    assert "a parameter of" not in str(refused.value) and "MODEL:TASK" not in str(refused.value)
    # of several, only those another task takes are said to be its (zzz was said to be
    # zero-shot's beside candidate_labels)
    both = {"inputs": "hi", "parameters": {"zzz": 1, "candidate_labels": ["a"]}}
    with pytest.raises(BadRequest) as refused:
        parse_json_body("text-classification", both)
    assert "; candidate_labels is a parameter of zero-shot-classification (a" in str(refused.value)
    assert "zzz is" not in str(refused.value)


def test_another_tasks_fields_say_which_task_takes_them():
    """TGI's client sends `"stream": false` beside "inputs": aimed at an embedding model,
    it read "unknown field(s): 'stream' (allowed: ...)", where the OpenAI routes say that
    a text-generation model is needed."""
    document = {"inputs": "hi", "parameters": {"max_new_tokens": 3}, "stream": False}
    with pytest.raises(BadRequest) as refused:
        parse_json_body("feature-extraction", document)
    assert str(refused.value) == (
        "unknown field(s) for feature-extraction: 'stream'; stream is a field of "
        "text-generation (a model is served for one task: MODEL:TASK); allowed: dimensions, "
        "encoding_format, inputs, normalize, options, parameters, pooling, prompt_name, "
        "truncate, truncation_direction"
    )
    with pytest.raises(BadRequest) as refused:  # no task's: the fields it takes, as before
        parse_json_body("feature-extraction", {"inputs": "hi", "straem": True})
    assert str(refused.value).startswith("unknown field(s): 'straem' (allowed: dimensions, ")
    assert parse_json_body("text-generation", document).params == {"max_new_tokens": 3}
    # past the names shown, still said; a handler's takes what it likes: no task's word
    many = {"inputs": "hi", **{f"a{i}": 1 for i in range(5)}, "stream": True}
    with pytest.raises(BadRequest, match="'a4' and 1 more; stream is a field of text-gen"):
        parse_json_body("feature-extraction", many)
    with pytest.raises(BadRequest) as refused:
        parse_json_body(CUSTOM_TASK, {"inputs": "hi", "stream": True})
    assert "MODEL:TASK" not in str(refused.value)


def test_unknown_parameters_are_said_with_every_parameter_the_task_takes_whole():
    """The README's `top_k` to the default model (feature-extraction): its hint (ten tasks
    take it) was cut at 300 characters; a generation model's allowed list then lost seed,
    stop, temperature, top_k and top_p to the cut. The message is said whole, the client's
    names in it bounded."""
    from rawserve.http.errors import MAX_MESSAGE_CHARS, error_document

    document = {"inputs": "a [MASK]", "parameters": {"top_k": 2}}
    with pytest.raises(BadRequest) as refused:
        parse_json_body("feature-extraction", document)
    message = error_document(refused.value)["error"]
    assert "top_k is a parameter of fill-mask, " in message
    assert " other tasks (a model is served for one task: MODEL:TASK); allowed: " in message
    document = {"inputs": "hi", "parameters": {"candidate_labels": ["a"]}}
    with pytest.raises(BadRequest) as refused:
        parse_json_body("text-generation", document)
    message = error_document(refused.value)["error"]
    assert len(message) > MAX_MESSAGE_CHARS and not message.endswith("...")
    assert message.endswith(
        ", seed, stop, temperature, top_k, top_n_tokens, top_p, truncate, typical_p, watermark"
    ), message
    flood = {f"{index:03d}" + "x" * 1000: 1 for index in range(50)}
    with pytest.raises(BadRequest) as refused:
        parse_json_body("text-generation", {"inputs": "hi", "parameters": flood})
    message = error_document(refused.value)["error"]
    assert "x" * 41 not in message and " and 45 more; allowed: " in message
    assert len(message) < 2 * 1024


@pytest.mark.parametrize(
    ("given", "labels"),
    [
        ("urgent, not urgent", ["urgent", "not urgent"]),  # the pipeline splits a text
        ("sports,politics , ", ["sports", "politics"]),
        ("sports", ["sports"]),
        (["a, b", "c"], ["a, b", "c"]),  # a list is the labels as they are
    ],
)
def test_zero_shot_candidate_labels_in_one_text_are_split_at_commas(given, labels):
    parsed = parse_json_body(
        "zero-shot-classification", {"inputs": "hi", "parameters": {"candidate_labels": given}}
    )
    assert parsed.params == {"candidate_labels": labels}
    with pytest.raises(BadRequest, match="candidate_labels"):
        parse_json_body(
            "zero-shot-classification", {"inputs": "hi", "parameters": {"candidate_labels": ", "}}
        )


@pytest.mark.parametrize("label", ["{}", "{0}"])
def test_a_zero_shot_label_that_is_the_template_s_place_is_refused_in_our_words(label):
    """The pipeline takes a template left unchanged once filled for one that takes no
    label, and blamed the template: the label is refused, naming it."""
    with pytest.raises(BadRequest, match="a label cannot be"):
        parse_json_body(
            "zero-shot-classification",
            {"inputs": "hi", "parameters": {"candidate_labels": [label, "b"]}},
        )


def test_token_classification_ignores_no_label_when_asked_with_an_empty_list():
    parsed = parse_json_body(
        "token-classification", {"inputs": "hi", "parameters": {"ignore_labels": []}}
    )
    assert parsed.params == {"ignore_labels": []}  # every entity, "O" too, as the pipeline


@pytest.mark.parametrize(
    ("sent", "read"),
    [("O", ["O"]), ("B-PER,I-LOC, O", ["B-PER", "I-LOC", "O"]), (["B-PER,I-LOC"], ["B-PER,I-LOC"])],
)
def test_token_classification_reads_a_text_of_labels_to_ignore_as_zero_shot_reads_one(sent, read):
    """One text was one label: "B-PER,I-LOC,O" left every I-LOC entity in, where the
    list form, and the pipeline's own reading of a text (by `in`), left them out."""
    parsed = parse_json_body(
        "token-classification", {"inputs": "hi", "parameters": {"ignore_labels": sent}}
    )
    assert parsed.params == {"ignore_labels": read}


def test_pairs_and_question_answering_inputs():
    assert parse_json_body(
        "text-classification", {"inputs": {"text": "a", "text_pair": "b"}}
    ).inputs == [{"text": "a", "text_pair": "b"}]
    with pytest.raises(BadRequest):
        parse_json_body("question-answering", {"inputs": {"question": "q"}})


@pytest.mark.parametrize(
    ("task", "item"),
    [
        ("question-answering", {"question": "q", "context": "c", "answer": "a"}),
        ("text-classification", {"text": "a", "text_pair": "b", "label": "x"}),
        ("text-classification", {"text": "a", "pair": "b"}),  # a misspelt text_pair
    ],
)
def test_an_input_object_with_a_field_the_task_does_not_read_is_400(task, item):
    """A field the task does not read (a misspelt text_pair) would be silently left
    out, and the model answer another question than the one asked."""
    with pytest.raises(BadRequest, match="each input must be"):
        parse_json_body(task, {"inputs": item})


def test_batch_key_ignores_parameter_order():
    assert batch_key({"a": 1, "b": 2}) == batch_key({"b": 2, "a": 1})
    assert batch_key({"a": 1}) != batch_key({"a": 2})


def test_split_outputs_puts_back_the_list_a_one_item_call_dropped():
    predictions = [{"score": 0.5, "token": 1}]
    assert split_outputs("fill-mask", ["a [MASK]"], predictions) == [predictions]
    assert split_outputs("fill-mask", ["a", "b"], [predictions, predictions]) == [predictions] * 2
    assert split_outputs("text-classification", ["a"], [{"label": "x"}]) == [{"label": "x"}]
    with pytest.raises(RuntimeError):
        split_outputs("text-classification", ["a", "b"], [{"label": "x"}])


# --- the shapes InferenceClient sends and expects ---------------------------------------


def test_feature_extraction_parameters_may_sit_at_the_top_level():
    # what InferenceClient.feature_extraction sends
    parsed = parse_json_body("feature-extraction", {"inputs": "hi", "normalize": True})
    assert parsed.params == {"normalize": True}
    with pytest.raises(BadRequest):
        parse_json_body("fill-mask", {"inputs": "hi", "top_k": 2})
    # in both places: the same value (or a null beside it) is taken, two values refused
    # (the top level's was taken, unsaid)
    both = {"inputs": "hi", "truncate": True, "parameters": {"truncate": True}}
    assert parse_json_body("feature-extraction", both).params == {"truncate": True}
    unset = {"inputs": "hi", "dimensions": None, "parameters": {"dimensions": 8}}
    assert parse_json_body("feature-extraction", unset).params == {"dimensions": 8}
    null_within = {"inputs": "hi", "dimensions": 8, "parameters": {"dimensions": None}}
    assert parse_json_body("feature-extraction", null_within).params == {"dimensions": 8}
    for differing in (
        {"inputs": "hi", "dimensions": 4, "parameters": {"dimensions": 8}},
        {"inputs": "hi", "normalize": True, "parameters": {"normalize": 1}},  # 1 is no flag
    ):
        with pytest.raises(BadRequest, match='is given beside "inputs" and in'):
            parse_json_body("feature-extraction", differing)


def test_explicit_nulls_are_dropped():
    parsed = parse_json_body(
        "text-generation", {"inputs": "hi", "parameters": {"max_new_tokens": 4, "seed": None}}
    )
    assert parsed.params == {"max_new_tokens": 4}


def test_stream_is_a_top_level_field_of_text_generation_only():
    parsed = parse_json_body(
        "text-generation", {"inputs": "hi", "parameters": {"details": True}, "stream": True}
    )
    assert parsed.stream and parsed.params == {"details": True}
    assert not parse_json_body("text-generation", {"inputs": "hi", "stream": False}).stream
    for document in (
        {"inputs": ["a", "b"], "stream": True},
        {"inputs": "a", "stream": "yes"},
    ):
        with pytest.raises(BadRequest):
            parse_json_body("text-generation", document)
    with pytest.raises(BadRequest):
        parse_json_body("fill-mask", {"inputs": "a [MASK]", "stream": True})


@pytest.mark.parametrize(
    ("task", "parameters"),
    [
        ("text-generation", {"stop": ["a"] * 17}),
        ("text-generation", {"stop": [""]}),
        ("text-generation", {"temperature": -1}),
        ("text-generation", {"repetition_penalty": 0}),  # (it divides the scores)
        ("text-generation", {"top_p": 1.5}),
        ("text-generation", {"num_beams": 2}),  # not TGI's (TGI's unserved ones are 422)
        ("question-answering", {"align_to_words": "yes"}),
        ("question-answering", {"doc_stride": -1}),
        ("question-answering", {"padding": "longest"}),
        ("question-answering", {"top_k": 0}),
        ("zero-shot-classification", {"candidate_labels": []}),
        ("zero-shot-classification", {"candidate_labels": None}),  # (null: not given)
        *(
            ("zero-shot-classification", {"candidate_labels": ["a"], "hypothesis_template": t})
            for t in ("{} {}", "{x}", "{:>1000000}", "{0.__class__}", "{", "no place", "{!r}")
        ),
        ("zero-shot-classification", {"candidate_labels": ["a"], "multi_label": "yes"}),
        ("token-classification", {"aggregation_strategy": "mean"}),
        ("text-classification", {"function_to_apply": "relu"}),
        ("summarization", {"generate_parameters": {"eos_token_id": 1}}),
        ("summarization", {"generate_parameters": {"repetition_penalty": 0}}),
        ("summarization", {"src_lang": "en"}),
        ("summarization", {"num_return_sequences": 0}),
        ("summarization", {"stop_sequence": "."}),
        ("translation", {"src_lang": ""}),
        ("feature-extraction", {"pooling": "max"}),
        ("feature-extraction", {"dimensions": 0}),
    ],
)
def test_parameters_outside_the_rules_are_400(task, parameters):
    document = {
        "inputs": {"question": "q", "context": "c"} if task == "question-answering" else "x"
    }
    with pytest.raises(BadRequest):
        parse_json_body(task, {**document, "parameters": parameters})


@pytest.mark.parametrize(
    ("task", "name", "given", "read"),
    [
        ("text-classification", "function_to_apply", "SOFTMAX", "softmax"),
        ("image-classification", "function_to_apply", "Sigmoid", "sigmoid"),
        ("token-classification", "aggregation_strategy", "SIMPLE", "simple"),
    ],
)
def test_the_pipelines_named_choices_are_taken_in_any_case(task, name, given, read):
    """transformers reads them as an enum's members by name, upper-cased."""
    inputs = "aGVsbG8=" if task == "image-classification" else "x"
    parsed = parse_json_body(task, {"inputs": inputs, "parameters": {name: given}})
    assert parsed.params[name] == read


def test_a_hypothesis_template_has_one_place_for_the_label():
    for template in ("This text is about {}.", "{0} is the topic"):
        parsed = parse_json_body(
            "zero-shot-classification",
            {
                "inputs": "x",
                "parameters": {"candidate_labels": "a", "hypothesis_template": template},
            },
        )
        assert parsed.params["hypothesis_template"] == template
    with pytest.raises(BadRequest, match='must hold one "{}", where each label goes'):
        parse_json_body(
            "zero-shot-classification",
            {"inputs": "x", "parameters": {"candidate_labels": "a", "hypothesis_template": "{x}"}},
        )


def test_a_nested_generate_parameter_is_named_where_it_is_refused():
    with pytest.raises(BadRequest, match="'generate_parameters' has num_beams, which must be an"):
        parse_json_body(
            "summarization",
            {"inputs": "x", "parameters": {"generate_parameters": {"num_beams": 9}}},
        )


def test_seq2seq_parameters_as_the_inference_api_names_them():
    parsed = parse_json_body(
        "translation",
        {
            "inputs": "hello",
            "parameters": {
                "src_lang": "en",
                "tgt_lang": "fr",
                "clean_up_tokenization_spaces": True,
                "truncation": "only_first",
                "generate_parameters": {"max_new_tokens": 5, "num_beams": 2, "top_k": None},
            },
        },
    )
    assert parsed.params["generate_parameters"] == {"max_new_tokens": 5, "num_beams": 2}
    assert parsed.params["src_lang"] == "en"


@pytest.mark.parametrize(
    ("params", "positions", "taken"),
    [
        ({"max_new_tokens": 5000}, 16_384, True),  # LED's 16k: was 400 past 1,024
        ({"generate_parameters": {"max_length": 5001}}, 16_384, True),
        ({"max_new_tokens": 16_384}, 16_384, False),  # the decoder's start takes one
        ({"max_new_tokens": 4096}, None, True),  # T5's relative positions: the ceiling
        ({"max_new_tokens": 4097}, None, False),
        ({"generate_parameters": {"max_length": 4098}}, None, False),
        ({"min_new_tokens": 4097}, None, False),
        # max_length and min_length count the decoder's start token: one more
        ({"max_length": 16_384}, 16_384, True),
        ({"max_length": 16_385}, 16_384, False),
        ({"generate_parameters": {"max_length": 4097}}, None, True),
        ({"min_length": 4097}, None, True),
        ({"min_length": 4098}, None, False),
        # ... and transformers' generate takes max_new_tokens over them (a tester)
        ({"max_new_tokens": 128, "max_length": 200}, 129, True),
        ({"generate_parameters": {"max_length": 200}, "max_new_tokens": 128}, 129, True),
        ({"min_new_tokens": 1, "min_length": 200}, 129, True),
        ({"max_new_tokens": 129, "max_length": 20}, 129, False),
        # the worker reads generate_parameters over the parameters beside them (a tester)
        ({"max_new_tokens": 129, "generate_parameters": {"max_new_tokens": 5}}, 129, True),
        ({"max_new_tokens": 5, "generate_parameters": {"max_new_tokens": 129}}, 129, False),
    ],
)
def test_seq2seq_lengths_reach_the_decoder_s_positions(params, positions, taken):
    """A model of long positions takes a long summary; one of unknown positions takes up
    to `UNKNOWN_POSITIONS_NEW_TOKENS`."""
    parsed = parse_json_body("summarization", {"inputs": "x", "parameters": params})
    longest = positions - 1 if positions else None
    if taken:
        check_generation_length(parsed.params, longest)
    else:
        with pytest.raises(InvalidRequest) as refused:
            check_generation_length(parsed.params, longest)
        if str(refused.value).startswith(("max_length", "min_length")):  # not new tokens alone
            top = (longest or UNKNOWN_POSITIONS_NEW_TOKENS) + 1
            assert f"this model's decoder holds at most {top} tokens: its start token" in str(
                refused.value
            )
        else:
            assert "and this model generates at most" in str(refused.value)


@pytest.mark.parametrize(
    ("task", "item", "single"),
    [
        # text-classification: InferenceClient reads answer[0] as the list of labels
        ("text-classification", {"label": "A", "score": 1.0}, [[{"label": "A", "score": 1.0}]]),
        ("text-classification", [{"label": "A", "score": 1.0}], [[{"label": "A", "score": 1.0}]]),
        ("summarization", {"summary_text": "s"}, [{"summary_text": "s"}]),
        ("translation", {"translation_text": "t"}, [{"translation_text": "t"}]),
        ("text2text-generation", {"generated_text": "g"}, [{"generated_text": "g"}]),
        ("text-generation", [{"generated_text": "g"}], [{"generated_text": "g"}]),
        ("question-answering", {"answer": "a"}, {"answer": "a"}),
        ("fill-mask", [{"token_str": "a"}], [{"token_str": "a"}]),
        ("feature-extraction", [0.5, 0.5], [0.5, 0.5]),
        ("custom", {"anything": 1}, {"anything": 1}),
    ],
)
def test_answer_shapes(task, item, single):
    assert shape_answer(task, [item], is_list=False) == single
    assert shape_answer(task, [item, item], is_list=True) == [item, item]


def test_zero_shot_answers_label_score_pairs():
    raw = [{"sequence": "x", "labels": ["b", "a"], "scores": [0.75, 0.25]}]
    assert split_outputs("zero-shot-classification", ["x"], raw) == [
        [{"label": "b", "score": 0.75}, {"label": "a", "score": 0.25}]
    ]


def test_only_fill_mask_drops_the_outer_list_of_a_one_item_call():
    entities = [{"entity": "B-PER", "word": "john"}]
    # transformers 5: token-classification keeps it (see test_task_adapters for the check)
    assert split_outputs("token-classification", ["john"], [entities]) == [entities]
    assert split_outputs("token-classification", ["a", "b"], [[], entities]) == [[], entities]


def test_an_image_body_is_one_base64_input():
    assert takes_binary_body("image-classification")
    assert not takes_binary_body("text-classification") and not takes_binary_body(None)
    assert parse_binary_body("image-classification", b"\x89PNG").inputs == ["iVBORw=="]
    with pytest.raises(UnprocessableInput):
        parse_binary_body("image-classification", b"")
    with pytest.raises(BadRequest):
        parse_json_body("image-classification", {"inputs": "not base64!"})


@pytest.mark.parametrize(
    "sent",
    [
        "data:image/png;base64,iVBORw==",  # a data URL, as browsers and OpenAI's clients send
        "iVBO\nRw==\n",  # base64 wrapped in lines, as `base64` and base64.encodebytes write it
        "data:image/png;base64,iVBO\r\nRw==",
        "DATA:Image/PNG;Base64,iVBORw==",  # RFC 2397's scheme and type, in any case
        # a type not known (a browser's FileReader's), or none: the bytes are Pillow's to
        # read (it was 400, "must be an image, base64-encoded")
        "data:application/octet-stream;base64,iVBORw==",
        "data:;base64,iVBORw==",
    ],
)
def test_an_image_in_json_is_read_as_transformers_load_image_reads_it(sent):
    assert parse_json_body("image-classification", {"inputs": sent}).inputs == ["iVBORw=="]


@pytest.mark.parametrize("sent", ["http://127.0.0.1/cat.png", "file:///etc/hosts"])
def test_an_image_is_never_fetched_or_read_from_a_path(sent):
    with pytest.raises(BadRequest, match="base64"):
        parse_json_body("image-classification", {"inputs": sent})


def test_a_data_url_of_another_type_is_said_to_be_no_image():
    with pytest.raises(BadRequest, match="a data URL of text/plain is no image"):
        parse_json_body("image-classification", {"inputs": "data:text/plain;base64,aGk="})


@pytest.mark.parametrize("sent", ["data:image/png,AAAA", "data:image/png;utf8,AAAA"])
def test_a_data_url_not_in_base64_is_refused(sent):
    """Its payload is the image's bytes as they are (percent-encoded), not base64: read
    as base64, another image (or none) would be classified."""
    with pytest.raises(BadRequest, match="base64"):
        parse_json_body("image-classification", {"inputs": sent})


def test_an_image_url_is_refused_saying_it_is_never_fetched():
    with pytest.raises(BadRequest, match="an image URL is never fetched"):
        parse_json_body("image-classification", {"inputs": " HTTPS://example.com/cat.png"})


@pytest.mark.parametrize("sent", ["data:image/png;base64,", " \n"])
def test_an_image_with_nothing_in_it_is_blank(sent):
    with pytest.raises(UnprocessableInput, match="empty"):
        parse_json_body("image-classification", {"inputs": sent})


# --- empty input: 422 on every task, alone or inside a list -----------------------------

BLANK_INPUTS = {
    "question-answering": [
        {"question": "", "context": "john lives in paris"},
        {"question": "who lives in paris?", "context": " \n\t"},
    ],
    "text-classification": ["", {"text": "  ", "text_pair": "b"}, {"text": "a", "text_pair": ""}],
    "image-classification": [""],
}
FILLED_INPUTS = {
    "question-answering": {"question": "who?", "context": "john lives in paris"},
    "image-classification": "iVBORw==",
}
TASK_PARAMETERS = {"zero-shot-classification": {"candidate_labels": ["a", "b"]}}


@pytest.mark.parametrize(
    ("task", "blank"),
    [
        (task, blank)
        for task in sorted(TASKS)
        for blank in BLANK_INPUTS.get(task, ["", "   ", "\n\t \u3000"])
    ],
)
@pytest.mark.parametrize("in_list", [False, True], ids=["alone", "in-list"])
def test_blank_input_is_422_on_every_task(task, blank, in_list):
    filled = FILLED_INPUTS.get(task, "hello [MASK]")
    document = {
        "inputs": [filled, blank] if in_list else blank,
        "parameters": TASK_PARAMETERS.get(task, {}),
    }
    with pytest.raises(UnprocessableInput, match="empty"):
        parse_json_body(task, document)
    if isinstance(blank, str) and not TASKS[task].binary_input and not in_list:
        with pytest.raises(UnprocessableInput, match="empty"):
            parse_text_body(task, blank)


@pytest.mark.parametrize(
    "invisible", ["\u200b", "\u0000", "\ufeff", "\u007f", " \u200b\u200d\n", "\u00ad\u2060"]
)
@pytest.mark.parametrize("task", ["text-classification", "token-classification", "fill-mask"])
def test_text_of_only_control_and_format_characters_is_blank_as_whitespace_is(task, invisible):
    """A zero-width space was scored by the classifiers as they score "" (a made-up
    answer, 200) where question answering refused it, and a blank text is refused on
    every task (a tester): such a text is blank too, named as such."""
    document = {"inputs": invisible, "parameters": TASK_PARAMETERS.get(task, {})}
    with pytest.raises(UnprocessableInput, match="is empty to a model: only control or format"):
        parse_json_body(task, document)
    for visible in ["a\u200b", "\u200b\u00e9", "\u0301", "\U0001f600", "\u200b[MASK]"]:
        parse_json_body(task, {"inputs": visible})  # (a lone combining mark is visible)


@pytest.mark.parametrize("task", ["text-generation", "translation", "summarization"])
def test_a_prompt_of_only_control_and_format_characters_is_generated_from(task):
    """A byte-level tokenizer (GPT-2's, Llama's byte fallback, BART's) reads a zero-width
    space or a NUL as tokens of its own, and TGI, vLLM and OpenAI take such a prompt: it
    was refused as blank (a tester). Whitespace alone is still blank."""
    for invisible in ["\u200b", "\u0000", "\ufeff", " \u200b\u200d\n"]:
        assert parse_json_body(task, {"inputs": invisible}).inputs == [invisible]
    with pytest.raises(UnprocessableInput, match="empty or only whitespace"):
        parse_json_body(task, {"inputs": " \n"})


# --- each parameter's bounds: what /openapi.json says is what is checked -----------------

REQUIRED_PARAMS = {"zero-shot-classification": {"candidate_labels": ["a"]}}
TEXT_SEEDS = {"hypothesis_template": "{}"}  # (a template must hold its label's place)


def _past(value, kind, direction):
    return value + direction if kind == "integer" else math.nextafter(value, direction * math.inf)


def bound_cases(schema, name):
    """(value, taken) at each bound a parameter's schema states, and just past it."""
    cases = []
    for branch in (*schema.get("oneOf", ()), *schema.get("anyOf", ())):
        cases += bound_cases(branch, name)
    kind = schema.get("type")
    if kind in ("integer", "number"):
        if "minimum" in schema:
            low = schema["minimum"]
            cases += [(low, True), (_past(low, kind, -1), False)]
        if "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"]
            cases += [(low, False), (_past(low, kind, +1), True)]
        if "maximum" in schema:
            high = schema["maximum"]
            cases += [(high, True), (_past(high, kind, +1), False)]
    elif kind == "string":
        seed = TEXT_SEEDS.get(name, "a")
        for size, taken in (
            (schema.get("maxLength"), True),
            ((schema["maxLength"] + 1) if "maxLength" in schema else None, False),
            (schema.get("minLength") or None, True),
            ((schema["minLength"] - 1) if schema.get("minLength") else None, False),
        ):
            if size is not None and (size >= len(seed) or not taken):
                cases.append(((seed + "a" * size)[:size], taken))
    elif kind == "array":
        most, least = schema.get("maxItems"), schema.get("minItems", 0)
        if most is not None:
            cases += [(["a"] * most, True), (["a"] * (most + 1), False)]
        if least:
            cases += [(["a"] * least, True), (["a"] * (least - 1), False)]
        cases += [([value], taken) for value, taken in bound_cases(schema.get("items", {}), name)]
    elif kind == "object":  # generate_parameters: each option's own bounds, nested
        for option, option_schema in schema.get("properties", {}).items():
            cases += [({option: v}, taken) for v, taken in bound_cases(option_schema, option)]
    return cases


BOUNDED_PARAMS = [
    (task.name, name)
    for task in TASKS.values()
    for name, checker in task.params.items()
    if bound_cases(checker.schema, name)
]


@pytest.mark.parametrize(("task", "name"), BOUNDED_PARAMS)
def test_each_parameter_takes_the_bounds_its_schema_states_and_refuses_past_them(task, name):
    """/openapi.json is where a client reads what a parameter may be: a value at the
    bound it states is taken, one past it is 400 (an integer one further, a number the
    next float), and an exclusive minimum is not taken."""
    rules = TASKS[task]
    wrong = []
    for value, taken in bound_cases(rules.params[name].schema, name):
        try:
            check_params(rules, {**REQUIRED_PARAMS.get(task, {}), name: value})
        except InvalidRequest as exc:
            if taken or name not in str(exc):
                wrong.append(f"{str(value)[:40]}: {exc}")
        else:
            if not taken:
                wrong.append(f"{str(value)[:40]}: taken")
    assert not wrong


@pytest.mark.parametrize(
    ("task", "name", "taken", "refused"),
    [
        ("text-generation", "temperature", 1e-5, 0),  # as TGI; 0 is greedy on OpenAI's routes
        ("summarization", "temperature", 0.0, -0.5),
        ("text-generation", "seed", 2**64 - 1, 2**64),  # TGI's seed: a u64
        ("summarization", "num_return_sequences", 8, 9),
        ("summarization", "min_new_tokens", 0, -1),  # 0: no minimum, generate()'s default
        ("question-answering", "max_seq_len", 16, 15),
        ("fill-mask", "top_k", 100, 101),
        ("text-classification", "top_k", 1, 0),
        ("image-classification", "top_k", 1000, 1001),
        # generate()'s "never" too: it was 400 "must be true or false"
        ("summarization", "early_stopping", "never", "always"),
        ("translation", "early_stopping", False, 1),
    ],
)
def test_the_bounds_clients_are_told_hold(task, name, taken, refused):
    """The bounds themselves, as /openapi.json tells clients (the test above holds the
    checks to whatever it says)."""
    rules = TASKS[task]
    assert check_params(rules, {name: taken}) == {name: taken}
    with pytest.raises(InvalidRequest, match=name):
        check_params(rules, {name: refused})


def mistyped_values(schema):
    """JSON's true where a number is asked, and 1 or 0 where a boolean is: Python reads
    each as the other, so only a check of the type itself refuses them."""
    kinds = {schema.get("type")}
    kinds |= {branch.get("type") for branch in schema.get("anyOf", ())}
    if kinds & {"integer", "number"} and "boolean" not in kinds:
        return [True, False]
    if "boolean" in kinds and not kinds & {"integer", "number"}:
        return [1, 0]
    return []


TYPED_PARAMS = [
    (task.name, name, value)
    for task in TASKS.values()
    for name, checker in task.params.items()
    for value in mistyped_values(checker.schema)
] + [
    (task.name, "generate_parameters", {name: value})
    for task in TASKS.values()
    if "generate_parameters" in task.params
    for name, option in task.params["generate_parameters"].schema["properties"].items()
    for value in mistyped_values(option)
]


@pytest.mark.parametrize(("task", "name", "value"), TYPED_PARAMS)
def test_a_boolean_is_no_number_and_a_number_no_boolean(task, name, value):
    """`"temperature": true` or `"do_sample": 1` is a client's mistake: 400, never read
    as 1.0 or as true."""
    with pytest.raises(InvalidRequest, match=name):
        check_params(TASKS[task], {**REQUIRED_PARAMS.get(task, {}), name: value})


@pytest.mark.parametrize(
    ("given", "read"), [("paris", ["paris"]), (["paris", "london"], ["paris", "london"])]
)
def test_fill_mask_targets_are_a_word_or_a_list_of_words(given, read):
    parsed = parse_json_body("fill-mask", {"inputs": "x [MASK]", "parameters": {"targets": given}})
    assert parsed.params == {"targets": read}
    for empty in ("", [""], ["paris", ""], []):
        with pytest.raises(BadRequest, match="targets"):
            parse_json_body("fill-mask", {"inputs": "x [MASK]", "parameters": {"targets": empty}})


@pytest.mark.parametrize(
    ("grammar", "read"),
    [
        ({"type": "json_object", "value": {"type": "object"}}, {"type": "object"}),  # TGI's
        ({"type": "json_object", "value": '{"type": "object"}'}, {"type": "object"}),
        ({"type": "json", "value": {"type": "string"}}, {"type": "string"}),
    ],
)
def test_a_json_grammar_is_taken_by_either_of_tgis_names(grammar, read):
    """InferenceClient sends TGI's "json_object"; the worker is given one kind, "json"."""
    parsed = parse_json_body("text-generation", {"inputs": "x", "parameters": {"grammar": grammar}})
    assert parsed.params == {"grammar": {"type": "json", "value": read}}


def test_a_json_grammar_written_as_a_text_holds_no_nan():
    """TGI's grammar value may be a text of JSON: read as JSON, NaN and Infinity are not
    (a schema's {"const": NaN} was answered "null")."""
    for text, said in (
        ('{"const": NaN}', "its text holds NaN: NaN and Infinity are not JSON numbers"),
        ('{"enum": [Infinity, 1]}', "its text holds Infinity"),
        ('{"maximum": 1e400}', "its text holds a number past a float's range: 1e400"),
        # (read 300 deep, it could not be pickled to the worker: a 500)
        ('{"not":' * 300 + "{}" + "}" * 300, "its text is nested more than 64 levels deep"),
    ):
        grammar = {"type": "json_object", "value": text}
        with pytest.raises(BadRequest, match=f"takes a JSON schema.*{re.escape(said)}"):
            parse_json_body("text-generation", {"inputs": "x", "parameters": {"grammar": grammar}})


@pytest.mark.parametrize(
    ("task", "device", "dtype", "installed", "reason"),
    [
        ("feature-extraction", "cpu", "auto", True, None),
        ("fill-mask", "cpu", "float32", True, None),
        (None, "cpu", "auto", True, None),  # the task not known yet: nothing against it
        ("text-generation", "cpu", "auto", True, "serves the encoder tasks, not text-generation"),
        ("feature-extraction", "cuda:0", "auto", True, "on the CPU only, not on cuda:0"),
        ("feature-extraction", "cpu", "float16", True, "runs float32 here, not float16"),
        ("feature-extraction", "cpu", "bfloat16", True, "runs float32 here, not bfloat16"),
        ("feature-extraction", "cpu", "auto", False, "(pip install 'rawserve[onnx]')"),
    ],
)
def test_why_onnx_runtime_cannot_serve_is_said(task, device, dtype, installed, reason):
    """Said by the server before any worker starts (--engine onnx) and by a worker
    choosing its engine (auto): what the operator would change."""
    said = onnx_unfit(task, device, dtype, installed)
    if reason is None:
        assert said is None
    else:
        assert reason in said


def test_a_parameter_of_tasks_past_those_named_is_counted_in_words():
    """max_new_tokens is four tasks' parameter: three are named, "and 1 other task"."""
    from rawserve.tasks.registry import TASKS, check_params
    from rawserve.tasks.rules import UnknownParameters

    with pytest.raises(UnknownParameters, match=r"and 1 other task\b(?!s)"):
        check_params(TASKS["fill-mask"], {"max_new_tokens": 5})
