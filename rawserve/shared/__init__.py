"""Plain Python used by both processes, the server and the model workers.

The messages that cross the pipe between them (`messages`), the pipe's framing (`pipes`),
device specs (`devices`) and logging set-up (`logs`). Never imports torch, transformers,
h11, or anything of the server's (protocol, api, scheduler, executor) or the worker's.
"""
