# The cellgate gateway for compose.yaml (O1), on the same local base as the
# sandboxes (`cellgate-base:bookworm` from scripts/build-base-image.sh), so it
# builds with no container registry. Python packages come from the wheelhouse
# that scripts/compose-prepare.sh builds on the host with the host's own pip
# configuration; apt uses the machine's sources copied beside it.
ARG BASE_IMAGE=cellgate-base:bookworm
FROM ${BASE_IMAGE}
COPY .compose/apt/ /tmp/apt/
RUN set -eu; \
    if ls /tmp/apt/*.sources >/dev/null 2>&1; then \
      cp /tmp/apt/*.sources /etc/apt/sources.list.d/ && rm -f /etc/apt/sources.list; \
    elif [ -f /tmp/apt/sources.list ]; then cp /tmp/apt/sources.list /etc/apt/sources.list; fi; \
    rm -rf /tmp/apt; \
    apt-get update -q; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-venv; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
COPY .compose/wheels/ /tmp/wheels/
RUN python3 -m venv /opt/cellgate \
    && /opt/cellgate/bin/pip install -q --no-index --find-links /tmp/wheels --no-compile cellgate \
    && rm -rf /tmp/wheels /root/.cache
COPY deploy/gateway-entrypoint.sh /usr/local/bin/cellgate-entrypoint
ENV PATH=/opt/cellgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    DOCKER_HOST=tcp://docker-api:2375
EXPOSE 8787
ENTRYPOINT ["/usr/local/bin/cellgate-entrypoint"]
CMD ["serve", "--config", "/etc/cellgate/config.json", "--host", "0.0.0.0", "--port", "8787"]
