"""Placeholder expansion on token ids: what HF's processors do to the text after the chat template
(`replace_image_token` / `replace_video_token` + `get_text_with_replacements`), done on ids, so a
prompt is built without torch or an HF processor.

    ids = qvj.expand_placeholders(ckpt, tokenizer.encode(chat_text), image_grid_thw=thw)

Per family (HF 5.x's processors), each single placeholder token becomes:
  image (every family): image_token_id x (t * h * w / merge^2).
  video, Qwen2-VL / Qwen2.5-VL / the Omni thinkers: video_token_id x (t * h * w / merge^2).
  video, Qwen3-VL / Qwen3.5 / Qwen4-Exp (Qwen3VLProcessor): per temporal patch f, the text
    "<{ts[f]:.1f} seconds>", then <|vision_start|>, video_token_id x (h * w / merge^2), <|vision_end|>;
    a <|vision_start|><|video_pad|><|vision_end|> wrapper around the placeholder (the chat template's)
    is dropped first, as the processor collapses it.
  video, GLM-4.1V / 4.5V (Glm4vProcessor; the placeholder is <|video|>): per temporal patch f,
    <|begin_of_image|>, image_token_id x (h * w / merge^2), <|end_of_image|>, then the text
    str(int(ts[f])).
  audio, the Omni thinkers: audio_token_id x the audio's token count.
The text between frames comes from the caller: `timestamp_ids(text)` returns the token ids of that
text (e.g. `lambda s: tokenizer.encode(s, add_special_tokens=False)`); `video_timestamps` gives the
seconds per temporal patch (qvj.preprocess_video's third output for Qwen3-VL; GLM: HF's
`metadata.timestamps[::2]`). Items are taken in order across the batch, as HF's processor does.
Not covered: the Omni thinkers' `use_audio_in_video` layout (video and audio interleaved in chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .config import prompt_config
from .positions import grid


def _rows(input_ids) -> tuple[list[np.ndarray], bool]:
    """input_ids as a list of 1-D int64 rows, and whether it was one row."""
    if isinstance(input_ids, np.ndarray) or (
        isinstance(input_ids, Sequence) and input_ids and not isinstance(input_ids[0], (Sequence, np.ndarray))
    ):
        a = np.asarray(input_ids)
        if a.ndim == 1 or a.size == 0:
            rows, single = [a.reshape(-1)], True
        elif a.ndim == 2:
            rows, single = list(a), False
        else:
            raise ValueError(f"input_ids must be [L], [B, L] or a list of rows, got shape {a.shape}")
    else:
        rows, single = [np.asarray(r) for r in input_ids], False
    for i, r in enumerate(rows):
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise ValueError(f"input_ids row {i} must be 1-D integers, got {r.dtype} {r.shape}")
    return [r.astype(np.int64) for r in rows], single


def expand_placeholders(
    source,
    input_ids,
    image_grid_thw=None,
    video_grid_thw=None,
    *,
    video_timestamps=None,
    timestamp_ids: Callable[[str], Sequence[int]] | None = None,
    audio_tokens=None,
):
    """Each single image / video / audio placeholder token of `input_ids` becomes its full run (per
    frame where the family splits videos), as HF's processor expands the text.

    Args:
        source: what `prompt_config` takes (a checkpoint directory, its config.json, a hub id in the
            local cache, a PromptConfig).
        input_ids: one prompt [L] or several (a [B, L] array or a list of rows), with one placeholder
            token per image / video / audio (what the chat template writes).
        image_grid_thw, video_grid_thw: int [n, 3], one row per image / video in prompt order across
            the batch.
        video_timestamps: Qwen3-VL family and GLM-4V videos: one sequence of seconds per video, one
            value per temporal patch (at least t of them).
        timestamp_ids: those families: text -> its token ids, called with "<1.5 seconds>" (Qwen3-VL)
            or "1" (GLM-4V).
        audio_tokens: the Omni thinkers: the token count of each audio in order.
    Returns:
        int64 [L'] for one prompt, else a list of int64 rows (their lengths differ: pad them yourself).
    Raises:
        ValueError naming the row and item when placeholders and grids (or timestamps, audio counts)
        do not pair up, and for grids of the wrong shape.
    """
    cfg = prompt_config(source)
    rows, single = _rows(input_ids)
    m = cfg.spatial_merge_size
    grids = {"image": grid(image_grid_thw, m, "image_grid_thw"), "video": grid(video_grid_thw, m, "video_grid_thw")}
    audio = np.zeros(0, np.int64) if audio_tokens is None else np.asarray(audio_tokens, np.int64).reshape(-1)
    if (audio < 1).any():
        raise ValueError(f"audio_tokens must be positive, got {audio.tolist()}")
    merge = cfg.spatial_merge_size**2
    split, glm = cfg.rules.split_frames, cfg.rules.glm_types
    placeholders = {"image": cfg.image_token_id, "video": cfg.video_token_id, "audio": cfg.audio_token_id}
    used = {"image": 0, "video": 0, "audio": 0}
    sizes = {"image": len(grids["image"]), "video": len(grids["video"]), "audio": len(audio)}

    def frame_text(v: int, f: int) -> list[int]:
        """The ids of the text HF writes with temporal patch f of video v."""
        if video_timestamps is None or timestamp_ids is None:
            raise ValueError(
                f"{cfg.family} writes each video frame's time into the prompt: expand_placeholders needs "
                "video_timestamps and timestamp_ids"
            )
        if v >= len(video_timestamps) or len(video_timestamps[v]) < int(grids["video"][v, 0]):
            have = len(video_timestamps[v]) if v < len(video_timestamps) else 0
            raise ValueError(
                f"video {v} has {int(grids['video'][v, 0])} temporal patches but video_timestamps gives {have} times"
            )
        seconds = float(video_timestamps[v][f])
        text = str(int(seconds)) if glm else f"<{seconds:.1f} seconds>"
        return [int(i) for i in timestamp_ids(text)]

    def video_run(v: int) -> list[int]:
        t, h, w = (int(x) for x in grids["video"][v])
        if not split:
            return [cfg.video_token_id] * (t * h * w // merge)
        out: list[int] = []
        per_frame = h * w // merge
        for f in range(t):
            if glm:
                out += [cfg.image_start_token_id, *[cfg.image_token_id] * per_frame, cfg.image_end_token_id]
                out += frame_text(v, f)
            else:
                out += frame_text(v, f)
                out += [cfg.vision_start_token_id, *[cfg.video_token_id] * per_frame, cfg.vision_end_token_id]
        return out

    out_rows = []
    for b, row in enumerate(rows):
        kinds = [(k, np.flatnonzero(row == tid)) for k, tid in placeholders.items() if tid is not None]
        hits = sorted((int(p), k) for k, where in kinds for p in where)
        pieces, last = [], 0
        for p, kind in hits:
            item = used[kind]
            if item >= sizes[kind]:
                what = "audio_tokens" if kind == "audio" else f"{kind}_grid_thw"
                raise ValueError(
                    f"row {b}: {kind} placeholder at {p} is {kind} {item}, but {what} has only {sizes[kind]} entries"
                )
            start, end = p, p + 1
            if kind == "video" and split and not glm:
                # the chat template's <|vision_start|><|video_pad|><|vision_end|>: each frame brings its own
                if start > last and row[start - 1] == cfg.vision_start_token_id and end < len(row):
                    if row[end] == cfg.vision_end_token_id:
                        start, end = start - 1, end + 1
            pieces.append(row[last:start])
            if kind == "image":
                run = [cfg.image_token_id] * int(np.prod(grids["image"][item]) // merge)
            elif kind == "video":
                run = video_run(item)
            else:
                run = [cfg.audio_token_id] * int(audio[item])
            pieces.append(np.asarray(run, np.int64))
            used[kind] += 1
            last = end
        pieces.append(row[last:])
        out_rows.append(np.concatenate(pieces).astype(np.int64))
    for kind in used:
        if used[kind] != sizes[kind]:
            what = "audio_tokens" if kind == "audio" else f"{kind}_grid_thw"
            raise ValueError(f"{what} has {sizes[kind]} entries but input_ids hold {used[kind]} {kind} placeholders")
    return out_rows[0] if single else out_rows
