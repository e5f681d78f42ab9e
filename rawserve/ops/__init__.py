"""Operating the server process: Prometheus metrics, versions for /info, the default
layout, progress lines while a model loads. Never imports torch, h11, the api or the protocol.
"""
