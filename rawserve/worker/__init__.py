"""The model worker process: the only place torch and transformers are imported.

`process.worker_main` is the entry point of a worker process (started with `spawn`; its
module imports torch only inside that process, so the server may name it). `loading`
picks the runner for the task; each runner module is named after what it wraps: the
transformers `pipeline`, an `encoder` (AutoModel hidden states), a `causal_lm`
(generate), a `seq2seq_lm` (generate), a `span_extraction` model (question answering),
or a user's `handler`. Nothing here imports the server's parts (protocol, api,
scheduler, executor, http).
"""
