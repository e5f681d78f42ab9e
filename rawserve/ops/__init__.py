"""Operating the server: Prometheus metrics, versions for /info, the default worker
layout and its trial, progress lines while a model loads, the event loop, the open files
limit, the signals that drain it, and the container's health probe (a process of its
own). Never imports torch, h11, the api or the protocol.
"""
