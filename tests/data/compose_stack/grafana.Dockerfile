# Stand-in for grafana/grafana, which has no Debian package (tests/test_compose_stack.py):
# it checks the provisioning files where Grafana reads them and answers /api/health and
# /api/search like Grafana; the test runs every dashboard expression against Prometheus.
ARG BASE
FROM ${BASE}
COPY grafana_standin.py /usr/local/bin/grafana_standin.py
LABEL org.backroom.standin=grafana
USER nobody
EXPOSE 3000
ENTRYPOINT ["python3", "/usr/local/bin/grafana_standin.py"]
