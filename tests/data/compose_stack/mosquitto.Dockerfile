# Stand-in for eclipse-mosquitto (tests/test_compose_stack.py): Debian's mosquitto and
# clients, laid out as the official image (/mosquitto/{config,data,log}, the same entrypoint).
ARG BASE
FROM ${BASE}
RUN mkdir -p /mosquitto/config /mosquitto/data /mosquitto/log \
 && printf 'listener 1883\nallow_anonymous false\n' > /mosquitto/config/mosquitto.conf \
 && chown -R mosquitto:mosquitto /mosquitto
COPY mosquitto-entrypoint.sh /docker-entrypoint.sh
LABEL org.backroom.standin=mosquitto
EXPOSE 1883
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["/usr/sbin/mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
