"""The seed page's Starlette server, made runnable: per item, and with its 1 ms batching.

Run with uvicorn, as the page says (`uvicorn bench.baselines.seed_batching:app`); the model
folder and task come from SEED_MODEL and SEED_TASK.
"""
