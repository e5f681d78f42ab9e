"""sentence-transformers' Dense modules (LaBSE's, distiluse's, sentence-t5's, GTR's): the
vectors rawserve answers are those sentence-transformers computes, in a worker and
through the server's routes; a Dense layer of every form it saves loads as it loads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rawserve.models.sentence_folder import dense_module
from rawserve.shared.messages import EMBEDDING_ROUTE, Control, Engine
from tests.server import RunningServer
from tests.test_task_adapters import NEEDS_ONNX
from tests.tiny_models import worker_config

TEXTS = ["i like it", "the movie was very bad and i hate it"]


@pytest.fixture(scope="module")
def dense_model(tiny_model):
    """A BERT with CLS pooling, a Dense layer (tanh) from 32 numbers to 16, normalized."""
    return tiny_model("dense-sentence-embedding")


@pytest.fixture(scope="module")
def reference(dense_model):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(dense_model, device="cpu")


@pytest.mark.parametrize("engine", [Engine.TORCH, pytest.param(Engine.ONNX, marks=NEEDS_ONNX)])
def test_a_dense_module_s_vectors_are_sentence_transformers_own(
    dense_model, reference, engine, tmp_path, monkeypatch
):
    """Served without its Dense layer (refused, before), the model answered other vectors."""
    from rawserve.worker.loading import load_runner

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))  # exported here, not found kept
    serving = load_runner(worker_config(dense_model, dtype="float32", engine=engine), "cpu")
    expected = reference.encode(TEXTS)
    assert expected.shape == (2, 16)
    np.testing.assert_allclose(np.array(serving.run(TEXTS, {})), expected, atol=1e-5)
    # the embedding routes' form: the same vectors, with each input's tokens
    answered = serving.run(TEXTS, {}, Control(embedding_route=EMBEDDING_ROUTE))
    np.testing.assert_allclose([a["embedding"] for a in answered], expected, atol=1e-5)
    assert serving.details["dimensions"] == 16 and serving.details["token_dimensions"] == 32


def test_dimensions_keep_the_first_of_the_dense_layer_s_numbers(dense_model, reference):
    """Matryoshka-style `dimensions` cut the final vector (the Dense layer's 16), then
    normalize it, as sentence-transformers' truncate_dim with normalize_embeddings does;
    token vectors are the model's own, 32 numbers wide, with no Dense layer."""
    from rawserve.worker.loading import load_runner

    serving = load_runner(worker_config(dense_model, dtype="float32"), "cpu")
    cut = reference.encode(TEXTS, truncate_dim=8, normalize_embeddings=True)
    np.testing.assert_allclose(np.array(serving.run(TEXTS, {"dimensions": 8})), cut, atol=1e-5)
    with pytest.raises(ValueError, match="dimensions must be at most 16"):
        serving.run(TEXTS, {"dimensions": 17})
    tokens = reference.encode(TEXTS, output_value="token_embeddings")
    served = serving.run(TEXTS, {"pooling": "none", "normalize": False})
    for vectors, expected in zip(served, tokens, strict=True):
        assert vectors.shape == (1, len(expected), 32)
        np.testing.assert_allclose(vectors[0], expected.numpy(), atol=1e-5)


def test_dimensions_may_be_the_whole_size_and_cut_token_vectors_too(dense_model, reference):
    """A client asking for every number (OpenAI's `dimensions` set to the model's size)
    was refused; token vectors (pooling none) came back whole, `dimensions` ignored."""
    from rawserve.worker.loading import load_runner

    serving = load_runner(worker_config(dense_model, dtype="float32"), "cpu")
    whole = reference.encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(np.array(serving.run(TEXTS, {"dimensions": 16})), whole, atol=1e-5)
    tokens = reference.encode(TEXTS, output_value="token_embeddings")
    served = serving.run(TEXTS, {"pooling": "none", "normalize": False, "dimensions": 4})
    for vectors, expected in zip(served, tokens, strict=True):
        assert vectors.shape == (1, len(expected), 4)
        np.testing.assert_allclose(vectors[0], expected.numpy()[:, :4], atol=1e-5)
    assert serving.run(TEXTS, {"pooling": "none", "dimensions": 32})[0].shape[-1] == 32


@pytest.mark.parametrize(
    ("options", "safe_serialization"),
    [
        ({"in_features": 32, "out_features": 16}, True),  # LaBSE's, distiluse's (tanh)
        ({"in_features": 32, "out_features": 32, "bias": False, "activation": "Identity"}, True),
        ({"in_features": 32, "out_features": 8, "activation": "GELU"}, False),  # an old .bin
        ({"in_features": 32, "out_features": 8, "use_residual": True}, True),  # projected
        ({"in_features": 32, "out_features": 32, "use_residual": True}, False),
    ],
)
def test_a_dense_layer_of_each_form_computes_as_sentence_transformers_own(
    tmp_path, options, safe_serialization
):
    import torch
    from sentence_transformers.base.modules import Dense

    from rawserve.worker.dense_layers import load_dense_layers

    torch.manual_seed(0)
    activation = getattr(torch.nn, options.pop("activation", "Tanh"))()
    saved = Dense(**options, activation_function=activation).eval()
    (tmp_path / "2_Dense").mkdir()
    saved.save(str(tmp_path / "2_Dense"), safe_serialization=safe_serialization)
    module = dense_module(tmp_path, "2_Dense", None)
    (layer,) = load_dense_layers(tmp_path, (module,), 32, "cpu")
    vectors = torch.randn(3, 32)
    with torch.inference_mode():
        expected = saved({"sentence_embedding": vectors})["sentence_embedding"]
        torch.testing.assert_close(layer(vectors), expected)


def test_dense_modules_in_a_row_each_take_the_numbers_of_the_one_before(tmp_path):
    """sentence-t5's and GTR's folders may hold two Dense layers (768 -> 3072 -> 768, say):
    the second one was checked against, and given, the model's vectors."""
    import torch
    from safetensors.torch import save_file

    from rawserve.models.sentence_folder import DenseModule
    from rawserve.worker.dense_layers import load_dense_layers

    torch.manual_seed(0)
    first, second = torch.randn(16, 32), torch.randn(8, 16)
    for name, weight in (("2_Dense", first), ("3_Dense", second)):
        (tmp_path / name).mkdir()
        save_file({"linear.weight": weight}, tmp_path / name / "model.safetensors")
    modules = (
        DenseModule("2_Dense", 32, 16, bias=False, activation="Identity"),
        DenseModule("3_Dense", 16, 8, bias=False, activation="Identity"),
    )
    one, two = load_dense_layers(tmp_path, modules, 32, "cpu")
    vectors = torch.randn(3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(two(one(vectors)), vectors @ first.T @ second.T)


def test_a_dense_module_s_safetensors_are_read_before_a_bin_beside_them(tmp_path):
    """sentence-transformers reads model.safetensors where both are saved: a stale or
    broken pytorch_model.bin beside it stopped the start, or gave other vectors."""
    import torch
    from safetensors.torch import save_file

    from rawserve.worker.dense_layers import read_weights

    (tmp_path / "2_Dense").mkdir()
    weight = torch.ones(16, 32)
    save_file({"linear.weight": weight}, tmp_path / "2_Dense" / "model.safetensors")
    (tmp_path / "2_Dense" / "pytorch_model.bin").write_bytes(b"\x80\x04 not whole")
    assert torch.equal(read_weights(tmp_path / "2_Dense")["linear.weight"], weight)


def test_dense_weights_that_do_not_fit_their_config_stop_the_start_saying_which(tmp_path):
    import torch
    from safetensors.torch import save_file

    from rawserve.models.sentence_folder import DenseModule
    from rawserve.worker.dense_layers import load_dense_layers

    (tmp_path / "2_Dense").mkdir()
    save_file({"linear.weight": torch.zeros(8, 32)}, tmp_path / "2_Dense" / "model.safetensors")
    module = DenseModule("2_Dense", 32, 16, bias=False, activation="Tanh")
    with pytest.raises(ValueError, match="2_Dense's weights do not fit its config: size"):
        load_dense_layers(tmp_path, (module,), 32, "cpu")
    with pytest.raises(ValueError, match="takes 32 numbers where the model's vectors have 64"):
        load_dense_layers(tmp_path, (module,), 64, "cpu")


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_dense_weights_file_cut_short_is_named(tmp_path, name):
    """A cut model.safetensors was a deserializing error naming no file; a corrupt .bin,
    torch's advice to load it with weights_only=False."""
    from rawserve.models.sentence_folder import DenseModule
    from rawserve.worker.dense_layers import load_dense_layers

    (tmp_path / "2_Dense").mkdir()
    (tmp_path / "2_Dense" / name).write_bytes(b"\x80\x04 not whole")
    module = DenseModule("2_Dense", 32, 16, bias=True, activation="Tanh")
    with pytest.raises(ValueError, match=f"^2_Dense/{name} is not a whole weights file .*download"):
        load_dense_layers(tmp_path, (module,), 32, "cpu")


async def test_dimensions_are_documented_up_to_the_model_s_size_where_it_alone_serves():
    """With several embedding models, the first's size is no bound of the route's: a
    request naming another may ask more (a client checking the schema refused it)."""
    from dataclasses import replace

    from rawserve.api.app import App
    from rawserve.api.served import ServedModels
    from rawserve.api.settings import AppSettings
    from tests.test_model_selection import get, served

    def sized(name: str, dimensions: int):
        model = served(name, "feature-extraction")
        loaded = model.serving.workers.loaded
        model.serving.workers.loaded = replace(loaded, details={"dimensions": dimensions})
        return model

    for models, bound in [((sized("dn", 16),), 16), ((sized("dn", 16), sized("se", 32)), None)]:
        app = App(ServedModels(list(models)), AppSettings())
        paths = json.loads((await app.handle(get("/openapi.json", headers=[]))).body)["paths"]
        for path in ("/v1/embeddings", "/embed"):
            body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            most = body["properties"]["dimensions"].get("maximum")
            assert most == bound or (bound is None and most in (None, 65536)), (path, most)


@pytest.mark.slow
def test_a_dense_model_is_served_on_every_embedding_route(dense_model, reference):
    """/info lists the layer; TEI's /embed, OpenAI's embeddings (with `dimensions`) and the
    Inference API answer its 16 numbers; /embed_all the model's 32 a token."""
    expected = reference.encode(TEXTS)
    with RunningServer(["--model", dense_model, "--threads", "1"]) as server:
        status, _, body = server.request("GET", "/info")
        info = json.loads(body)
        assert status == 200
        assert info["pooling"] == "cls" and info["normalize"] is True
        assert info["dense"] == [
            {
                "path": "2_Dense",
                "in_features": 32,
                "out_features": 16,
                "bias": True,
                "activation": "Tanh",
                "residual": False,
            }
        ]
        status, embedded = server.post_json({"inputs": TEXTS}, "/embed")
        assert status == 200
        np.testing.assert_allclose(embedded, expected, atol=1e-5)
        status, answer = server.post_json({"input": TEXTS, "dimensions": 4}, "/v1/embeddings")
        assert status == 200
        cut = reference.encode(TEXTS, truncate_dim=4, normalize_embeddings=True)
        np.testing.assert_allclose([d["embedding"] for d in answer["data"]], cut, atol=1e-5)
        status, refused = server.post_json(
            {"input": "i like it", "dimensions": 17}, "/v1/embeddings"
        )
        assert status == 422 and "at most 16" in refused["error"]["message"]
        status, vector = server.post_json({"inputs": TEXTS[0]}, "/")
        assert status == 200
        np.testing.assert_allclose(vector, expected[0], atol=1e-5)
        status, tokens = server.post_json({"inputs": TEXTS[0]}, "/embed_all")
        assert status == 200 and {len(vector) for vector in tokens[0]} == {32}
        # documented as the routes take it: up to the Dense layer's 16 numbers
        paths = json.loads(server.request("GET", "/openapi.json")[2])["paths"]
        for path in ("/v1/embeddings", "/embed"):
            body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body["properties"]["dimensions"]["maximum"] == 16, path


@pytest.mark.slow
def test_a_dense_module_s_only_weights_come_down_from_the_hub(tmp_path, dense_model, reference):
    """LaBSE's repo on the Hub: the model's weights both as safetensors and as a .bin, its
    Dense module's as a .bin alone. The .bin beside the safetensors is not needed; the
    Dense module's is (skipped, the start failed for want of the module's weights)."""
    import io

    import torch
    from safetensors.torch import load_file

    from tests.hub_cache import HubRepo, folder_files
    from tests.hub_server import FakeHub
    from tests.test_hub_serving import hub_env, serving

    files = folder_files(Path(dense_model))
    pickled = io.BytesIO()
    torch.save(load_file(Path(dense_model) / "2_Dense" / "model.safetensors"), pickled)
    files["2_Dense/pytorch_model.bin"] = pickled.getvalue()
    del files["2_Dense/model.safetensors"]
    files["pytorch_model.bin"] = b"not needed: the model's safetensors are there"
    repo = HubRepo("org/tiny-labse")
    repo.add_commit(files, refs=("main",))
    with FakeHub([repo]) as hub:
        env = hub_env(tmp_path, HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1")
        with serving(["--model", repo.repo_id], env) as server:
            status, answer = server.post_json({"inputs": TEXTS}, "/embed")
    assert status == 200
    np.testing.assert_allclose(answer, reference.encode(TEXTS), atol=1e-5)
    snapshot = tmp_path / "hub" / "models--org--tiny-labse" / "snapshots" / repo.main
    assert (snapshot / "2_Dense" / "pytorch_model.bin").is_file()
    assert not (snapshot / "pytorch_model.bin").exists()
