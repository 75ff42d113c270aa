# Prometheus for the compose test where prom/prometheus cannot be pulled: Debian's own binary
# (the host's `prometheus` package, copied into the build context by deploy/local-engine.sh) on
# the same base image as grpc-ps, laid out like the official image (config in /etc/prometheus,
# data in /prometheus, uid 65534), so docker-compose.yml's prometheus service runs it unchanged.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY prometheus /bin/prometheus
RUN mkdir -p /etc/prometheus /prometheus \
 && chown 65534:65534 /prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
