"""The policy-gradient step on a LoRA adapter: REINFORCE with truncated importance sampling.

For every decision of a batch the loss is (the paper's section 3 and table 1)::

    w_i     = min(exp(logp_now_i - logp_behaviour_i), tis_cap)    detached      (TIS)
    kl_i    = exp(logp_ref_i - logp_now_i) - (logp_ref_i - logp_now_i) - 1          (k3, ref = adapter off)
    loss    = sum_i [ -w_i * credit_i * logp_now_i + kl_coef * kl_i - ent_coef * H_i ] / N

summed over action tokens i and divided by N, the number of action tokens in the
whole batch (micro-batches accumulate gradients), then clipped to a norm of 1.0
and applied with Adam.

What an "action token" is depends on how the agent decided:

* free text (talk, prices): each completion token the agent sampled, with the
  exact ids it generated (never re-templated text) and its temperature-1 log-prob;
* a scored choice among legal actions: the agent sampled from the softmax of
  the candidates' summed log-probs (``backroom.agents.local_model``), so the policy
  here is that same renormalised distribution, and the decision is ONE action
  token whose log-prob is log softmax_c(sum_t log p(c_t))[chosen].

torch, transformers and peft are imported inside functions so that the store,
the advantages and the CLI load without them.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backroom.bus.wire import Trace
from backroom.model.spec import ModelSpec


@dataclass(frozen=True)
class Sample:
    """One decision to learn from, as the agent made it, and the credit of its round."""

    prompt_ids: list[int]
    completions: list[list[int]]  # text: [the sampled ids]; scored: every legal candidate
    chosen: int  # index into completions (0 for text)
    behaviour: list[float]  # text: per-token log-probs; scored: [log pi_b(chosen)]
    scored: bool
    temperature: float
    credit: float

    @property
    def action_tokens(self) -> int:
        return 1 if self.scored else len(self.completions[0])


def sample_of(trace: Trace, credit: float) -> Sample | None:
    """The trainable content of a trace; None for a decision with nothing to learn (a fallback)."""
    if trace.candidates and trace.chosen is not None:
        t = trace.temperature if trace.temperature > 0 else 1.0
        scaled = [v / t for v in trace.candidate_logprobs]
        top = max(scaled)
        log_z = top + math.log(sum(math.exp(v - top) for v in scaled))
        return Sample(
            trace.prompt_ids,
            [list(c) for c in trace.candidates],
            trace.chosen,
            [scaled[trace.chosen] - log_z],
            True,
            t,
            credit,
        )
    if not trace.completion_ids or not trace.prompt_ids:
        return None
    return Sample(
        trace.prompt_ids, [list(trace.completion_ids)], 0, list(trace.logprobs), False, 1.0, credit
    )


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"


@dataclass(frozen=True)
class StepSettings:
    lr: float = 3e-6
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    grad_clip: float = 1.0
    #: Padded tokens per forward pass (activations are kept for backward); None: the
    #: device's default, ``MICRO_BATCH_TOKENS``.
    micro_batch_tokens: int | None = None


#: Micro-batch size by device. A CPU is busy at 1024 tokens. A GPU is not: on an H200,
#: SmolLM2 at 1024 tokens a pass ran 1.4k tokens/s (15 passes of a 64-decision step in
#: 6-8 s, the bare forward+backward as slow; bench/trainer_step.py --device cuda,
#: 2026-11-26): a pass costs its kernel launches, not its arithmetic, and 8x the tokens a
#: pass is 8x fewer passes. The GPU figure is a choice not yet measured against 1024.
MICRO_BATCH_TOKENS = {"cpu": 1024, "cuda": 8192}


@dataclass
class StepStats:
    loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    tis_clamped: float = 0.0  # fraction of action tokens whose ratio hit the cap
    grad_norm: float = 0.0
    action_tokens: int = 0
    tokens: int = 0  # every token that went through the model (prompts included)
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class StepInterrupted(RuntimeError):
    """The step was stopped between two micro-batches (``Learner.stop``); nothing was applied."""


class Learner:
    """A base model with one trainable LoRA adapter (peft) and its Adam state."""

    def __init__(
        self,
        spec: ModelSpec | None = None,
        lora: LoraSettings | None = None,
        step: StepSettings | None = None,
        adapter: str | Path | None = None,
        seed: int = 0,
    ) -> None:
        import torch
        from peft import LoraConfig, PeftModel, get_peft_model

        from backroom.model.backend import Backend

        torch.manual_seed(seed)
        # The agents' own loader: the same weights (a GGUF is dequantised the same
        # way), the same tokenizer, bf16 on a GPU. Not ``shared_backend``: the
        # adapter is trained in place and must not leak into an agent in this process.
        base = Backend(spec).load()
        self.tokenizer = base.tokenizer
        self.device = base.device
        self.settings = step or StepSettings()
        #: Set from another thread (Ctrl-C while a step runs in a worker thread, which
        #: asyncio cannot cancel): the step stops at its next micro-batch, before Adam's
        #: update, so the adapter and the optimiser stay as the last checkpoint has them.
        self.stop = threading.Event()
        self.micro_batch_tokens = self.settings.micro_batch_tokens or MICRO_BATCH_TOKENS.get(
            self.device.type, MICRO_BATCH_TOKENS["cpu"]
        )
        self.lora = lora or LoraSettings()
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
            )
            if adapter is not None:
                self.model = PeftModel.from_pretrained(base.model, str(adapter), is_trainable=True)
            else:
                config = LoraConfig(
                    r=self.lora.rank,
                    lora_alpha=self.lora.alpha,
                    lora_dropout=self.lora.dropout,
                    target_modules=self.lora.target_modules,
                    task_type="CAUSAL_LM",
                )
                self.model = get_peft_model(base.model, config)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(params, lr=self.settings.lr)
        self.pad_id = int(self.tokenizer.pad_token_id)

    # --- log-probs over completion tokens only ------------------------------------
    #
    # The decisions of a batch share a long head (system prompt, rules), and a
    # scored decision's candidates share their whole prompt. So one forward pass
    # packs them as the agent's scorer does (``backroom/model/scoring.py``): the
    # common prefix of the micro-batch is encoded ONCE (with gradient; its
    # key/value cache is repeated for every row), and each row holds one
    # decision's own prompt tail followed by all its completions, under a 4D
    # mask that lets a completion token see the prefix, its prompt tail and the
    # earlier tokens of its own completion only. Logits are computed only at the
    # positions that predict completion tokens.

    MIN_SHARED_PREFIX = 16

    def _decoder_and_head(self) -> tuple[Any, Any]:
        base: Any = self.model.get_base_model()
        return base.base_model, base.get_output_embeddings()

    def _completion_logprobs(
        self, samples: Sequence[Sample], entropy: bool
    ) -> tuple[list[list[Any]], list[list[Any]]]:
        """Per sample, per completion: the tokens' log-probs (and entropies) given the prompt."""
        import torch

        shared = shared_prefix([s.prompt_ids for s in samples], self.MIN_SHARED_PREFIX)
        packed = _pack(samples, shared, self.pad_id)
        decoder, head = self._decoder_and_head()
        hidden = self._hidden(decoder, samples[0].prompt_ids[:shared], packed)
        flat_r = [r for mine in packed.where for r, qs in mine for _ in qs]
        flat_q = [q for mine in packed.where for _, qs in mine for q in qs]
        tokens = torch.tensor(
            [t for s in samples for c in s.completions for t in c], device=self.device
        )
        logp = torch.log_softmax(head(hidden[flat_r, flat_q]).float(), dim=-1)
        token_lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1) if entropy else None
        return _per_completion(samples, token_lp), _per_completion(samples, ent)

    def _hidden(self, decoder: Any, prefix: list[int], packed: _Packed) -> Any:
        """The decoder's last hidden states of the packed rows, the shared ``prefix`` encoded
        once (with gradient) and its key/value cache repeated for every row."""
        import torch

        rows, width = packed.ids.shape
        shared = len(prefix)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros((rows, 1, width, shared + width), dtype=dtype)
        mask.masked_fill_(~packed.allowed[:, None], torch.finfo(dtype).min)
        cache = None
        if shared:
            cache = decoder(
                input_ids=torch.tensor([prefix], device=self.device), use_cache=True
            ).past_key_values
            cache.batch_repeat_interleave(rows)
        return decoder(
            input_ids=packed.ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=packed.pos.to(self.device),
            past_key_values=cache,
            use_cache=cache is not None,
        ).last_hidden_state

    def action_logprobs(
        self, samples: Sequence[Sample], entropy: bool = False
    ) -> tuple[list[Any], list[Any]]:
        """Per sample, log pi(action token) under the current adapter (and entropies, if asked).

        Text: the completion's per-token log-probs. Scored: log softmax over the
        legal candidates' summed log-probs at the agent's temperature, chosen entry.
        """
        import torch

        lps, ents = self._completion_logprobs(samples, entropy)
        out_lp, out_ent = [], []
        for s, lp, ent in zip(samples, lps, ents, strict=True):
            if s.scored:
                totals = torch.stack([x.sum() for x in lp]) / s.temperature
                dist = torch.log_softmax(totals, dim=0)
                out_lp.append(dist[s.chosen : s.chosen + 1])
                out_ent.append(-(dist.exp() * dist).sum().view(1) if entropy else None)
            else:
                out_lp.append(lp[0])
                out_ent.append(ent[0])
        return out_lp, out_ent

    def micro_batches(self, samples: Sequence[Sample]) -> Iterator[list[Sample]]:
        """Groups of samples costing at most ``self.micro_batch_tokens`` through the model.

        A group costs its common prompt prefix once plus one packed row per
        sample (as wide as the widest prompt tail with its completions):
        ``shared + n * (longest - shared)``. Sorting by prompt keeps samples
        with long common prefixes together.
        """
        batch: list[Sample] = []
        shared = longest = 0
        # the whole sample as the key: equal prompts (every match's first round) keep no
        # arrival order, so the float sums of a step are the same in every run of a seed
        for s in sorted(samples, key=lambda s: (s.prompt_ids, s.completions, s.chosen, s.credit)):
            size = len(s.prompt_ids) + sum(map(len, s.completions))
            if batch:
                limit = shared if len(batch) > 1 else len(batch[0].prompt_ids) - 1
                common = min(
                    _common(batch[0].prompt_ids, s.prompt_ids, limit), len(s.prompt_ids) - 1
                )
                effective = common if common >= self.MIN_SHARED_PREFIX else 0
                wider = max(longest, size)
                if effective + (len(batch) + 1) * (wider - effective) <= self.micro_batch_tokens:
                    batch.append(s)
                    shared, longest = common, wider
                    continue
                yield batch
            batch, shared, longest = [s], 0, size
        if batch:
            yield batch

    # --- one step -------------------------------------------------------------------

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """One optimiser step over the whole batch (gradients accumulated over micro-batches).

        Data-parallel when ``torch.distributed`` is initialised (``backroom
        train --nproc N`` starts the ranks with torchrun): every rank gets the
        same batch, takes every N-th sample, and the gradients are summed with
        one all-reduce before the (identical) Adam step on every rank. The loss
        is divided by the whole batch's action tokens, so N ranks compute the
        same gradient as one process. An all-reduce after local accumulation,
        rather than DDP's per-backward hooks, because ranks may run different
        numbers of micro-batches.
        """
        import time

        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        n_tokens = sum(s.action_tokens for s in samples)
        if n_tokens == 0:
            raise ValueError("a training step needs at least one decision with action tokens")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        mine = list(samples)[dist.get_rank() :: world] if world > 1 else list(samples)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # loss, KL, entropy, clamped, tokens: summed on the device, read once at the end
        totals = torch.zeros(5, device=self.device)
        for batch in self.micro_batches(mine):
            if self.stop.is_set():
                self.stop.clear()  # answered: a learner kept after this can step again
                self.optimizer.zero_grad(set_to_none=True)
                raise StepInterrupted("the step was stopped before its update")
            self._accumulate(batch, n_tokens, totals)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if world > 1:
            _all_reduce(params, totals)
        stats = StepStats()
        stats.loss, stats.kl, stats.entropy, stats.tis_clamped = (float(x) for x in totals[:4])
        stats.tokens = int(totals[4])
        stats.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats.action_tokens = n_tokens
        stats.kl /= n_tokens
        stats.entropy /= n_tokens
        stats.tis_clamped /= n_tokens
        stats.seconds = time.perf_counter() - t0
        return stats

    def _accumulate(self, batch: list[Sample], n_tokens: int, totals: Any) -> None:
        """One micro-batch's share of the loss, back-propagated; its statistics into ``totals``."""
        import torch

        st = self.settings
        want_entropy = st.entropy_coef != 0.0
        now, ents = self.action_logprobs(batch, entropy=want_entropy)
        lp = torch.cat(now)  # one entry per action token of the micro-batch
        behaviour = torch.tensor([b for s in batch for b in s.behaviour], device=lp.device)
        credit = torch.tensor(
            [s.credit for s in batch for _ in range(s.action_tokens)], device=lp.device
        )
        ratio = torch.exp(lp.detach() - behaviour)
        w = ratio.clamp(max=st.tis_cap)  # min(exp(logp_now - logp_behaviour), cap), detached
        loss = -(w * credit * lp).sum()  # REINFORCE with the round's credit
        if st.kl_coef:
            with torch.no_grad(), self.model.disable_adapter():
                ref = torch.cat(self.action_logprobs(batch)[0])
            d = ref - lp
            kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || pi_ref)
            loss = loss + st.kl_coef * kl.sum()
            totals[1] += kl.detach().sum()
        if want_entropy:
            ent = torch.cat(ents)
            loss = loss - st.entropy_coef * ent.sum()
            totals[2] += ent.detach().sum()
        else:  # no full-vocabulary pass just for a statistic: E[-log pi(a)] estimates H on-policy
            totals[2] += -lp.detach().sum()
        totals[3] += (ratio > st.tis_cap).sum()
        loss = loss / n_tokens  # normalised by the number of action tokens of the batch
        loss.backward()
        totals[0] += loss.detach()
        totals[4] += sum(len(s.prompt_ids) + sum(map(len, s.completions)) for s in batch)

    # --- checkpoints ----------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        """Write the adapter (safetensors) to ``folder`` atomically: a temp folder, then a rename."""
        target = Path(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            self.model.save_pretrained(str(tmp), safe_serialization=True)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def optimizer_state(self) -> dict[str, Any]:
        return dict(self.optimizer.state_dict())

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


@dataclass
class _Packed:
    """A micro-batch as one forward pass's rows (``Learner._completion_logprobs``)."""

    ids: Any  # (rows, width): each decision's prompt tail, then all its completions
    pos: Any  # their position ids, after the shared prefix
    allowed: Any  # (rows, width, shared + width): which keys each position may see
    where: list[list[tuple[int, list[int]]]]  # per sample, per completion: (row, predictors)


def _pack(samples: Sequence[Sample], shared: int, pad_id: int) -> _Packed:
    """One row per sample past the ``shared`` prefix, under a mask that lets a completion
    token see the prefix, its prompt tail and the earlier tokens of its own completion."""
    import torch

    rows = len(samples)
    width = max(len(s.prompt_ids) - shared + sum(map(len, s.completions)) for s in samples)
    packed = _Packed(
        ids=torch.full((rows, width), pad_id, dtype=torch.long),
        pos=torch.zeros((rows, width), dtype=torch.long),
        allowed=torch.zeros((rows, width, shared + width), dtype=torch.bool),
        where=[],
    )
    packed.allowed[:, :, :shared] = True
    for r, s in enumerate(samples):
        packed.where.append(_pack_row(packed, r, s, shared))
    return packed


def _pack_row(packed: _Packed, r: int, s: Sample, shared: int) -> list[tuple[int, list[int]]]:
    """Row ``r``: the prompt tail, then each completion; per completion, its predictors."""
    import torch

    ids, pos, allowed = packed.ids, packed.pos, packed.allowed
    tail = s.prompt_ids[shared:]
    p = len(tail)
    ids[r, :p] = torch.tensor(tail)
    pos[r, :p] = torch.arange(shared, shared + p)
    allowed[r, :p, shared : shared + p] = torch.ones(p, p, dtype=torch.bool).tril()
    start, mine = p, []
    for c in s.completions:
        n = len(c)
        ids[r, start : start + n] = torch.tensor(c)
        pos[r, start : start + n] = torch.arange(shared + p, shared + p + n)
        allowed[r, start : start + n, shared : shared + p] = True
        allowed[r, start : start + n, shared + start : shared + start + n] = torch.ones(
            n, n, dtype=torch.bool
        ).tril()
        mine.append((r, [p - 1, *range(start, start + n - 1)]))
        start += n
    for q in range(start, ids.shape[1]):  # padding sees itself only
        allowed[r, q, shared + q] = True
    return mine


def _per_completion(samples: Sequence[Sample], flat: Any) -> list[list[Any]]:
    """Per-token values of the packed completions, per sample, per completion (or None)."""
    out: list[list[Any]] = []
    i = 0
    for s in samples:
        out.append([])
        for c in s.completions:
            out[-1].append(flat[i : i + len(c)] if flat is not None else None)
            i += len(c)
    return out


def _all_reduce(params: list[Any], totals: Any) -> None:
    """The ranks' gradients and statistics summed (a rank with no sample joins with zeros)."""
    import torch
    import torch.distributed as dist

    for p in params:
        if p.grad is None:  # a rank with no sample still joins every all-reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    dist.all_reduce(totals)


def shared_prefix(prompts: Sequence[Sequence[int]], minimum: int) -> int:
    """Length of the common token prefix worth encoding once (each prompt keeps >= 1 own token)."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    k = 0
    while k < n and all(p[k] == first[k] for p in prompts):
        k += 1
    return k if k >= minimum else 0


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    k, n = 0, min(limit, len(a), len(b))
    while k < n and a[k] == b[k]:
        k += 1
    return k
