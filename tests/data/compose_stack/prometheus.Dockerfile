# Stand-in for prom/prometheus (tests/test_compose_stack.py): Debian's prometheus, run as
# the official image runs it (user nobody, data in /prometheus, the same default flags).
ARG BASE
FROM ${BASE}
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
LABEL org.backroom.standin=prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
