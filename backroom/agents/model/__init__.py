"""The machinery behind ``backroom.agents.backend.Backend``, one job per module.

``Backend`` (in ``backroom/agents/backend.py``) holds the state — the model,
its lock, the loaded adapters, the counters — and composes these:

* ``loading`` — find, load and convert the model (GGUF files, the on-disk
  conversion cache), attach LoRA adapters, route rows to adapters;
* ``prefix_cache`` — the prompt head a batch shares, encoded once and kept for
  the next batch;
* ``scoring`` — candidates packed as token trees into one forward pass, and
  their log-probs read back;
* ``generation`` — the sampling loop, with a seeded generator per row;
* ``batcher`` — the queue that gathers concurrent requests into batches.

Nothing here imports torch, transformers or peft at module level, so that
importing backroom (and registering the agent kinds) stays light.
"""
