"""DPO on table talk: the Loki paper's Algorithm 4, from a stored run to a LoRA adapter.

Algorithm 4 collects, per player and per information state, the messages the
player sent and their values, and prefers every message with a higher value
over one with a lower value. Here:

* **information state** = the exact prompt token ids of the talk decision,
  per seat. The prompt is everything the agent saw when it spoke (rules, card,
  history, messages received), so equal ids mean an equal view, and nothing
  has to be re-derived from a game-specific observation.
* **value** of a message = the seat's episode return (``returns[seat]``, after
  the run's reward transform: with Loki's coalition payoff both colluders are
  paid the pair's mean), averaged over the times that exact message (the same
  completion ids) was sent from that state: the sample estimate of the
  message's expected value.
* **pairs**: see ``pair_group``; at most one pair per distinct message, so a
  big run grows the data set linearly, not quadratically.

Training uses TRL's ``DPOTrainer`` (its sigmoid DPO loss, not ours) on a
fresh peft LoRA adapter over the base model; with ``peft_config`` and no
``ref_model`` TRL computes the reference log-probs with the adapter switched
off, i.e. the reference policy is exactly the base model that played.

torch, datasets, peft and trl are imported inside functions, so that reading
pairs (and the CLI) works without them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import warnings
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from backroom.bus.wire import ActionRecord, EpisodeRecord, Trace
from backroom.model.spec import ModelSpec
from backroom.runner.config import ConfigError
from backroom.runs import read_records, resolve_run_dir
from backroom.trainer.config import TrainConfig
from backroom.trainer.learner import LoraSettings

#: Where ``run_dpo`` writes, inside the training run directory.
ADAPTER_NAME = "dpo-v1"
PAIRS_FILE = "dpo_pairs.jsonl"
METRICS_FILE = "dpo_metrics.json"

#: TRL's per-step statistics that ``train_dpo`` reports (mean, first and last step).
TRL_STATS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "grad_norm",
)


class DpoError(ConfigError):
    """A DPO run that cannot start (no source, no pairs); the message names the setting to fix."""


@dataclass(frozen=True)
class Pair:
    """One preference: from ``prompt_ids`` the seat should rather have said ``chosen_ids``.

    The returns are the mean returns of each message in this information state
    (over ``chosen_count`` and ``rejected_count`` decisions); the texts are the
    messages as delivered, for people reading ``dpo_pairs.jsonl``.
    """

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    chosen_return: float
    rejected_return: float
    seat: int = 0
    chosen_count: int = 1
    rejected_count: int = 1
    chosen_text: str = ""
    rejected_text: str = ""

    @property
    def margin(self) -> float:
        return self.chosen_return - self.rejected_return

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pair:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class _Message:
    """One distinct message sent from one information state, and the returns it earned."""

    ids: tuple[int, ...]
    text: str
    returns: list[float]

    @property
    def value(self) -> float:
        return sum(self.returns) / len(self.returns)


# --- from episodes and traces to pairs ------------------------------------------------------


def _talk_seat(trace: Trace, record: EpisodeRecord) -> tuple[int | None, str]:
    """The seat this talk trace spoke for, or None and why it does not count.

    The episode is the authority on who played: the trace counts only if the
    episode has a talk turn at ``trace.turn`` by a seat that the episode gives
    to ``trace.agent`` (and that is ``trace.seat`` when the trace names one).
    A trace without a seat is resolved through the turn; if the agent held
    several seats that spoke at that turn it is ambiguous and dropped.
    """
    held = {s for s, agent in enumerate(record.seats) if agent == trace.agent}
    if trace.seat is not None and trace.seat not in held:
        return None, "not_seated"
    candidates = _talk_actions(trace, record, held)
    if not candidates:
        return None, "not_seated" if not held else "no_talk_turn"
    if len({a.seat for a in candidates}) > 1:
        return None, "ambiguous_seat"
    if any(a.timed_out for a in candidates):
        return None, "timed_out"  # the referee sent its default, not this message
    return candidates[0].seat, ""


def _talk_actions(trace: Trace, record: EpisodeRecord, held: set[int]) -> list[ActionRecord]:
    """The episode's talk actions at the trace's turn by a seat its agent held (the trace's
    own seat, when it names one)."""
    return [
        a
        for a in record.actions
        if a.turn == trace.turn
        and a.phase == "talk"
        and a.seat in held
        and (trace.seat is None or a.seat == trace.seat)
    ]


def _message_text(trace: Trace) -> str:
    reply = trace.reply
    if isinstance(reply, dict):
        for key in ("message", "text"):
            value = reply.get(key)
            if isinstance(value, str):
                return value
    return ""


def _count(stats: dict[str, int] | None, reason: str, n: int = 1) -> None:
    if stats is not None:
        stats[reason] = stats.get(reason, 0) + n


#: An information state: (seat, the prompt's token ids packed as int32, 4 bytes a token rather
#: than a tuple's ~36: a big run holds every distinct prompt at once).
State = tuple[int, bytes]


def _pack(ids: Sequence[int]) -> bytes:
    return array("i", ids).tobytes()


def _unpack(packed: bytes) -> list[int]:
    out = array("i")
    out.frombytes(packed)
    return out.tolist()


def talk_groups(
    episodes: Iterable[EpisodeRecord],
    traces: Iterable[Trace],
    stats: dict[str, int] | None = None,
) -> dict[State, dict[tuple[int, ...], _Message]]:
    """Talk decisions grouped by (seat, prompt ids), then by message (completion ids).

    Only episodes that ended normally count: a timeout, forfeit or error
    return says how the match broke, not how good a message was. A decision
    is counted once, the first of any duplicated (match, turn, seat) kept.
    ``stats`` (if given) receives how many decisions were used and why the
    others were dropped.
    """
    by_match: dict[str, EpisodeRecord] = {}
    for record in episodes:
        if record.reason != "normal":
            _count(stats, "episode_not_normal")
            continue
        by_match.setdefault(record.match, record)
    groups: dict[State, dict[tuple[int, ...], _Message]] = {}
    seen: set[tuple[str, int, int]] = set()
    for trace in traces:
        if trace.phase != "talk":
            continue
        if not trace.prompt_ids or not trace.completion_ids:
            _count(stats, "talk_empty")  # a fallback: nothing the model said
            continue
        episode = by_match.get(trace.match or "")
        if episode is None:
            _count(stats, "talk_no_episode")
            continue
        seat, why = _talk_seat(trace, episode)
        if seat is None:
            _count(stats, f"talk_{why}")
            continue
        key = (episode.match, trace.turn, seat)
        if key in seen:
            _count(stats, "talk_duplicate")
            continue
        seen.add(key)
        state = (seat, _pack(trace.prompt_ids))
        ids = tuple(trace.completion_ids)
        message = groups.setdefault(state, {}).setdefault(
            ids, _Message(ids, _message_text(trace), [])
        )
        message.returns.append(float(episode.returns[seat]))
        _count(stats, "talk_used")
    return groups


def pair_group(messages: Sequence[_Message]) -> list[tuple[_Message, _Message]]:
    """(chosen, rejected) pairs of one information state.

    The rule: rank the distinct messages by mean return, best first (ties:
    the more often sent first, then by token ids, so the result does not
    depend on input order), and pair the i-th best with the i-th worst —
    best against worst, second best against second worst, ... — while the
    better one's mean return is strictly higher. Each distinct message is in
    at most one pair, so k messages give at most k // 2 pairs; identical
    messages are one message, never a pair; equal values are never paired.
    Every pair is one of Algorithm 4's (m_i, m_j) with v_i > v_j, and the
    first is the most informative one, best against worst.
    """
    ranked = sorted(messages, key=lambda m: (-m.value, -len(m.returns), m.ids))
    out: list[tuple[_Message, _Message]] = []
    lo, hi = 0, len(ranked) - 1
    while lo < hi and ranked[lo].value > ranked[hi].value:
        out.append((ranked[lo], ranked[hi]))
        lo += 1
        hi -= 1
    return out


def preference_pairs(
    episodes: Iterable[EpisodeRecord],
    traces: Iterable[Trace],
    max_pairs: int | None = None,
    stats: dict[str, int] | None = None,
) -> list[Pair]:
    """Algorithm 4's preference pairs from a run's episodes and traces (see ``pair_group``).

    Pairs come in the order their information states first appear in the
    traces. Past ``max_pairs`` the pairs with the largest return margins are
    kept (they carry the clearest signal); ``stats`` (if given) also gets
    ``states`` (information states seen), ``states_paired`` and ``pairs_cut``.
    """
    groups = talk_groups(episodes, traces, stats)
    pairs: list[Pair] = []
    paired = 0
    for (seat, prompt), messages in groups.items():
        found = pair_group(list(messages.values()))
        paired += bool(found)
        for chosen, rejected in found:
            pairs.append(
                Pair(
                    prompt_ids=_unpack(prompt),
                    chosen_ids=list(chosen.ids),
                    rejected_ids=list(rejected.ids),
                    chosen_return=chosen.value,
                    rejected_return=rejected.value,
                    seat=seat,
                    chosen_count=len(chosen.returns),
                    rejected_count=len(rejected.returns),
                    chosen_text=chosen.text,
                    rejected_text=rejected.text,
                )
            )
    _count(stats, "states", len(groups))
    _count(stats, "states_paired", paired)
    if max_pairs is not None and len(pairs) > max_pairs:
        keep = sorted(range(len(pairs)), key=lambda i: -pairs[i].margin)[:max_pairs]
        _count(stats, "pairs_cut", len(pairs) - max_pairs)
        pairs = [pairs[i] for i in sorted(keep)]
    return pairs


# --- reading a run ----------------------------------------------------------------------


def _jsonl(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


def read_talk_traces(path: Path, stats: dict[str, int] | None = None) -> Iterator[Trace]:
    """The talk traces of a ``traces.jsonl``, streamed (a big run's file need not fit in memory).

    The file is what agents published on their trace topics; it does not
    prove who sent a line, which is why ``talk_groups`` checks every trace
    against the episode's seating.
    """
    for line in _jsonl(path):
        if '"talk"' not in line:  # cheap skip of act traces before parsing
            continue
        try:
            trace = Trace.model_validate_json(line)
        except ValidationError:
            _count(stats, "trace_unreadable")
            continue
        yield trace


# --- training -------------------------------------------------------------------------------


def _trainer_class() -> type:
    """TRL's DPOTrainer, fed token ids as they are.

    TRL 1.x has no public switch for pre-tokenized data: its dataset
    preparation always reads ``prompt``/``chosen``/``rejected`` text and
    tokenizes it. Re-tokenizing decoded text does not give back the ids the
    model sampled (merges across the prompt/completion boundary, special
    tokens, an appended EOS), and DPO must score exactly what was said. So the
    preparation step is skipped for a dataset that already holds
    ``prompt_ids``/``chosen_ids``/``rejected_ids`` — the columns TRL's own
    preparation produces and its collator (``DataCollatorForPreference``)
    reads; everything after it (collator, reference pass, loss, logging) is
    TRL's.
    """
    from trl import DPOTrainer

    class TokenIdsDPOTrainer(DPOTrainer):
        def _prepare_dataset(
            self, dataset: Any, processing_class: Any, args: Any, dataset_name: str
        ) -> Any:
            needed = {"prompt_ids", "chosen_ids", "rejected_ids"}
            if needed <= set(dataset.column_names or ()):
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    return TokenIdsDPOTrainer


def _save_adapter(model: Any, folder: Path) -> Path:
    """The adapter (safetensors) into ``folder`` atomically: a temp folder beside it, then a rename,
    so an agent or a digest never sees half an adapter."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def train_dpo(
    pairs: Sequence[Pair],
    *,
    model: ModelSpec,
    out_dir: str | Path,
    lora: LoraSettings | None = None,
    beta: float = 0.1,
    lr: float = 5e-5,
    epochs: float = 1.0,
    max_steps: int | None = None,
    batch_size: int = 4,
    seed: int = 0,
    activation_checkpointing: bool | None = None,
) -> dict[str, float]:
    """Train a fresh LoRA adapter with TRL's DPO on ``pairs``; save it to ``out_dir``.

    The data are the exact token ids of the traces (see ``_trainer_class``),
    never re-tokenized text. The base model comes from the agents' own
    loader (``Backend``: the same weights, a GGUF dequantised and cached the
    same way, bf16 on a GPU), so the reference policy is the one that
    played. ``max_steps`` (if given) overrides ``epochs``.
    ``activation_checkpointing`` defaults to on for a GPU (memory) and off on
    a CPU (speed).

    Returns TRL's statistics averaged over the logged steps (``loss``,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/*``, ``grad_norm``), each also as its first
    and last step's value (``loss_first``, ``loss_last``, ...),
    ``train_loss`` (TRL's mean), ``steps``, ``epochs``, ``pairs``,
    ``seconds`` (training) and ``load_seconds``.
    """
    if not pairs:
        raise ValueError("DPO needs at least one preference pair")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    from backroom.model.backend import Backend

    base = Backend(model).load()
    scratch = Path(tempfile.mkdtemp(prefix="backroom-dpo-"))
    try:
        args = _dpo_config(
            base,
            scratch,  # TRL's own checkpoints: none are saved, the adapter is ours
            beta=beta,
            learning_rate=lr,
            num_train_epochs=epochs,
            max_steps=max_steps if max_steps is not None else -1,
            per_device_train_batch_size=batch_size,
            seed=seed,
            activation_checkpointing=activation_checkpointing,
        )
        peft_config = _peft_config(lora or LoraSettings())
        load_seconds = time.perf_counter() - t0
        with warnings.catch_warnings():
            # peft asks transformers 5 for a deprecated attribute; nothing for us to act on
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            trainer = _trainer_class()(
                model=base.model,
                args=args,
                train_dataset=_dataset(pairs),
                processing_class=base.tokenizer,
                peft_config=peft_config,  # no ref_model: the reference is the base, adapter off
            )
            t1 = time.perf_counter()
            result = trainer.train()
            seconds = time.perf_counter() - t1
            _save_adapter(trainer.model, Path(out_dir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    metrics = _trl_stats(trainer.state.log_history)
    metrics["train_loss"] = float(result.training_loss)
    metrics["steps"] = float(result.global_step)
    metrics["epochs"] = float(trainer.state.epoch or 0.0)
    metrics["pairs"] = float(len(pairs))
    metrics["seconds"] = seconds
    metrics["load_seconds"] = load_seconds
    return metrics


def _dataset(pairs: Sequence[Pair]) -> Any:
    """The pairs as the token-id columns TRL's collator reads (``_trainer_class``)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt_ids": [list(p.prompt_ids) for p in pairs],
            "chosen_ids": [list(p.chosen_ids) for p in pairs],
            "rejected_ids": [list(p.rejected_ids) for p in pairs],
        }
    )


def _dpo_config(
    base: Any, scratch: Path, *, activation_checkpointing: bool | None, **settings: Any
) -> Any:
    """TRL's ``DPOConfig``: ``settings`` (its own names), on the device the model loaded on."""
    import torch
    from trl import DPOConfig

    on_cpu = base.device.type == "cpu"
    checkpointing = not on_cpu if activation_checkpointing is None else activation_checkpointing
    # transformers 5 renamed gradient_checkpointing; TRL still sets the old name's default.
    names = {f.name for f in fields(DPOConfig)}
    ckpt_field = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    options: dict[str, Any] = dict(
        output_dir=str(scratch),
        max_length=None,  # the whole prompt: truncating it would change the information state
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=not on_cpu and base.model.dtype == torch.bfloat16,  # the loader's choice on a GPU
        use_cpu=on_cpu,
        **settings,
    )
    options[ckpt_field] = checkpointing
    return DPOConfig(**options)


def _peft_config(lora: LoraSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def _trl_stats(history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """TRL's logged statistics (``TRL_STATS``): the mean says how training went; the first
    and last step's (``loss_first``, ``loss_last``, ...), whether it moved."""
    logged = [h for h in history if "loss" in h and "train_loss" not in h]
    metrics: dict[str, float] = {}
    for stat in TRL_STATS:
        values = [float(h[stat]) for h in logged if stat in h]
        if values:
            metrics[stat] = sum(values) / len(values)
            metrics[f"{stat}_first"] = values[0]
            metrics[f"{stat}_last"] = values[-1]
    return metrics


# --- the `backroom train` entry point -------------------------------------------------------


def run_dpo(config: TrainConfig, run_dir: Path) -> str:
    """Pairs from ``dpo.source``, DPO with TRL, the adapter in ``run_dir/adapters/dpo-v1``.

    Also writes ``run_dir/dpo_pairs.jsonl`` (what was trained on, one pair a
    line, with the messages' texts) and ``run_dir/dpo_metrics.json`` (the
    settings, TRL's statistics, the pair counts, the adapter's digest).
    Returns a one-paragraph summary for the console.
    """
    settings = config.dpo
    if settings is None:  # parse_train_config refuses algorithm: dpo without it
        raise DpoError(
            "dpo: missing; algorithm: dpo needs dpo.source, the run directory to learn from"
        )
    try:  # runs/<run> stands for its latest run: one run's episodes, never several
        source = resolve_run_dir(settings.source)
    except FileNotFoundError as exc:
        raise DpoError(f"dpo.source: {exc}") from None
    stats: dict[str, int] = {}
    episodes = _source_episodes(source, config.game, stats)
    traces = read_talk_traces(source / "traces.jsonl", stats)
    pairs = preference_pairs(episodes, traces, settings.max_pairs, stats)
    if not pairs:
        raise DpoError(
            f"dpo.source: no preference pair in {source}: {stats.get('talk_used', 0)} talk decisions "
            f"in {stats.get('states', 0)} information states, none with two different messages of "
            f"different returns (dropped: {_dropped(stats) or 'none'}); play more matches"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{PAIRS_FILE}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair.to_json()) + "\n")
    tmp.replace(run_dir / PAIRS_FILE)
    folder = run_dir / "adapters" / ADAPTER_NAME
    trained = train_dpo(
        pairs,
        model=config.model,
        out_dir=folder,
        lora=LoraSettings(
            config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.target_modules
        ),
        beta=settings.beta,
        lr=settings.lr,
        epochs=settings.epochs,
        max_steps=settings.max_steps,
        batch_size=settings.batch_size,
        seed=config.seed,
        activation_checkpointing=settings.activation_checkpointing,
    )
    from backroom.model.adapters import adapter_digest

    sha, size = adapter_digest(folder)
    report = {
        "policy": config.policy,
        "version": ADAPTER_NAME,
        "adapter": str(folder.resolve()),
        "sha256": sha,
        "size": size,
        "source": str(source.resolve()),
        "settings": settings.model_dump(),
        "data": stats,
        "metrics": trained,
    }
    tmp = run_dir / f".{METRICS_FILE}.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    tmp.replace(run_dir / METRICS_FILE)
    return (
        f"DPO on table talk: {stats.get('talk_used', 0)} talk decisions from "
        f"{len(episodes)} episodes of {source} in {stats.get('states', 0)} information states "
        f"gave {len(pairs)} preference pairs ({stats.get('states_paired', 0)} states paired; "
        f"dropped: {_dropped(stats) or 'none'}). {int(trained['steps'])} TRL DPO steps "
        f"(beta {settings.beta}, lr {settings.lr}, batch {settings.batch_size}) took "
        f"{trained['seconds']:.1f} s: loss {trained.get('loss_first', math.nan):.4f} -> "
        f"{trained.get('loss_last', math.nan):.4f}, reward accuracy "
        f"{trained.get('rewards/accuracies', math.nan):.2f}, margin "
        f"{trained.get('rewards/margins', math.nan):+.4f}. Adapter {ADAPTER_NAME} of policy "
        f"{config.policy}: {folder} (sha256 {sha[:12]}); pairs: {run_dir / PAIRS_FILE}; "
        f"metrics: {run_dir / METRICS_FILE}."
    )


def _source_episodes(source: Path, game: str, stats: dict[str, int]) -> list[EpisodeRecord]:
    """The episodes of ``game`` in run directory ``source``, which must hold traces too."""
    episodes_path, traces_path = source / "episodes.jsonl", source / "traces.jsonl"
    for path in (episodes_path, traces_path):
        if not path.is_file():
            raise DpoError(
                f"dpo.source: {path} not found; dpo.source must name a run directory "
                "played by `backroom run` with trainable (local) agents that talk"
            )
    episodes = []
    for record in read_records(episodes_path, stats):
        if record.game == game:
            episodes.append(record)
        else:
            stats["episode_other_game"] = stats.get("episode_other_game", 0) + 1
    if not episodes:
        raise DpoError(f"dpo.source: {episodes_path} holds no episode of game {game!r}")
    return episodes


def _dropped(stats: dict[str, int]) -> str:
    kept = {"talk_used", "states", "states_paired"}
    return ", ".join(f"{k} {v}" for k, v in sorted(stats.items()) if k not in kept and v)
