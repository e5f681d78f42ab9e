"""The HTTP API of the server process: routes and what they answer.

`app.App` is the router the protocol hands complete requests to; one module per family
of routes (inference on `POST /`, OpenAI's /v1, streaming, operations) turns requests
into scheduler calls and results into responses; `served` describes what a route needs
from a served model's scheduler and workers. Never imports h11, torch or the protocol.
"""
