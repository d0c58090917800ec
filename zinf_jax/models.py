"""The demo GPT and its data (the main job's model), kept here under its old import path.

It lives in :mod:`zinf_jax.app.models`; this module only re-exports it (the one module outside
``app/`` that imports from ``app/``, allowed by the layering test).
"""
from zinf_jax.app.models import GPT, Block, GPTConfig, batch_at, corpus, lm_loss

__all__ = ["GPTConfig", "Block", "GPT", "lm_loss", "corpus", "batch_at"]
