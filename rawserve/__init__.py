"""rawserve: a small, fast, hardened HTTP server for Hugging Face transformers pipelines."""

__version__ = "0.1.0"
