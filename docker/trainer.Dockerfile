# The training image: CPU torch 2.13.0 + the `train` extra; writes an artifact and exits. Runs as the
# unprivileged user dcmc (uid 10001), who owns /artifacts (a new named volume mounted there starts with
# that owner).
# tests/test_images.py builds it without a Docker engine (its COPY lines, its RUN lines in a fresh venv,
# its command on a tiny data set): keep every instruction plain enough for that.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# Where the CPU build of torch comes from (PyPI's default build for Linux is the multi-GB CUDA one);
# empty: pip's configured index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
COPY pyproject.toml README.md ./
COPY model ./model
COPY service ./service
COPY training ./training
RUN pip install ".[train]"
COPY docker/train-if-missing.sh docker/retrain-loop.sh ./docker/
RUN useradd --create-home --uid 10001 dcmc && mkdir -p /artifacts && chown dcmc:dcmc /artifacts
USER dcmc
ENTRYPOINT ["/app/docker/train-if-missing.sh"]
