# The serving image: numpy + ONNX Runtime + FastAPI; no torch and no training code.
# tests/test_images.py builds it without a Docker engine (its COPY lines, its RUN lines in a fresh venv,
# its command on a tiny artifact): keep every instruction plain enough for that.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
RUN pip install ".[serve]" \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch'; assert u.find_spec('training') is None, 'training'"
RUN useradd --create-home --uid 10001 dcmc
USER dcmc
EXPOSE 8000
# The service's own entry point (`dcmc serve` lives in training/ and only execs this).
# docker-compose.yml gives the command; this default serves /artifacts/current.
CMD ["python", "-m", "service", "--artifacts", "/artifacts/current", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
