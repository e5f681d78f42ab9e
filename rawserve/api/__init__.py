"""The HTTP API of the server process: routes and what they answer.

`app.App` is the router the protocol hands complete requests to; one module per family
of routes (inference on `POST /`, OpenAI's /v1, TEI's, TGI's, SageMaker's, streaming,
operations) turns requests
into calls on a served model's serving side (its `Serving` face) and results into
responses; `served` holds a model and that face, and `outcomes` turns the serving side's
refusals and failures into HTTP statuses. Never imports h11, torch or the protocol, and
of `rawserve.serving` only its face.
"""
