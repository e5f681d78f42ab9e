"""llama-index's TEI embedder (llama-index-embeddings-text-embeddings-inference),
unmodified, against a running rawserve whose first embedding model answers TEI's `/embed`.

Run by tests/test_compat_client_libraries.py with the clients' own virtual environment:
`python compat_llama_index_client.py BASE_URL` prints, as one JSON document, what each
call answered or the error the client raised. Imports nothing of rawserve.
"""

from __future__ import annotations

import json
import sys

from compat_outcome import outcome_of
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

TEXT = "the movie was good"


outcome = outcome_of()


def main(base_url: str) -> None:
    model = TextEmbeddingsInference(model_name="emb", base_url=base_url, timeout=60)
    calls = {
        "text_embedding": lambda: model.get_text_embedding(TEXT),
        "query_embedding": lambda: model.get_query_embedding(TEXT),
        "text_embedding_batch": lambda: model.get_text_embedding_batch([TEXT, "i like it"]),
        "blank": lambda: model.get_text_embedding(""),
    }
    print(json.dumps({name: outcome(call) for name, call in calls.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
