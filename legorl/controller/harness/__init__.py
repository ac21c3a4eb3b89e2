"""Harness settings shipped with legorl (read as data files)."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
"""Folder usable as LEGORL_HARNESS_CONFIG_DIR: `mini.yaml` for mini-swe-agent."""

MINI_CONFIG = CONFIG_DIR / "mini.yaml"
