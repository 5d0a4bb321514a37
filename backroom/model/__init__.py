"""The local-model stack: one loaded model per process, its adapters and its HTTP server.

It sits below both ``backroom.agents`` (the ``local`` kind) and
``backroom.trainer`` (the learner loads the agents' own weights), so neither
reaches into the other for the model. One job per module:

* ``spec`` — ``ModelSpec``, the (model, GGUF file, device, dtype) that names a
  model everywhere it is loaded;
* ``backend`` — ``Backend``, the state the rest shares (the model, its lock,
  the loaded adapters, the counters), and ``shared_backend``;
* ``adapters`` — LoRA adapters fetched by reference, verified, cached;
* ``serve`` — ``backroom serve-model``, the backend over HTTP;

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
