"""Operating the server process: Prometheus metrics, versions for /info, memory behaviour,
progress lines while a model loads. Never imports torch, h11, the api or the protocol.
"""
