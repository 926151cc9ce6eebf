"""MILI's demo models: the trained ``demo`` checkpoint shipped in the package (``checkpoint/``), and the
script that trained it (``python -m mili.demo.train``)."""

from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"
