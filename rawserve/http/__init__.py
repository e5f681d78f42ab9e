"""HTTP values and plumbing of the server process, beneath `rawserve.protocol` and `rawserve.api`.

Request/response values, errors that carry their status and the one function that renders
them, the JSON encoder of every response, flow control, the connection timer, access log
lines and request ids. Runs in the server process only; never imports torch, the scheduler,
the executor or the api.
"""
