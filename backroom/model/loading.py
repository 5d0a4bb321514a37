"""Loading the model: GGUF conversion and its disk cache, LoRA adapters.

A GGUF file is dequantised and converted by transformers on every load (about
20 s for SmolLM2 on 2 cores); the first load writes the exact conversion to
``$BACKROOM_MODEL_CACHE`` (default ``~/.cache/backroom/models/``) so later
loads take about 1 s. Adapters are peft LoRA adapters, attached to the loaded
model by name; a batch names its adapter per row (peft's mixed-adapter
batches), ``BASE`` for a row without one.

torch, transformers and peft are imported inside the functions that use them.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backroom.model.spec import ModelSpec

log = logging.getLogger("backroom.backend")

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


# --- the model -------------------------------------------------------------------------


@dataclass
class Loaded:
    """A loaded model (on its device, in eval mode), its tokenizer (with a pad token), and the device."""

    model: Any
    tokenizer: Any
    device: Any


#: Intra-op threads of every torch process backroom starts (``apply_torch_threads``).
THREADS_ENV = "BACKROOM_TORCH_THREADS"


def torch_threads_for(processes: int, cores: int | None = None) -> int:
    """Intra-op threads for each of ``processes`` torch processes sharing this machine's cores.

    torch's default, one thread per core in every process, oversubscribes a
    machine where several compute at once: on 2 cores at load 7-8, a tiny
    model's update took 44.7 s with two threads in the trainer and its agent
    host, 4.9 s with one (docs/training.md, "Threads"). Each gets its share of
    the cores, at least one.
    """
    return max(1, (cores or usable_cores()) // max(1, processes))


def usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def apply_torch_threads() -> int:
    """Set this process's torch intra-op threads from ``BACKROOM_TORCH_THREADS`` (if set).

    The process that starts the others (``backroom train``, ``backroom run``)
    sets the variable; every model load calls this, so a process started by
    hand keeps torch's default unless told. Returns the count in force.
    """
    import torch

    wanted = os.environ.get(THREADS_ENV)
    if wanted:
        try:
            n = int(wanted)
        except ValueError:
            raise ValueError(f"{THREADS_ENV}={wanted!r} is not a whole number of threads") from None
        if n < 1:
            raise ValueError(f"{THREADS_ENV}={n}: at least one thread")
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    threads = int(torch.get_num_threads())
    log.info("torch intra-op threads: %d%s", threads, f" ({THREADS_ENV})" if wanted else "")
    return threads


def load_model(spec: ModelSpec, gguf_cache: bool = True) -> Loaded:
    """Load tokenizer and model from a Hugging Face folder or a GGUF file (blocking).

    ``device`` "auto" is CUDA when there is one; ``dtype`` None is bfloat16 on
    CUDA and float32 on a CPU (where bfloat16 is slow and imprecise). Nothing
    is downloaded: the hub is offline unless the environment says otherwise.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = spec.resolved()
    assert spec.path is not None
    model_path, gguf_file, device, dtype = spec.path, spec.gguf_file, spec.device, spec.dtype
    apply_torch_threads()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.device(device)
    if dtype:
        torch_dtype = getattr(torch, dtype)
    else:
        torch_dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    path, kw = model_source(model_path, gguf_file, gguf_cache)
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kw)
    if gguf_file and "gguf_file" in kw and gguf_cache:
        save_conversion(model, tokenizer, conversion_dir(model_path, gguf_file))
    model.to(where)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Loaded(model, tokenizer, where)


def full_attention_only(model: Any) -> bool:
    """Whether every layer attends to the whole prompt.

    A sliding-window layer keeps no whole prompt head whose keys and values
    could be sliced, so such a model gets no prompt-head cache.
    """
    layers = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    return all(t == "full_attention" for t in layers)


# --- the GGUF conversion cache ---------------------------------------------------------


def conversion_dir(model_path: str, gguf_file: str | None) -> Path | None:
    """Where a GGUF file's dequantised conversion is kept (keyed by name, size and mtime).

    None when there is no GGUF file, or it cannot be read (the load then fails
    with transformers' own error).
    """
    if not gguf_file:
        return None
    src = Path(model_path) / gguf_file
    try:
        st = src.stat()
    except OSError:
        return None
    root = Path(
        os.environ.get("BACKROOM_MODEL_CACHE") or Path.home() / ".cache" / "backroom" / "models"
    )
    return root / f"{src.stem}-{st.st_size}-{int(st.st_mtime)}"


def model_source(
    model_path: str, gguf_file: str | None, gguf_cache: bool = True
) -> tuple[str, dict[str, Any]]:
    """The folder to load from and the ``from_pretrained`` options: a cached conversion if there is one."""
    kw: dict[str, Any] = {"local_files_only": True}
    cached = conversion_dir(model_path, gguf_file) if gguf_cache else None
    if cached is not None and (cached / "config.json").exists():
        return str(cached), kw
    if gguf_file:
        kw["gguf_file"] = gguf_file
    return model_path, kw


def save_conversion(model: Any, tokenizer: Any, target: Path | None) -> None:
    """Keep the GGUF -> transformers conversion (20 s on 2 cores) so later loads take 1 s.

    The conversion is exact (the same float tensors), written to a temporary
    folder and renamed, so a crash never leaves a half-written cache. A cache
    that cannot be written costs only time: it is logged, not raised.
    """
    import tempfile

    if target is None or target.exists():
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        quantizer = getattr(model, "hf_quantizer", None)
        qconfig = getattr(model.config, "quantization_config", None)
        try:
            model.hf_quantizer = None  # dequantised already: save as plain weights
            if qconfig is not None:
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        finally:
            model.hf_quantizer = quantizer
            if qconfig is not None:
                model.config.quantization_config = qconfig
        tmp.rename(target)
    except OSError as exc:
        log.warning("could not cache the GGUF conversion in %s: %s", target, exc)


# --- LoRA adapters ---------------------------------------------------------------------


def attach_adapter(model: Any, name: str, path: str) -> Any:
    """``model`` with the peft LoRA adapter at ``path`` loaded under ``name``, in eval mode.

    The first adapter wraps the model in a ``PeftModel`` (returned: the caller
    keeps it in place of the bare model); later ones load into that wrapper.
    """
    from peft import PeftModel

    with warnings.catch_warnings():
        # peft still asks transformers 5 for a deprecated attribute; nothing for us to act on
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        if isinstance(model, PeftModel):
            model.load_adapter(path, adapter_name=name, is_trainable=False)
        else:
            model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
        model.eval()
    return model


def adapter_kwargs(loaded: Collection[str], adapters: Sequence[str | None]) -> dict[str, Any]:
    """The forward pass's options that run each row under its adapter (None: the base model).

    A model without adapters takes no ``adapter_names`` at all; asking for an
    adapter that is not loaded is an error rather than a silent base-model row.
    """
    if not loaded:
        if any(a for a in adapters):
            raise ValueError(f"adapter {next(a for a in adapters if a)!r} is not loaded")
        return {}
    for a in adapters:
        if a and a not in loaded:
            raise ValueError(f"adapter {a!r} is not loaded; loaded: {sorted(loaded)}")
    return {"adapter_names": [a or BASE for a in adapters]}


#: Qwen2 shapes for a model of random weights: ``tiny`` (2 layers, hidden 32: the Qwen
#: code path in tests, in seconds) and ``0.5b`` (Qwen2.5-0.5B's shape: GPU benchmarks).
RANDOM_QWEN_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    # hidden 128: can represent tit-for-tat (bench/ipd_warmup.py gives it a cooperative prior)
    "small": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    ),
}


def save_random_qwen(folder: Path, tokenizer: Any, size: str = "tiny", dtype: Any = None) -> Path:
    """A randomly initialised Qwen2 on ``tokenizer`` (seeded, nothing downloaded), saved to ``folder``.

    Nothing may download weights here, so the Qwen path is exercised on random
    weights of the real architecture; tests and benchmarks build it the same way.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **RANDOM_QWEN_SHAPES[size],
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
