"""Naming a model and reading its files, in the server process: how the command line names
a model (`names`), resolving a name to a local folder through huggingface_hub's cache
(`hub`), and what a folder says about its task, its pooling and the name clients see
(`folder`).

Plain Python (paths, JSON files, huggingface_hub): never imports torch or transformers, so
the server reads these facts before any worker starts.
"""
