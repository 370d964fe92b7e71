"""The language model's inputs, planned on the host: the prompt's M-RoPE positions and rope deltas
(`rope_index`), the positions of the next tokens while decoding (`decode_positions`), the splice of
the tower's embeddings into the text embeddings, placeholder expansion on token ids, and the rotary
tables those positions give the text model (`mrope_tables`, `apply_mrope`).

  rope_config.py  `TextRotary`: the text model's rotary numbers read from its config (inv_freq per
                  rope type, attention scaling), the frequency layout of sections / interleave.
  config.py       `PromptConfig` (a family's token ids, its row of position and rotary rules,
                  `RULES`, and its rotary numbers), `prompt_config(source)` (read once, cached).
  kernels.py      the numba kernel: positions and splice indices in one pass per row, reading the
                  family's row.
  positions.py    `rope_index`, `decode_positions`, `token_types`: input checks around the kernel.
  splice.py       `splice`: the embeddings into the text embeddings (host indices, one device gather).
  inputs.py       `lm_inputs`: positions, deltas and splice indices of a request from one kernel call.
  rotary.py       `mrope_tables`, `apply_mrope`: the family's text rotary in JAX (or numpy).
  expand.py       `expand_placeholders`: one pad token per image / video -> its full run.

Host work above weights/ (it reads a checkpoint's config through it, checks grids with plan/'s
check) that never imports the model or the runtime; splice.py and rotary.py compute in jnp (not
imported here), the rest in numpy and numba.
"""

from .config import PromptConfig, RopeRules, prompt_config
from .positions import decode_positions, rope_index, token_types
from .rope_config import TextRotary

__all__ = [
    "PromptConfig",
    "RopeRules",
    "TextRotary",
    "decode_positions",
    "prompt_config",
    "rope_index",
    "token_types",
]
