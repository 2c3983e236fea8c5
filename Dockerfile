# The image every gcworker service of compose.yaml runs.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY gcworker gcworker
COPY tasks tasks
COPY migrations migrations
RUN pip install -e . && useradd --system --home-dir /app gcworker
USER gcworker
CMD ["gcworker", "--help"]
