# An S3-compatible origin for local stacks and tests: moto's server, built from the same
# base as the edge node image (no registry needed where that base is built locally).
#   docker build -f deploy/compose/s3-origin.Dockerfile -t edgecache-s3-origin:5.2.5 deploy/compose
# It keeps objects in memory (gone on restart) and binds 127.0.0.1 unless told otherwise:
#   docker run --network host edgecache-s3-origin:5.2.5 -p 17000
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG MOTO_VERSION=5.2.5
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/moto \
 && /opt/moto/bin/pip install "moto[server]==${MOTO_VERSION}" \
 && /opt/moto/bin/pip uninstall -y pip setuptools \
 && groupadd --gid 10001 moto \
 && useradd -l --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin moto
ENV PATH=/opt/moto/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 5000
ENTRYPOINT ["moto_server", "-H", "127.0.0.1"]
CMD ["-p", "5000"]
