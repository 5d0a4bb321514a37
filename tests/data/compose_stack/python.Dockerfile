# Stand-in for the pinned python image (tests/test_compose_stack.py): Debian's Python 3.11 on
# the debootstrap base, with this host's CA bundle so pip reaches PyPI through its proxy.
ARG BASE
FROM ${BASE}
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
RUN printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf
ENV LANG=C.UTF-8 SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.backroom.standin=python
CMD ["python3"]
