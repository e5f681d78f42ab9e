"""Plain Python used by both processes, the server and the model workers.

The messages that cross the pipe between them (`messages`), the pipe's framing (`pipes`),
device specs (`devices`), logging set-up (`logs`) and the
malloc settings that keep memory flat (`memory`). Never imports torch, transformers,
h11, or anything of the server's (protocol, api, scheduler, executor) or the worker's.
"""
