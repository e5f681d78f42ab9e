"""What runs in each HTTP process of `--http-processes` N > 1: connections, parsing,
validation, answer shaping and JSON (the protocol and the API, unchanged), with each
model's `Serving` face a client of the channel to the serving process (`remote`).
`front` also holds what one process serving HTTP needs either way (listening, and the
drain's wait for the requests under way)."""
