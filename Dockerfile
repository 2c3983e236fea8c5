# The image every gcworker service of compose.yaml runs.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini constraints.txt ./
COPY gcworker gcworker
COPY tasks tasks
COPY migrations migrations
# The versions CI tested (constraints.txt), not whatever is newest today.
RUN pip install -c constraints.txt -e . && useradd --system --home-dir /app gcworker
USER gcworker
CMD ["gcworker", "--help"]
