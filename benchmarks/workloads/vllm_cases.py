"""What tests/test_vllm.py gives vLLM: tiny Qwen2.5-VL and Qwen3-VL checkpoints that vLLM serves
(config, random weights, a byte-level BPE tokenizer with Qwen's special tokens, a Qwen-style chat
template, the processor configs), the inputs, and the run of benchmarks/workloads/vllm_engine.py in the vLLM venv.

The checkpoints are written here, with this venv's transformers (vLLM's own reads them): the
processor configs as JSON, since this venv has no torchvision for HF's video processors. The LM head
is scaled up (LM_HEAD_SCALE): with HF's default init the logits are nearly flat, and a 1% change of
the embeddings would move the logprobs by ~4e-4 only. Scaled too far (50x) the model is so sure of
its greedy token that a spoiled embedding moves no logprob of it (1e-7); at 5x the first token's
logprob is about -2.4 and 1% off moves the top logprobs by ~1e-3, well past the 1e-4 the tests
allow, so the tests compare each step's top TOP_LOGPROBS.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

import numpy as np

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
PADS = ("<|image_pad|>", "<|video_pad|>")
# Qwen's chat template, cut to what the tests send: a user turn of images / videos and text.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_TEXT, VIDEO_TEXT = "Describe the picture.", "What is in the video?"
LM_HEAD_SCALE = 5.0
NEW_TOKENS = 8
TOP_LOGPROBS = 5

# Per family: the patch side (images of sides that are multiples of patch * merge need no resize, so
# vLLM's torchvision resize and our PIL one give the same pixels), three image sizes (w, h), the
# video's frames (count, h, w) and frame rate.
FAMILIES = {
    "qwen2_5_vl": dict(patch=14, sizes=[(224, 168), (112, 280), (336, 336)], frames=(8, 112, 140), fps=4.0),
    "qwen3_vl": dict(patch=16, sizes=[(256, 192), (128, 320), (320, 320)], frames=(8, 128, 160), fps=4.0),
}


def tokenizer(out: pathlib.Path):
    """A byte-level BPE tokenizer (313 learned tokens, then Qwen's special tokens): the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = f"{IMAGE_TEXT} {VIDEO_TEXT} The quick brown fox jumps over the lazy dog. user assistant system"
    trainer = trainers.BpeTrainer(vocab_size=313, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text] * 10, trainer)
    tok.add_special_tokens([*SPECIAL, *PADS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(out)
    return {s: tok.token_to_id(s) for s in (*SPECIAL, *PADS)}, tok.get_vocab_size()


def write_checkpoint(
    out: pathlib.Path, family: str, seed: int = 0, *, text_over=None, vision_over=None, max_pixels: int | None = None
) -> pathlib.Path:
    """A tiny HF checkpoint of `family` that vLLM serves: weights, tokenizer, chat template, processor.
    `text_over` / `vision_over`: config fields over the tiny ones (benchmarks/vllm_store.py: the real 3B
    tower); `max_pixels`: the processors' bound (default 1024 merge units)."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    ids, vocab = tokenizer(out)
    text = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128)
    vision.update(vision_over or {})
    text.update(text_over or {})
    if family == "qwen2_5_vl":
        text.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
        vision = dict(dict(window_size=112, fullatt_block_indexes=[1, 3], tokens_per_second=2), **vision)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        text.update(head_dim=32)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        }
        vision.update(patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[1, 2])
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(out)
    _processor_configs(out, family, max_pixels)
    return out


def _processor_configs(out: pathlib.Path, family: str, max_pixels: int | None) -> None:
    patch = FAMILIES[family]["patch"]
    unit = patch * 2
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073] if family == "qwen2_5_vl" else [0.5, 0.5, 0.5],
        "image_std": [0.26862954, 0.26130258, 0.27577711] if family == "qwen2_5_vl" else [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": patch,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 4 * unit * unit, "longest_edge": max_pixels or 1024 * unit * unit},
    }
    if family == "qwen2_5_vl":
        image = dict(common, image_processor_type="Qwen2VLImageProcessor")
        video = dict(common, video_processor_type="Qwen2VLVideoProcessor", do_sample_frames=False)
        video.update(min_frames=4, max_frames=768)
        processor = "Qwen2_5_VLProcessor"
    else:
        image = dict(common, image_processor_type="Qwen2VLImageProcessorFast")
        video = dict(common, video_processor_type="Qwen3VLVideoProcessor", do_sample_frames=False)
        video.update(min_frames=4, max_frames=768, fps=2)
        processor = "Qwen3VLProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor}, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_images(folder: pathlib.Path, family: str) -> list[pathlib.Path]:
    """Three PNGs of the family's sizes (smooth gradients with noise: not flat, not pure noise)."""
    from PIL import Image

    paths = []
    for i, (w, h) in enumerate(FAMILIES[family]["sizes"]):
        rng = np.random.default_rng(10 + i)
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], -1)
        px = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        paths.append(folder / f"image{i}.png")
        Image.fromarray(px).save(paths[-1])
    return paths


def video_frames(family: str) -> np.ndarray:
    n, h, w = FAMILIES[family]["frames"]
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def prompt(kind: str) -> str:
    """The prompt the chat template writes for one image / video and its question."""
    pad, text = ("<|image_pad|>", IMAGE_TEXT) if kind == "image" else ("<|video_pad|>", VIDEO_TEXT)
    return f"<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"


def engine_env() -> dict[str, str]:
    """The environment of a vLLM engine process in the vLLM venv (none of this venv's Python or JAX
    settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX_", "XLA_"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB: the tiny model's cache; the default takes far more
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # a shared 2-core machine: no pinning
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine in this process: one start, its log here
        VLLM_LOGGING_LEVEL="DEBUG",  # the connector says at DEBUG which items it loaded from the store
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_engine(python: pathlib.Path, plan: dict, folder: pathlib.Path, timeout: float = 900) -> dict:
    """benchmarks/workloads/vllm_engine.py with `plan` in the vLLM venv: its results, with the run's wall time. The
    engine's log is kept in `folder` (engine.log) and its tail shown on a failure."""
    plan_file, results_file, log = folder / "plan.json", folder / "results.json", folder / "engine.log"
    plan_file.write_text(json.dumps(plan, indent=1))
    env = engine_env()
    script = pathlib.Path(__file__).with_name("vllm_engine.py")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(
            [str(python), str(script), str(plan_file), str(results_file)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
        )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise AssertionError(f"vLLM's side failed (exit {p.returncode}); {log}:\n{tail}")
    return dict(json.loads(results_file.read_text()), wall_s=wall)
