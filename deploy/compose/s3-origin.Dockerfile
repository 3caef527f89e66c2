# An S3-compatible origin for local stacks and tests: moto's server, built from the same
# base as the edge node image (no registry needed where that base is built locally).
#   docker build -f deploy/compose/s3-origin.Dockerfile -t edgecache-s3-origin:5.2.5 deploy/compose
# moto keeps objects in memory; s3-origin.py saves them to /var/lib/s3-origin (mount a
# volume there) and loads them at start, so the registry survives a restart as the nodes'
# caches do. It binds 127.0.0.1 unless told otherwise:
#   docker run --network host -v s3-origin:/var/lib/s3-origin edgecache-s3-origin:5.2.5 -p 17000
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG MOTO_VERSION=5.2.5
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/moto \
 && /opt/moto/bin/pip install "moto[server]==${MOTO_VERSION}" \
 && /opt/moto/bin/pip uninstall -y pip setuptools \
 && groupadd --gid 10001 moto \
 && useradd -l --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin moto \
 && mkdir -p /var/lib/s3-origin \
 && chown 10001:10001 /var/lib/s3-origin
COPY s3-origin.py /opt/moto/s3-origin.py
ENV PATH=/opt/moto/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# No VOLUME instruction: mount a named volume at /var/lib/s3-origin (it takes the owner, 10001,
# from the image). A VOLUME gave every other container of this image (compose's one-shot
# s3-setup) an anonymous volume that `compose down` leaves behind, one more each cycle.
EXPOSE 5000
ENTRYPOINT ["python3", "/opt/moto/s3-origin.py", "-H", "127.0.0.1"]
CMD ["-p", "5000"]
