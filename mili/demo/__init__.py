"""MILI's demo models: the trained ``demo`` checkpoint shipped in the package (``checkpoint/``), its hybrid
twin ``demo-hybrid`` (``checkpoint-hybrid/``: Qwen3.5 with an MTP head, hybrid.py), and the script that
trained them (``python -m mili.demo.train``, ``--arch hybrid`` for the twin)."""

from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"
HYBRID_CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint-hybrid"
