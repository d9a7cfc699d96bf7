# The runbus image: every service of docker-compose.yml runs its `runbus` command
# (ingest, serve, demo; runs, show, metrics, logs for a look inside).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY runbus/ runbus/
COPY producer/ producer/
COPY ingester/ ingester/
COPY storage/ storage/
COPY query/ query/
COPY dashboard/ dashboard/
COPY integrations/ integrations/
# asyncpg for PostgreSQL; the source tree is not kept, only the installed package.
RUN pip install ".[postgres]" && cd / && rm -rf /src

RUN useradd --create-home --uid 10001 runbus
USER runbus
WORKDIR /home/runbus

# 9100: an ingester's /healthz, /readyz, /metrics (with --http); 8080: `runbus serve`.
EXPOSE 9100 8080
ENTRYPOINT ["runbus"]
CMD ["ingest", "--http", "0.0.0.0:9100"]
