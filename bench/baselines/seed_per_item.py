"""The seed page's first server, as written there: one model call per request.

The page's code with what it needs to run (the queue and the model loop are started in
Starlette's lifespan; the model and task come from the environment) and nothing else: the
pipeline runs on the event loop, one string at a time.

    SEED_MODEL=DIR SEED_TASK=text-classification uvicorn bench.baselines.seed_per_item:app
"""

import asyncio
import contextlib
import os

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from transformers import pipeline

MODEL = os.environ["SEED_MODEL"]
TASK = os.environ.get("SEED_TASK")
# the device and precision of the pipeline (bench.compare --device cuda); unset: the seed's
ON_DEVICE = {
    name: os.environ[variable]
    for name, variable in (("device", "SEED_DEVICE"), ("dtype", "SEED_DTYPE"))
    if os.environ.get(variable)
}


async def homepage(request):
    payload = await request.body()
    string = payload.decode("utf-8")
    response_q = asyncio.Queue()
    await request.app.model_queue.put((string, response_q))
    output = await response_q.get()
    return JSONResponse(output)


async def server_loop(q):
    pipe = pipeline(task=TASK, model=MODEL, **ON_DEVICE)
    while True:
        (string, response_q) = await q.get()
        out = pipe(string)
        await response_q.put(out)


@contextlib.asynccontextmanager
async def lifespan(app):
    q = asyncio.Queue()
    app.model_queue = q
    loop_task = asyncio.create_task(server_loop(q))
    yield
    loop_task.cancel()


app = Starlette(routes=[Route("/", homepage, methods=["POST"])], lifespan=lifespan)
