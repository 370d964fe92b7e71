"""The language model's inputs, planned on the host: the prompt's M-RoPE positions and rope deltas
(`rope_index`), the positions of the next tokens while decoding (`decode_positions`), the splice of
the tower's embeddings into the text embeddings, and placeholder expansion on token ids.

  config.py     `PromptConfig` (a family's token ids and its row of position rules, `RULES`),
                `prompt_config(source)` (read once from a checkpoint, cached), `token_types`.
  kernels.py    the numba kernel: one pass over each row's ids, reading the family's row.
  positions.py  `rope_index`, `decode_positions`: input checks around the kernel.
  splice.py     `splice`: the embeddings into the text embeddings (host indices, one device gather).
  expand.py     `expand_placeholders`: one pad token per image / video -> its full run.

Host work beside plan/: it never imports the model or the runtime; only splice.py imports jax (not
imported here).
"""

from .config import PromptConfig, RopeRules, prompt_config, token_types
from .positions import decode_positions, rope_index

__all__ = ["PromptConfig", "RopeRules", "decode_positions", "prompt_config", "rope_index", "token_types"]
