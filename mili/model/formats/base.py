"""The base of the weight formats (``LinearFormat``) and their registry (``FORMATS``): each format's class
registers itself by its name as it is defined, and the package imports each of its modules (``formats/__init__``),
so a new format is one module of the package (and its tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

# every format by its name, filled in as each class is defined (``LinearFormat.__init_subclass__``)
FORMATS: dict[str, type[LinearFormat]] = {}


@dataclass(frozen=True)
class LinearFormat:
    """How the body's linear layers compute (the plan's ``linears``), or the lm_head's (the plan's ``lm_head``): the
    layers it puts on their kernels once the weights are in (``apply``, ``apply_head``), what the plan reads of it
    (``fused_decode``, ``gemm_kinds``) and the bytes a weight takes (``bytes_per_weight``, the roofline's).
    An instance holds the choices the plan made for it (a frozen dataclass: equal where those are)."""

    name: ClassVar[str] = ""  # the registry's key, and how the logs name it
    summary: ClassVar[str] = ""  # what it is, in words
    # the Triton GEMMs whose tiles the plan picks for it: (kind, bytes a weight) each
    gemm_kinds: ClassVar[tuple[tuple[str, float], ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            if name in FORMATS and FORMATS[name] is not cls:
                raise ValueError(f"two weight formats named {name!r}: {FORMATS[name].__qualname__}, {cls.__qualname__}")
            FORMATS[name] = cls

    @property
    def fused_decode(self) -> bool:
        """The C decode layer (runtime/cpu_decode.py) takes this format's layers whole (MILI's CPU kernels)."""
        return False

    def bytes_per_weight(self, dtype: torch.dtype) -> float:
        """The bytes a decode step reads per weight of a layer in this format (its scales spread over the weights),
        in a model of ``dtype``."""
        raise NotImplementedError

    def apply(self, model, quantized: dict, skip_head: bool) -> None:
        """Put ``model``'s linear layers on this format's kernels (its lm_head too, tied or not, unless
        ``skip_head``: the plan's lm_head format takes it). ``quantized``: the checkpoint's layers the loader kept
        as stored (weight name -> parts)."""
        raise NotImplementedError

    def apply_head(self, model) -> None:
        """Put the lm_head alone on this format (the plan's ``lm_head``: --lm-head-dtype)."""
        raise NotImplementedError(f"the {self.name} format does not take the lm_head alone")

    def describe_head(self, dtype: torch.dtype) -> str:
        """The lm_head in this format, in words (after "lm_head" in the plan's weights line)."""
        return str(dtype).removeprefix("torch.")
