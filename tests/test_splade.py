"""SPLADE sparse encoders (naver's SPLADE, sentence-transformers' SparseEncoder folders):
a vocabulary-wide vector of each word's weight, as sentence-transformers computes it, in a
worker and through TEI's `/embed_sparse`; what has no meaning for such a vector refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from rawserve.models.hub import ModelNotFound
from rawserve.models.plan import plan_models
from rawserve.models.sentence_folder import SpladePooling, sentence_modules
from rawserve.shared.messages import EMBEDDING_ROUTE, SPARSE_ROUTE, Engine
from tests.server import RunningServer, running_together
from tests.tiny_models import worker_config

TEXTS = ["i like it", "the movie was very bad and i hate it"]


@pytest.fixture(scope="module")
def splade_model(tiny_model):
    return tiny_model("splade")


def encoded(folder: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' own vectors for `texts`, whole (its are sparse tensors)."""
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(folder, device="cpu")
    return model.encode(texts, convert_to_tensor=True).to_dense().numpy()


def with_pooling(splade_model: str, tmp_path: Path, **config: str) -> str:
    """The tiny SPLADE model, its SpladePooling configured as `config` says."""
    folder = tmp_path / "splade"
    shutil.copytree(splade_model, folder)
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "pooling",
    [
        {},  # max, relu: sentence-transformers' defaults
        {"pooling_strategy": "sum"},
        {"pooling_strategy": "max", "activation_function": "log1p_relu"},
    ],
)
def test_a_splade_model_s_vectors_are_sentence_transformers_own(splade_model, tmp_path, pooling):
    from rawserve.worker.loading import load_runner

    folder = with_pooling(splade_model, tmp_path, **pooling)
    serving = load_runner(worker_config(folder, dtype="float32"), "cpu")
    expected = encoded(folder, TEXTS)
    whole = serving.run(TEXTS, {"normalize": False})
    np.testing.assert_allclose(np.array(whole), expected, atol=1e-5)
    # /embed_sparse's form: the words of nonzero weight, by id, and each input's tokens
    for answer, vector in zip(serving.run(TEXTS, {}, SPARSE_ROUTE), expected, strict=True):
        assert answer["indices"].tolist() == np.flatnonzero(vector).tolist()
        assert answer["values"].dtype == np.float32  # (answered as float32 prints it)
        np.testing.assert_allclose(answer["values"], vector[vector != 0], atol=1e-5)
    assert [a["tokens"] for a in serving.run(TEXTS, {}, SPARSE_ROUTE)] == [5, 11]
    assert serving.details["dimensions"] == 82 and serving.details["token_dimensions"] == 0


def test_a_splade_model_s_logits_are_pooled_a_group_of_rows_at_a_time(splade_model, monkeypatch):
    """A batch's logits are (rows, tokens, vocabulary): 500 MB for 32 texts of 128 tokens
    of BERT's vocabulary. Run in groups, the batch answers what it answers whole."""
    from rawserve.worker import splade
    from rawserve.worker.loading import load_runner

    serving = load_runner(worker_config(splade_model, dtype="float32"), "cpu")
    texts = [*TEXTS, "paris is the capital of france", "hello"]
    whole = serving.run(texts, {"normalize": False})
    calls: list[int] = []
    hook = serving.model.register_forward_hook(
        lambda _, args, kwargs, out: calls.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    monkeypatch.setattr(splade, "LOGITS_AT_ONCE", 82 * 11 * 3)  # three rows of 11 tokens
    try:
        grouped = serving.run(texts, {"normalize": False})
    finally:
        hook.remove()
    assert calls == [3, 1]
    np.testing.assert_allclose(np.array(grouped), np.array(whole), atol=1e-6)


@pytest.mark.parametrize(
    ("params", "control", "says"),
    [
        ({}, EMBEDDING_ROUTE, "normalize is not available for a SPLADE model"),
        ({"pooling": "none", "normalize": False}, None, "has no token vectors to answer"),
        ({"pooling": "mean", "normalize": False}, None, "not by mean pooling"),
        ({"normalize": False, "dimensions": 8}, None, "dimensions is not available"),
    ],
)
def test_what_has_no_meaning_for_a_splade_vector_is_refused(splade_model, params, control, says):
    """As TEI refuses them: its /embed normalizes unless told not to, and a SPLADE
    vector's weights are not meant to be; it has no token vectors, and no Matryoshka."""
    from rawserve.worker.loading import load_runner

    serving = load_runner(worker_config(splade_model, dtype="float32"), "cpu")
    with pytest.raises(ValueError, match=says):
        serving.run(TEXTS, params, *([control] if control else []))


def test_a_splade_model_runs_on_torch_under_engine_auto_and_onnx_is_refused(splade_model):
    from rawserve.worker.loading import load_runner

    serving = load_runner(worker_config(splade_model, engine=Engine.AUTO), "cpu")
    assert serving.engine is Engine.TORCH
    assert "SPLADE model's pooling runs on torch only" in serving.engine_reason
    with pytest.raises(
        ModelNotFound, match="--engine onnx: a SPLADE model's pooling runs on torch"
    ):
        plan_models([splade_model], engine=Engine.ONNX)


def test_a_sparse_encoder_folder_is_read_in_either_form(splade_model, tmp_path):
    """sentence-transformers' MLMTransformer, or its Transformer running fill-mask (what
    its later releases save); the pooling as configured."""
    assert sentence_modules(Path(splade_model)).splade == SpladePooling("max", "relu")
    folder = Path(with_pooling(splade_model, tmp_path, pooling_strategy="sum"))
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.base.modules.transformer.Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "fill-mask"}))
    read = sentence_modules(folder)
    assert (read.pooling, read.splade) == ("splade", SpladePooling("sum", "relu"))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"pooling_strategy": "mean"}, "its SpladePooling (mean, relu) is not served"),
        ({"activation_function": "gelu"}, "its SpladePooling (max, gelu) is not served"),
        ("no transformer task", "its SpladePooling has no masked language model"),
        ("plain pooling", "its masked language model has no SpladePooling after it"),
        ("dense after", "its Dense module (2_Dense) after SpladePooling is not served"),
        ({"pooling_strategy": None}, "its SpladePooling (None, relu) is not served"),
    ],
)
def test_a_sparse_encoder_rawserve_would_compute_otherwise_is_refused(
    splade_model, tmp_path, change, says
):
    folder = Path(with_pooling(splade_model, tmp_path))
    modules = json.loads((folder / "modules.json").read_text())
    if isinstance(change, dict):
        (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(change))
    elif change == "no transformer task":
        modules[0]["type"] = "sentence_transformers.models.Transformer"
    elif change == "plain pooling":
        modules[1] = {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode": "cls"}')
    else:
        modules.append({"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=re.escape(says)):
        sentence_modules(folder)


def test_pooling_splade_makes_a_masked_language_model_a_sparse_encoder(tiny_model):
    """TEI's --pooling splade on a masked LM without sentence-transformers' files (naver's
    older SPLADE repos): the vectors of that LM with SpladePooling after it."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling as Pooling

    from rawserve.worker.loading import load_runner

    folder = tiny_model("fill-mask")
    [plan] = plan_models([folder], pooling="splade")
    assert plan.facts is not None
    assert (plan.facts.task, plan.facts.pooling) == ("feature-extraction", "splade")
    serving = load_runner(worker_config(folder, pooling="splade", dtype="float32"), "cpu")
    reference = SparseEncoder(modules=[MLMTransformer(folder), Pooling("max")], device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    np.testing.assert_allclose(
        np.array(serving.run(TEXTS, {"normalize": False})), expected, atol=1e-5
    )
    # named as fill-mask, it stays one
    with pytest.raises(ModelNotFound, match="applies to a masked language model named without"):
        plan_models([f"{folder}:fill-mask"], pooling="splade")


def test_pooling_replaces_a_feature_extraction_model_s_own(tiny_model):
    """A model without sentence-transformers' files answered token vectors on POST / and
    was mean-pooled on /embed; --pooling cls pools it as TEI's --pooling cls does."""
    import torch
    import transformers

    from rawserve.worker.loading import load_runner

    folder = tiny_model("feature-extraction")
    serving = load_runner(worker_config(folder, pooling="cls", dtype="float32"), "cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        states = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).last_hidden_state
    np.testing.assert_allclose(np.array(serving.run(TEXTS, {})), states[:, 0].numpy(), atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "pooling", "says"),
    [
        ("text-classification", "splade", "--pooling splade applies to a masked language model"),
        ("text-classification", "cls", "--pooling cls applies to feature-extraction models"),
        ("splade", "cls", "--pooling cls: it is a sparse encoder, pooled by SPLADE"),
        ("sentence-embedding", "splade", "--pooling splade: it is not a masked language model"),
        ("dense-sentence-embedding", "mean", None),  # (its Dense layer after mean pooling)
    ],
)
def test_a_pooling_a_model_cannot_take_stops_the_start_saying_why(tiny_model, kind, pooling, says):
    folder = tiny_model(kind)
    if says is None:
        [plan] = plan_models([folder], pooling=pooling)
        assert plan.facts is not None and plan.facts.pooling == pooling
        return
    with pytest.raises(ModelNotFound, match=re.escape(says)):
        plan_models([folder], pooling=pooling)


def test_a_normalize_module_after_splade_pooling_normalizes_every_route(splade_model, tmp_path):
    """/embed_sparse answered such a folder's weights unnormalized, where encode() gives
    vectors of length 1."""
    from rawserve.worker.loading import load_runner

    folder = Path(with_pooling(splade_model, tmp_path))
    modules = json.loads((folder / "modules.json").read_text())
    normalize = {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    }
    (folder / "modules.json").write_text(json.dumps([*modules, normalize]))
    serving = load_runner(worker_config(str(folder), dtype="float32"), "cpu")
    expected = encoded(str(folder), TEXTS)
    np.testing.assert_allclose(np.linalg.norm(expected, axis=1), 1, atol=1e-6)
    for answer, vector in zip(serving.run(TEXTS, {}, SPARSE_ROUTE), expected, strict=True):
        np.testing.assert_allclose(answer["values"], vector[vector != 0], atol=1e-6)


@pytest.mark.slow
def test_a_splade_model_is_served_on_tei_s_embed_sparse(splade_model, tiny_model):
    """As TEI serves one: /embed_sparse the words of nonzero weight; /embed the whole
    vector with normalize: false, else 422; the routes of dense vectors (/embed_all,
    /v1/embeddings, /similarity) 404, as is /embed_sparse of another model."""
    expected = encoded(splade_model, TEXTS)
    started = {
        kind: RunningServer(["--model", tiny_model(kind), "--threads", "1"])
        for kind in ("splade", "sentence-embedding")
    }
    # a masked LM with TEI's --pooling splade
    started["masked"] = RunningServer(
        ["--model", tiny_model("fill-mask"), "--pooling", "splade", "--threads", "1"]
    )
    with running_together(started):
        server = started["splade"]
        status, sparse = server.post_json({"inputs": TEXTS}, "/embed_sparse")
        assert status == 200
        for answer, vector in zip(sparse, expected, strict=True):
            assert [entry["index"] for entry in answer] == np.flatnonzero(vector).tolist()
            np.testing.assert_allclose([e["value"] for e in answer], vector[vector != 0], atol=1e-5)
        status, one = server.post_json({"inputs": TEXTS[0]}, "/embed_sparse")
        assert status == 200 and one == sparse[:1]
        status, whole = server.post_json({"inputs": TEXTS, "normalize": False}, "/embed")
        assert status == 200
        np.testing.assert_allclose(whole, expected, atol=1e-5)
        status, refused = server.post_json({"inputs": TEXTS[0]}, "/embed")  # normalize: true
        assert status == 422 and "send normalize: false" in refused["error"]
        # routes of dense vectors: not this model's (a body naming no model picks another)
        for path, body in [
            ("/embed_all", {"inputs": "hi"}),
            ("/v1/embeddings", {"input": "hi"}),
            ("/similarity", {"inputs": {"source_sentence": "hi", "sentences": ["a"]}}),
            # InferenceClient's sentence_similarity: it was a 422 about a normalize the
            # client never sent, which sent as told was a 400
            ("/", {"inputs": {"source_sentence": "hi", "sentences": ["a"]}}),
        ]:
            status, refused = server.post_json(body, path)
            assert status == 404, (path, refused)
            assert "dense vectors" in json.dumps(refused), (path, refused)
        status, _, info = server.request("GET", "/info")
        document = json.loads(info)
        assert document["pooling"] == "splade"
        assert document["model_type"] == {"embedding": {"pooling": "splade"}}
        status, refused = started["sentence-embedding"].post_json({"inputs": "hi"}, "/embed_sparse")
        assert status == 404 and "SPLADE pooling" in refused["error"]
        status, masked = started["masked"].post_json({"inputs": TEXTS}, "/embed_sparse")
        assert status == 200
        for answer, vector in zip(masked, encoded(tiny_model("splade"), TEXTS), strict=True):
            # (the same weights: the tiny SPLADE model is the tiny masked LM, seeded alike)
            np.testing.assert_allclose([e["value"] for e in answer], vector[vector != 0], atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "model"),
    [
        ("/v1/embeddings", {"input": "hi"}, "emb"),
        ("/embed_all", {"inputs": "hi"}, "emb"),
        ("/similarity", {"inputs": {"source_sentence": "hi", "sentences": ["a"]}}, "emb"),
        ("/embed_sparse", {"inputs": "hi"}, "sp"),
        ("/embed", {"inputs": "hi"}, "emb"),  # normalized: TEI's default
        ("/embed", {"inputs": "hi", "normalize": False}, "sp"),  # (the first that serves it)
    ],
)
async def test_a_body_naming_no_model_goes_to_the_model_its_route_has_meaning_for(
    path, body, model
):
    """Served first, a SPLADE model took every embedding route's requests that named no
    model, and answered 422 where the second model serves them."""
    from dataclasses import replace

    from rawserve.api.app import App
    from rawserve.api.served import ServedModels
    from rawserve.api.settings import AppSettings
    from tests.test_model_selection import computed_by, post, served

    sparse = replace(served("sp", "feature-extraction"), facts={"pooling": "splade"})
    app = App(ServedModels([sparse, served("emb", "feature-extraction")]), AppSettings())
    await app.handle(post(path, body, headers=[]))
    assert computed_by(app, model) == 1


async def test_openapi_documents_a_splade_model_s_routes_and_not_dense_ones():
    from dataclasses import replace

    from rawserve.api.app import App
    from rawserve.api.served import ServedModels
    from rawserve.api.settings import AppSettings
    from tests.test_model_selection import get, served

    sparse = replace(served("sp", "feature-extraction"), facts={"pooling": "splade"})
    app = App(ServedModels([sparse]), AppSettings())
    paths = json.loads((await app.handle(get("/openapi.json", headers=[]))).body)["paths"]
    assert {"/embed_sparse", "/embed", "/"} <= set(paths)
    assert {"/embed_all", "/similarity", "/v1/embeddings"}.isdisjoint(paths)
