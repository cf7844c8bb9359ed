"""The HTTP floor of benchmarks/serve.py floor: FastAPI with one route, run by the same uvicorn."""

from fastapi import FastAPI

app = FastAPI()


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}
