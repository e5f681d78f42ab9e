"""Plain Python used by more than one kind of process: the serving process, the HTTP
processes and the model workers.

What crosses between them: a worker's messages (`messages`) over its pipe (`pipes`), an
HTTP process's channel to the serving process (`channel`) and the queue state it reads
(`board`); and what each process needs alike: device specs (`devices`), the container's
limits (`cgroups`), installed versions (`installed`), logging (`logs`, `log_writer`),
memory kept flat (`memory`), /proc's process states (`process_state`), histogram counts
(`tallies`), generation's token lists (`token_columns`) and deadline timers
(`late_watch`). Never imports torch, transformers, h11, or anything of the server's
(protocol, api, scheduler, executor) or the worker's.
"""
