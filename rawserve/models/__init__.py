"""Naming a model and reading its files, in the server process (never torch).

`names` reads how the command line names a model, `hub` resolves a name to a local
folder (a Hub repo through huggingface_hub's cache).
"""
