"""Reading a DeepSpeed JSON config file into a dict: the one reader behind both importers.

:mod:`zinf_jax.config.deepspeed` reads a ``--deepspeed-config`` JSON with it, and
:mod:`zinf_jax.config.accelerate` the ``deepspeed_config_file`` an accelerate YAML names.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from zinf_jax.errors import ConfigError


def read_deepspeed_json(path: Any) -> dict[str, Any]:
    """The top-level object of a DeepSpeed JSON file.

    Raises:
      ConfigError: the file is missing, is not JSON, or does not hold an object.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config file not found: {source}") from None
    except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"cannot read DeepSpeed config {source} (invalid JSON?): {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"DeepSpeed config {source}: expected a JSON object at the top, got {data!r:.40}")
    return dict(data)
