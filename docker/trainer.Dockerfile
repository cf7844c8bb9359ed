# The training image: CPU torch 2.13.0 + the `train` extra; writes an artifact and exits.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
COPY training ./training
RUN pip install ".[train]"
ENTRYPOINT ["/app/docker/train-if-missing.sh"]
COPY docker/train-if-missing.sh docker/retrain-loop.sh ./docker/
