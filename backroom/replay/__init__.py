"""The replay viewer: a run's matches, turn by turn, as each seat saw and heard them.

A package of its own, below the browser app that serves it (``backroom web``
mounts ``routes.replay_routes`` beside the league page; ``backroom replay``,
``human/web_replay.py``, serves that app for one run), so the viewer reads
runs and records and imports nothing of the people's front ends:

* ``index.py``: the SQLite index beside a run (where each record and trace
  lies, the fields a list filters by); ``query.py``: the list's filters, sorts
  and pages; ``training.py``: a training run's store and ``train_log.csv``,
  read-only;
* ``view.py``: one match's steps rebuilt from its record and traces;
  ``words.py``: its values in words for a person;
* ``routes.py`` + ``replay.html``: the page and its JSON API (docs/replay.md).

Nothing is imported here: the routes need the ``web`` extra.
"""
