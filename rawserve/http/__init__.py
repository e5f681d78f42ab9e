"""HTTP values and plumbing of the server process, beneath `rawserve.protocol` and `rawserve.api`.

Request/response values, errors that carry their status and the one function that renders
them, the JSON encoder of every response; and, beside the protocol, its parts by job: the
request cycle (`cycle`), the refusals a connection makes on its own (`refusals`), the head
of every answer (`response_head`), a connection's limits and phases (`limits`), flow
control, the connection timer, CORS, access log lines, request ids and header numbers.
Runs in the server process only; never imports torch, the scheduler, the executor or the
api.
"""
