"""The models a referee may ask to paraphrase a message, as its operator registered them.

A ``paraphrase`` intervention on the wire names a model (``model: local``); only the
operator who started the referee says what that name is: an OpenAI-compatible endpoint
and model, and the environment variable its key is read from, on the referee's command
line (``--paraphraser local=http://127.0.0.1:8000/v1``) or through the run config's
``paraphrasers`` that ``backroom run`` turns into that option. A name the referee was
not given refuses the match; an address or a key never travels in a match request.

Why these choices:

* httpx against ``/chat/completions``, the one API every server backroom talks to has
  (``backroom serve-model``, vLLM, the hosted ones); no SDK to install.
* Greedy decoding with a seed drawn from the match seed and the message's number, so
  a server that honours them (``serve-model`` decodes greedily) gives the same run
  the same rewrites.
* The message goes into the prompt by plain replacement of ``{text}``, never
  ``str.format``: the prompt comes from a request, and format fields can read
  attributes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx

from backroom.bus.wire import Paraphrase

#: Environment variables backroom itself sets (bus passwords, tokens): never a model's key.
RESERVED_ENV_PREFIX = "BACKROOM_"


@dataclass(frozen=True)
class Paraphraser:
    """One registered model: ``name`` is what a ``paraphrase`` intervention says."""

    name: str
    base_url: str
    model: str = ""  # empty: the server's own model (``backroom serve-model`` takes that)
    key_env: str | None = None

    @classmethod
    def parse(cls, text: str) -> Paraphraser:
        """``NAME=BASE_URL[,model=MODEL][,key_env=VAR]``, as the referee's option takes it."""
        name, sep, rest = text.partition("=")
        url, *options = rest.split(",")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"--paraphraser {text!r}: write NAME=BASE_URL[,model=MODEL][,key_env=VAR], "
                "e.g. local=http://127.0.0.1:8000/v1"
            )
        fields: dict[str, str] = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("model", "key_env") or not value:
                raise ValueError(f"--paraphraser {text!r}: unknown option {option!r}")
            fields[key] = value
        key_env = fields.get("key_env")
        if key_env is not None and key_env.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(
                f"--paraphraser {text!r}: key_env {key_env} is a variable backroom sets "
                "(a bus password or token): name the model's own key variable"
            )
        return cls(name, url.rstrip("/"), fields.get("model", ""), key_env)


class Paraphrasers:
    """The referee's registered models and one HTTP client for all of them."""

    def __init__(self, models: list[Paraphraser], timeout_s: float = 30.0) -> None:
        self.models = {m.name: m for m in models}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))

    def __contains__(self, name: object) -> bool:
        return name in self.models

    async def rewrite(self, step: Paraphrase, text: str, seed: int) -> str:
        """The model's rewrite of ``text``; raises on any failure (the caller records it)."""
        model = self.models[step.model]
        headers = {}
        if model.key_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(model.key_env, '')}"
        body = {
            "model": model.model,
            "messages": [{"role": "user", "content": step.prompt.replace("{text}", text)}],
            "max_tokens": step.max_tokens,
            "temperature": 0.0,
            "seed": seed,
        }
        reply = await self.client.post(
            f"{model.base_url}/chat/completions", json=body, headers=headers
        )
        reply.raise_for_status()
        content = reply.json()["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise ValueError(f"paraphraser {model.name} answered no text")
        return content.strip()

    async def aclose(self) -> None:
        await self.client.aclose()
