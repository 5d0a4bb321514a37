"""The ``llm`` agent kind: any OpenAI-compatible chat-completions endpoint, over httpx.

Works with OpenAI, vLLM, llama.cpp's server, Ollama and ``backroom serve-model``:
``base_url`` + ``model``; the API key is read from the environment variable
named by ``api_key_env`` (default ``OPENAI_API_KEY``; a local server needs none).

What it guarantees, because a referee waits on it and a researcher reads it:

* **An answer before the referee's timeout.** Each turn gets a deadline of
  ``turn.deadline_s - deadline_margin_s``. Waiting for a request slot,
  retries and the repair round all count against it; when it passes, the
  agent sends the documented fallback (``parsing.fallback_action``) instead of
  letting the seat time out.
* **Polite load.** At most ``max_in_flight`` requests per process are open at
  once (a semaphore shared by every ``llm`` agent of the process). 429 and 5xx
  replies and timeouts are retried with exponential backoff and full jitter;
  a ``Retry-After`` header is honoured as given (and if it points past the
  deadline, the agent falls back at once instead of waiting in vain).
* **Valid actions.** Replies are parsed in the formats the papers' prompts ask
  for (``backroom.agents.parsing``); an unreadable reply gets one repair round
  (``backroom.agents.decisions``, shared with the ``local`` kind)
  ("Your reply was not valid because ..."), then the fallback.
* **No fallback passes for a choice.** Every answer that is not the model's
  own first reply is marked with its reason (``Agent.mark_fallback``:
  ``deadline``, ``unparseable``, ``request_failed``, ``repaired``), which the
  episode record keeps (``ActionRecord.fallback``).
* **A full record.** Every request body and every raw reply (with each
  attempt's status) goes into the decision's ``Trace`` (``request`` /
  ``reply``), so what each model was told and said can be read afterwards.
* **Accounting.** Tokens, cost and request outcomes are Prometheus counters
  (``backroom_llm_*_total``, labels ``model`` and ``outcome`` only).

Sampling defaults follow the papers per game and phase (``PAPER_SAMPLING``:
beauty contest temperature 1.0 / max_tokens 256, Bertrand 0.7 / 128, top_p
1.0); ``temperature``, ``top_p``, ``max_tokens`` override both phases and the
``talk`` / ``act`` dicts override one phase.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import os
import time
import weakref
from typing import Any

import httpx
from prometheus_client import Counter

from backroom.agents.base import JSON
from backroom.agents.decisions import Decided, budget_s, deadline_detail, parse_or_repair
from backroom.agents.kinds import register_agent
from backroom.agents.memory import ChatMessage, MemoryAgent
from backroom.agents.parsing import parse_message
from backroom.bus.wire import AgentFallback, MatchStart, Trace, Turn

log = logging.getLogger("backroom.agent.llm")

REQUESTS = Counter(
    "backroom_llm_requests_total",
    "HTTP requests to chat-completion endpoints, by outcome (ok, rate_limited, server_error, "
    "client_error, timeout, transport_error, bad_reply)",
    ["model", "outcome"],
)
PROMPT_TOKENS = Counter("backroom_llm_prompt_tokens_total", "Prompt tokens billed", ["model"])
COMPLETION_TOKENS = Counter(
    "backroom_llm_completion_tokens_total", "Completion tokens billed", ["model"]
)
COST = Counter(
    "backroom_llm_cost_usd_total", "Cost in US dollars at the configured prices", ["model"]
)
DECISIONS = Counter(
    "backroom_llm_decisions_total",
    "Decisions of llm agents, by outcome (parsed, repaired, fallback, spoke, silent)",
    ["model", "outcome"],
)

#: Sampling of the papers (Shall We Team Up, appendix C, Table 3); other games use DEFAULT_SAMPLING.
PAPER_SAMPLING: dict[str, dict[str, float | int]] = {
    "beauty_contest": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256},
    "bertrand": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 128},
}
DEFAULT_SAMPLING: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256}
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens")

#: Largest trace we publish; readers refuse payloads over 64 KiB (``wire.MAX_PAYLOAD_BYTES``).
MAX_TRACE_BYTES = 60_000

_IN_FLIGHT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def in_flight_slots(limit: int) -> asyncio.Semaphore:
    """The process's request semaphore (one per event loop; its size is the first caller's limit)."""
    loop = asyncio.get_running_loop()
    sem = _IN_FLIGHT.get(loop)
    if sem is None:
        sem = _IN_FLIGHT[loop] = asyncio.Semaphore(max(1, limit))
    return sem


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: a number of seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


#: The one variable of backroom's own an ``llm`` agent may send as its key: the key of
#: ``backroom serve-model`` (compose hands it to its llm agents), meant for a model server.
SERVE_KEY_ENV = "BACKROOM_SERVE_KEY"


def key_env_refusal(name: str | None) -> str | None:
    """Why ``api_key_env`` may not name ``name``, or None.

    backroom sets ``BACKROOM_*`` variables that hold bus passwords, tokens and paths
    to them; an agent whose options named one would send that secret as its bearer
    token to whatever ``base_url`` says (a config is the one place that may choose it,
    and it may choose only a model server's own key).
    """
    if name and name.startswith("BACKROOM_") and name != SERVE_KEY_ENV:
        return (
            f"api_key_env {name} is a variable backroom sets (a bus password or token); "
            f"name the model server's own key variable ({SERVE_KEY_ENV} for backroom serve-model)"
        )
    return None


class DeadlineExceeded(Exception):
    """No usable reply before the turn's deadline."""


class RequestFailed(Exception):
    """The endpoint refused the request for good (4xx other than 429, or retries exhausted)."""


@register_agent("llm")
class LLMAgent(MemoryAgent):
    """A seat played by a chat model behind an OpenAI-compatible HTTP API.

    Options: ``base_url``, ``model``, ``api_key_env``, ``temperature``,
    ``top_p``, ``max_tokens``, ``talk`` / ``act`` (per-phase sampling dicts),
    ``max_in_flight``, ``retries``, ``backoff_base_s``, ``backoff_max_s``,
    ``request_timeout_s``, ``deadline_margin_s``, ``fallback``,
    ``price_input_per_mtok`` / ``price_output_per_mtok`` (USD per million
    tokens, for the cost counter), ``extra_body`` (merged into each request),
    ``send_seed`` (default true: each request carries a ``seed`` derived from
    the match's seed, the seat, the turn and the call, for servers that honour
    one; false for a server that refuses the field), ``trainable`` (see
    below), plus the memory options of ``backroom.agents.memory``.

    API sampling is not replayable: a server may ignore the seed, and one that
    takes it (OpenAI: "best effort"; vLLM; llama.cpp) can still answer
    differently when its batching, hardware or model version changes.

    ``trainable: true`` asks the server for the prompt's and the completion's
    token ids and the completion's log-probs (``return_token_ids`` and
    ``logprobs``: vLLM and ``backroom serve-model`` answer them) and puts them
    in the decision's trace, so a trainer can learn from API play; a match that
    names this seat's adapter version (``MatchStart.adapter``) is played with
    the model ``{policy}@{version}``, the name under which the trainer had the
    server load it (``/v1/load_lora_adapter``).
    """

    traces_decisions = True

    def __init__(
        self,
        agent_id: str,
        seed: int | None = None,
        base_url: str | None = None,
        model: str = "gpt-4o-mini",
        api_key_env: str = "OPENAI_API_KEY",
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        talk: dict[str, Any] | None = None,
        act: dict[str, Any] | None = None,
        max_in_flight: int = 16,
        retries: int = 4,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 8.0,
        request_timeout_s: float = 60.0,
        deadline_margin_s: float = 0.5,
        fallback: Any = None,
        price_input_per_mtok: float = 0.0,
        price_output_per_mtok: float = 0.0,
        extra_body: dict[str, Any] | None = None,
        trainable: bool = False,
        send_seed: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(agent_id, seed=seed, **options)
        self.base_url = (
            base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        ).rstrip("/")
        self.model = model
        if why := key_env_refusal(api_key_env):
            raise ValueError(why)
        self.api_key_env = api_key_env
        flat = {
            k: v
            for k, v in (("temperature", temperature), ("top_p", top_p), ("max_tokens", max_tokens))
            if v is not None
        }
        self.overrides: dict[str, dict[str, Any]] = {
            "talk": {**flat, **(talk or {})},
            "act": {**flat, **(act or {})},
        }
        for phase, over in self.overrides.items():
            unknown = set(over) - set(SAMPLING_KEYS)
            if unknown:
                raise TypeError(
                    f"{phase} sampling takes {list(SAMPLING_KEYS)}, not {sorted(unknown)}"
                )
        self.max_in_flight = int(os.environ.get("BACKROOM_LLM_MAX_IN_FLIGHT", max_in_flight))
        self.retries = int(retries)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.request_timeout_s = float(request_timeout_s)
        self.deadline_margin_s = float(deadline_margin_s)
        self.fallback = fallback
        self.prices = (float(price_input_per_mtok), float(price_output_per_mtok))
        self.extra_body = dict(extra_body or {})
        self.trainable = bool(trainable)
        self.send_seed = bool(send_seed)
        if self.trainable:
            self.extra_body = {"logprobs": True, "return_token_ids": True, **self.extra_body}
        self.client: httpx.AsyncClient | None = None
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "requests": 0}
        self.outcomes: dict[str, int] = {}

    async def setup(self) -> None:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        limits = httpx.Limits(
            max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight
        )
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    # --- sampling ---------------------------------------------------------------------

    def sampling(self, game: str | None, phase: str) -> dict[str, Any]:
        base = dict(PAPER_SAMPLING.get(game or "", DEFAULT_SAMPLING))
        base.update(self.overrides[phase])
        return base

    # --- the adapter version a match names (trainable seats) -----------------------------

    async def on_match_start(self, start: MatchStart) -> None:
        await super().on_match_start(start)
        if self.trainable and start.adapter is not None:
            ref = start.adapter
            self.memory(start.match)["played"] = (f"{ref.policy}@{ref.version}", ref.version)

    def _played(self, match: str | None) -> tuple[str, str | None]:
        """(model name, adapter version) of this seat in ``match``."""
        played: tuple[str, str | None] | None = self.matches.get(match or "", {}).get("played")
        return played or (self.model, None)

    # --- decisions ----------------------------------------------------------------------

    async def act(self, turn: Turn) -> JSON:
        mm = self.match_memory(turn.match, turn)
        deadline = self._deadline(turn)
        calls: list[dict[str, Any]] = []
        sampling = self.sampling(mm.start.game if mm.start else None, "act")
        replies: list[str] = []

        async def chat(messages: list[ChatMessage], purpose: str) -> str:
            seed = self._seed(turn, purpose)
            text = await self._chat(messages, sampling, deadline, calls, purpose, turn.match, seed)
            if purpose != "planning":
                replies.append(text)
            return text

        try:
            if self.prompts.planning_due(mm, turn):
                plan = await chat(self.prompts.planning_messages(mm, turn), "planning")
                self.prompts.record_strategy(mm, turn, plan)
            messages = self.prompts.act_messages(mm, turn)
            text = await chat(messages, "act")
            decided = await parse_or_repair(
                turn, messages, text, lambda repair: chat(repair, "repair"), self.fallback
            )
        except DeadlineExceeded:
            detail = deadline_detail(turn, self.deadline_margin_s)
            decided = Decided.fallback(turn, "deadline", self.fallback, detail)
        except RequestFailed as exc:
            decided = Decided.fallback(turn, "request_failed", self.fallback, str(exc))
        if decided.reason is not None:
            self.mark_fallback(turn, decided.reason)
        self._count(decided.outcome)
        self.prompts.record_decision(mm, turn, decided.action)
        await self._trace(turn, calls, decided.record(replies))
        return decided.action

    async def talk(self, turn: Turn) -> str | None:
        mm = self.match_memory(turn.match, turn)
        deadline = self._deadline(turn)
        calls: list[dict[str, Any]] = []
        sampling = self.sampling(mm.start.game if mm.start else None, "talk")
        limit = (turn.legal.get("schema") or {}).get("maxLength")
        text, detail = "", ""
        reason: AgentFallback | None = None
        try:
            raw = await self._chat(
                self.prompts.talk_messages(mm, turn),
                sampling,
                deadline,
                calls,
                "talk",
                turn.match,
                self._seed(turn, "talk"),
            )
            text = parse_message(raw, limit)
        except DeadlineExceeded:
            reason, detail = "deadline", deadline_detail(turn, self.deadline_margin_s)
        except RequestFailed as exc:
            reason, detail = "request_failed", str(exc)
        text = self.prompts.finish_talk(mm, turn, text) if (text or not reason) else ""
        if limit is not None:
            text = text[: int(limit)]
        if reason is not None:
            self.mark_fallback(turn, reason)
        outcome = "spoke" if text else "silent"
        self._count(outcome)
        self.prompts.record_decision(mm, turn, text)
        await self._trace(
            turn,
            calls,
            {"message": text, "outcome": outcome, "reason": reason or "", "detail": detail},
        )
        return text

    def _deadline(self, turn: Turn) -> float:
        """The event loop's time by which ``turn``'s answer must be decided."""
        return asyncio.get_running_loop().time() + budget_s(turn.deadline_s, self.deadline_margin_s)

    def _count(self, outcome: str) -> None:
        DECISIONS.labels(model=self.model, outcome=outcome).inc()
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    # --- HTTP ------------------------------------------------------------------------------

    def _seed(self, turn: Turn, purpose: str) -> int | None:
        """The request's ``seed``: 31 bits, which every server that takes one accepts."""
        return self.decision_seed(turn, purpose, bits=31) if self.send_seed else None

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with full jitter (AWS architecture blog's "full jitter").

        From ``self.rng``, not a match's generator: retries are timing, not play.
        """
        cap = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return self.rng.uniform(0.0, cap) if cap > 0 else 0.0

    async def _chat(
        self,
        messages: list[ChatMessage],
        sampling: dict[str, Any],
        deadline: float,
        calls: list[dict[str, Any]],
        purpose: str,
        match: str | None = None,
        seed: int | None = None,
    ) -> str:
        """One chat completion, retried as needed; its request and raw replies go into ``calls``."""
        assert self.client is not None, "setup() was not run"
        loop = asyncio.get_running_loop()
        model = self._played(match)[0]
        seeded = {"seed": seed} if seed is not None else {}
        body = {
            "model": model,
            "messages": messages,
            "n": 1,
            **sampling,
            **seeded,
            **self.extra_body,
        }
        attempts: list[dict[str, Any]] = []
        call: dict[str, Any] = {"purpose": purpose, "request": body, "attempts": attempts}
        calls.append(call)
        sem = in_flight_slots(self.max_in_flight)
        for attempt in range(self.retries + 1):
            left = deadline - loop.time()
            if left <= 0:
                raise DeadlineExceeded()
            started = loop.time()
            info: dict[str, Any] = {"t": time.time()}
            attempts.append(info)
            delay: float | None = None
            try:
                async with asyncio.timeout(left):
                    async with sem:
                        resp = await self.client.post(
                            "/chat/completions",
                            json=body,
                            timeout=min(self.request_timeout_s, max(0.01, left)),
                        )
            except (TimeoutError, httpx.TimeoutException):
                info.update(outcome="timeout", elapsed_s=loop.time() - started)
                REQUESTS.labels(model=self.model, outcome="timeout").inc()
            except httpx.TransportError as exc:
                info.update(
                    outcome="transport_error", error=str(exc), elapsed_s=loop.time() - started
                )
                REQUESTS.labels(model=self.model, outcome="transport_error").inc()
            else:
                info.update(status=resp.status_code, elapsed_s=loop.time() - started)
                text, delay = self._reply(resp, info, call)
                if text is not None:
                    return text
            if attempt == self.retries:
                break
            wait = delay if delay is not None else self._backoff(attempt)
            if loop.time() + wait >= deadline:
                info["gave_up"] = f"next try in {wait:.2f}s would pass the turn's deadline"
                raise DeadlineExceeded()
            await asyncio.sleep(wait)
        raise RequestFailed(f"no usable reply after {self.retries + 1} attempts")

    def _reply(
        self, resp: httpx.Response, info: dict[str, Any], call: dict[str, Any]
    ) -> tuple[str | None, float | None]:
        """One HTTP answer: its text, or none and the server's wait (``Retry-After``) before a retry.

        A 200 whose body is no chat completion is retried after the backoff;
        a 4xx other than 429 is not (``RequestFailed``): asking again would ask
        the same thing. ``info`` (the attempt's record) gets the outcome.
        """
        if resp.status_code == 200:
            try:
                data = resp.json()
                text = data["choices"][0]["message"].get("content") or ""
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                info.update(outcome="bad_reply", body=resp.text[:2000])
                REQUESTS.labels(model=self.model, outcome="bad_reply").inc()
                return None, None
            info.update(outcome="ok", reply=data)
            call["tokens"] = _token_info(data)
            REQUESTS.labels(model=self.model, outcome="ok").inc()
            self._account(data.get("usage") or {})
            return str(text), None
        if resp.status_code == 429 or resp.status_code >= 500:
            outcome = "rate_limited" if resp.status_code == 429 else "server_error"
            delay = retry_after_seconds(resp.headers.get("retry-after"))
            info.update(outcome=outcome, retry_after=delay, body=resp.text[:2000])
            REQUESTS.labels(model=self.model, outcome=outcome).inc()
            return None, delay
        info.update(outcome="client_error", body=resp.text[:2000])
        REQUESTS.labels(model=self.model, outcome="client_error").inc()
        raise RequestFailed(f"HTTP {resp.status_code}: {resp.text[:200]}")

    def _account(self, usage: dict[str, Any]) -> None:
        p = int(usage.get("prompt_tokens") or 0)
        c = int(usage.get("completion_tokens") or 0)
        cost = (p * self.prices[0] + c * self.prices[1]) / 1e6
        PROMPT_TOKENS.labels(model=self.model).inc(p)
        COMPLETION_TOKENS.labels(model=self.model).inc(c)
        if cost:
            COST.labels(model=self.model).inc(cost)
        self.usage["prompt_tokens"] += p
        self.usage["completion_tokens"] += c
        self.usage["cost_usd"] += cost
        self.usage["requests"] += 1

    # --- traces ----------------------------------------------------------------------------

    async def _trace(self, turn: Turn, calls: list[dict[str, Any]], result: dict[str, Any]) -> None:
        """One trace per decision: every request body, every attempt with its raw reply."""
        trace = Trace(
            match=turn.match,
            agent=self.id,
            turn=turn.turn,
            seat=turn.seat,
            phase=turn.phase,
            request=[c["request"] for c in calls],
            reply={
                "calls": [{"purpose": c["purpose"], "attempts": c["attempts"]} for c in calls],
                **result,
            },
        )
        decided = [
            c for c in calls if c["purpose"] in ("act", "repair", "talk") and c.get("tokens")
        ]
        if self.trainable and decided and result.get("outcome") not in ("fallback", "silent"):
            # the reply the action (or message) was taken from: what a trainer learns from
            prompt_ids, completion_ids, logprobs = decided[-1]["tokens"]
            trace.prompt_ids, trace.completion_ids, trace.logprobs = (
                prompt_ids,
                completion_ids,
                logprobs,
            )
            model, trace.adapter_version = self._played(turn.match)
            if trace.adapter_version is not None:  # the server's name is "{policy}@{version}"
                trace.adapter_policy = model.split("@", 1)[0]
            trace.temperature = float(decided[-1]["request"].get("temperature", 1.0))
        _fit(trace)
        await self.publish_trace(trace)


def _token_info(reply: dict[str, Any]) -> tuple[list[int], list[int], list[float]] | None:
    """Prompt ids, completion ids and their log-probs from a vLLM-style reply; None if absent."""
    try:
        choice = reply["choices"][0]
        prompt = [int(t) for t in reply["prompt_token_ids"]]
        completion = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x["logprob"]) for x in choice["logprobs"]["content"]]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return (prompt, completion, logprobs) if len(logprobs) == len(completion) and prompt else None


def _content(reply: dict[str, Any]) -> str:
    try:
        return str(reply["choices"][0]["message"].get("content") or "")
    except (KeyError, IndexError, TypeError, AttributeError):
        return json.dumps(reply)[:2000]


def _fit(trace: Trace) -> None:
    """Bring a trace over ``MAX_TRACE_BYTES`` under it: keep what was said, drop the raw
    envelopes, then cut the longest texts."""
    if len(trace.model_dump_json()) <= MAX_TRACE_BYTES:
        return
    for c in trace.reply["calls"]:
        for a in c["attempts"]:
            if isinstance(a.get("reply"), dict):
                a["reply"] = {"content": _content(a["reply"]), "usage": a["reply"].get("usage")}
            a.pop("body", None)
    while len(trace.model_dump_json()) > MAX_TRACE_BYTES and _shorten(trace.request):
        pass


def _shorten(requests: list[dict[str, Any]]) -> bool:
    """Halve the longest message text in place; False when nothing is left to cut."""
    best: tuple[int, dict[str, Any]] | None = None
    for r in requests:
        for m in r.get("messages", []):
            n = len(m.get("content") or "")
            if n > 200 and (best is None or n > best[0]):
                best = (n, m)
    if best is None:
        return False
    n, m = best
    m["content"] = m["content"][: n // 4] + " [...] " + m["content"][-n // 4 :]
    return True
