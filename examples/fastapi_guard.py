"""A FastAPI endpoint that must not overrun its backend, guarded by the asyncio layer.

Run it: ``pip install iop-admission fastapi uvicorn`` then
``uvicorn examples.fastapi_guard:app``. At most two requests reach the backend
at once; up to eight more wait (at most 2 s) in one fair queue; the rest get
503 at once, a queue timeout 504.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException

from iop_admission import (
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    QueueTimeout,
)
from iop_admission.aio import AsyncAdmission

BACKEND = ProviderKey("local", "backend")
CONFIG = PoolConfig(
    policy=QueuePolicy(max_queue=8, queue_timeout=2.0),
    providers={BACKEND: ProviderSpec(capacity=2)},
    models={"search": ModelGroup([BACKEND])},
)


async def call_backend(query: str) -> str:
    """Stands for the backend call the endpoint protects."""
    await asyncio.sleep(0.01)
    return query.upper()


def create_app(config: PoolConfig = CONFIG) -> FastAPI:
    """The app, with its own admission (made and connected at start-up, on the server's loop)."""
    admission = AsyncAdmission(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        admission.connect("local")
        yield

    app = FastAPI(lifespan=lifespan)
    app.state.admission = admission

    @app.get("/search")
    async def search(q: str) -> dict[str, str]:
        try:
            async with admission.lease("search"):
                return {"result": await call_backend(q)}
        except QueueFull:
            raise HTTPException(status_code=503, detail="busy, try again later") from None
        except QueueTimeout:
            raise HTTPException(status_code=504, detail="waited too long for the backend") from None

    return app


app = create_app()
