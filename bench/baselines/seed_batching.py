"""The seed page's server with its dynamic batching sketch, as written there.

After the first item, more are taken while each arrives within 1 ms of the previous one
(the page's `asyncio.wait_for(q.get(), timeout=0.001)`, a timer reset on every fetch),
with no bound on the batch, and the batch runs on the event loop with
`pipe(strings, batch_size=len(strings))`.

    SEED_MODEL=DIR SEED_TASK=text-classification uvicorn bench.baselines.seed_batching:app
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
        (string, rq) = await q.get()
        strings = [string]
        queues = [rq]
        while True:
            try:
                (string, rq) = await asyncio.wait_for(q.get(), timeout=0.001)  # 1ms
            except asyncio.exceptions.TimeoutError:
                break
            strings.append(string)
            queues.append(rq)
        outs = pipe(strings, batch_size=len(strings))
        for rq, out in zip(queues, outs):  # noqa: B905 - the page's code
            await rq.put(out)


@contextlib.asynccontextmanager
async def lifespan(app):
    q = asyncio.Queue()
    app.model_queue = q
    loop_task = asyncio.create_task(server_loop(q))
    yield
    loop_task.cancel()


app = Starlette(routes=[Route("/", homepage, methods=["POST"])], lifespan=lifespan)
