#!/bin/sh
# As the official image's: give /mosquitto to the broker's user, then run the command.
set -e
if [ "$(id -u)" = 0 ] && [ -d /mosquitto ]; then chown -R mosquitto:mosquitto /mosquitto || true; fi
exec "$@"
