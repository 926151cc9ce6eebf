"""The weight formats, as objects: one class per way the linear layers compute (``LinearFormat``), behind one
registry (``FORMATS``, ``format_named``). The plan (runtime/plan.py) chooses one for the body's layers and one for
the lm_head (or none) and holds those objects; the model builder applies them (``apply``, ``apply_head``), and no
one compares a plan's format to a string.

Each module of this package holds a family of formats, and each is registered by its class's ``name`` as it is
defined; this package imports every one of its modules, so adding a format is adding its module (and its tests):

* ``plain``: the layers as loaded (aten), and oneDNN-packed bf16 (``packed``).
* ``kernel``: MILI's CPU kernels: bf16, and a checkpoint's AWQ and GGUF blocks as stored (int4, int8g).
* ``int8``: --quantization int8 per output channel, on the CPU (``int8``) or the Triton int8 GEMM (``triton-int8``).
* ``fp8``: --quantization fp8 per output channel on torch._scaled_mm (GPUs with FP8).
* ``triton``: a quantized checkpoint's layers as stored on the Triton GEMMs (FP8 blocks and channels, AWQ int4).
"""

from __future__ import annotations

import importlib
import pkgutil

from mili.model.formats.base import FORMATS, LinearFormat


def load_modules() -> None:
    """Import every module of the package (each registers its formats as its classes are defined)."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


load_modules()


def format_named(name: str, **choices) -> LinearFormat:
    """The format registered as ``name``, with the plan's ``choices`` for it (its dataclass fields)."""
    try:
        return FORMATS[name](**choices)
    except KeyError:
        raise ValueError(f"no weight format named {name!r} (there are {', '.join(sorted(FORMATS))})") from None


__all__ = ["FORMATS", "LinearFormat", "format_named", "load_modules"]
