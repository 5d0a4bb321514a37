"""People at the table: the front ends through which a person plays a seat.

Two ways in, both as an ordinary agent identity, so the broker's ACL holds for
people exactly as for programs:

* ``tty.py``: the ``human`` agent kind, a terminal front end built on the
  agent runtime (``backroom agent human --id bob``); ``render.py`` draws what
  the seat knows with ``rich``, ``parse.py`` reads what the person types.
* ``web.py``: ``backroom web``, a browser front end that bridges a page
  (``web_static/``) to the bus with each seat's own MQTT login; ``gate.py``
  guards it (the ``Origin`` check, the failed-sign-in backoff).
  ``web_replay.py``: ``backroom replay``, the same app with the replay
  viewer (``backroom.replay``, a package below this one) mounted.

This package sits on ``backroom.agents`` (it builds on the runtime); nothing
below imports it. The ``human`` kind reaches the agent registry through the
``backroom.agents`` entry point in ``pyproject.toml``. Nothing is imported
here: the terminal needs prompt_toolkit, the browser the ``web`` extra.
"""
