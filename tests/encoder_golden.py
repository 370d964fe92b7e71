"""The encoder's outputs on fixed inputs, stored once and compared bit for bit after every change.

tests/data/encoder_golden.npz was written by this file run as a script (`python
tests/encoder_golden.py --write`) from the code BEFORE `VisionEncoder` was cut into named parts
(commit a083492), on the CPU and jax named in its `machine` entry. test_golden.py runs it again
(`--check`) and requires every array equal: the facade and its parts change no bit. It drives the
public API only: tiny random towers written as the demo writes them (Qwen2.5-VL, Qwen3-VL with
deepstack, PaddleOCR-VL's raster rows), float32 and bfloat16, float rows and uint8 `Patches`
(encode_images, encode_video), requests split into several chunks and buckets, a declared size
(warmup(tight=True)), tight_after, and a mesh of two host devices.

XLA's CPU kernels depend on the instruction set, so bits are compared only where the machine
(CPU model, jax and jaxlib versions) is the one recorded; elsewhere the check holds every array to
the float32 padding-invariance bar (1e-5 relative) and bfloat16 ones to docs/numerics.md's bars,
and says so.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # two host devices for the mesh case: set before jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib
import platform
import tempfile

import numpy as np

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "encoder_golden.npz"
COLUMNS = 32  # of each output row's out_dim values, stored (a misplaced row changes every column)


def machine() -> str:
    """The CPU model, its vector extensions and the jax / jaxlib versions: what fixes XLA's bits."""
    import jax
    import jaxlib

    model, flags = platform.processor(), ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx"))))
    except OSError:
        pass
    return f"{model} [{flags}] jax {jax.__version__} jaxlib {jaxlib.__version__}"


def images(seed: int) -> list:
    """Three small deterministic RGB images of different sizes (smooth gradients plus a block)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for h, w in ((84, 112), (140, 98), (56, 168)):
        y, x = np.mgrid[0:h, 0:w]
        a = np.stack([x / w, y / h, (x + y) / (w + h)], -1) * rng.uniform(100, 255, 3)
        a[h // 3 :, : w // 2] = rng.integers(0, 256, 3)
        out.append(Image.fromarray(a.astype(np.uint8)))
    return out


def video(seed: int) -> np.ndarray:
    """uint8 [5, 84, 112, 3]: five frames of a moving block (an odd count: the last one repeats)."""
    rng = np.random.default_rng(seed)
    frames = np.broadcast_to(rng.integers(0, 256, (1, 84, 112, 3)), (5, 84, 112, 3)).copy()
    for i in range(5):
        frames[i, 10 + 8 * i : 40 + 8 * i, 20:60] = (200, 40 + 30 * i, 90)
    return frames.astype(np.uint8)


def pixels(grid, patch_dim: int, seed: int) -> np.ndarray:
    """float32 [sum(t * h * w), patch_dim] normal rows."""
    n = int(np.prod(np.asarray(grid), axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, patch_dim)).astype(np.float32)


def outputs() -> dict[str, np.ndarray]:
    """Every case's arrays, by name."""
    import jax

    import qwen_vit_jax as qvj
    from qwen_vit_jax.tools.demo import TINY, TINY_QWEN3_VL, VARIANTS, write_random_hf_checkpoint

    out: dict[str, np.ndarray] = {}
    mixed = [[1, 8, 8], [1, 10, 14], [2, 6, 8]]
    many = [[1, 12, 12], [3, 8, 8], [1, 16, 12], [2, 10, 10], [1, 8, 8]]  # several chunks at 256 rows
    small = qvj.BucketPolicy(max_patches=256)
    with tempfile.TemporaryDirectory() as root:
        ckpt = {}
        for name, cfg in (("qwen25", TINY), ("qwen3", TINY_QWEN3_VL), ("paddle", VARIANTS["paddleocr-vl"]["tiny"])):
            hf = write_random_hf_checkpoint(cfg, pathlib.Path(root) / name / "hf", seed=1)
            ckpt[name] = qvj.convert_checkpoint(hf, pathlib.Path(root) / name / "ckpt")

        for dtype in ("float32", "bfloat16"):
            enc = qvj.VisionEncoder.from_pretrained(ckpt["qwen25"], dtype=dtype)
            d = enc.cfg.patch_dim
            out[f"qwen25/{dtype}/encode"] = enc.encode(pixels(mixed, d, 0), mixed)
            for i, e in enumerate(enc.encode_images(images(1))):
                out[f"qwen25/{dtype}/images/{i}"] = e
            chunks = qvj.VisionEncoder.from_pretrained(ckpt["qwen25"], dtype=dtype, policy=small)
            out[f"qwen25/{dtype}/chunks"] = chunks.encode(pixels(many, d, 2), many)
            if dtype == "float32":
                out["qwen25/float32/video"] = enc.encode_video(video(3))
                out["qwen25/float32/video_patches"] = enc.encode_images([video(3)[0]])[0]
                big = [[1, 24, 28]]
                out["qwen25/float32/ladder"] = enc.encode(pixels(big, d, 4), big)
                enc.warmup([big], tight=True)  # declared: its tight bucket from now on
                out["qwen25/float32/declared"] = enc.encode(pixels(big, d, 4), big)
                again = qvj.VisionEncoder.from_pretrained(ckpt["qwen25"], dtype=dtype, tight_after=2)
                for k in range(3):  # ladder, then tight from the second encode on
                    out[f"qwen25/float32/tight_after/{k}"] = again.encode(pixels(mixed, d, 5), mixed)

        for dtype in ("float32", "bfloat16"):
            enc = qvj.VisionEncoder.from_pretrained(ckpt["qwen3"], dtype=dtype)
            grid = [[1, 8, 12], [2, 8, 8]]
            tokens, deep = enc.encode(pixels(grid, enc.cfg.patch_dim, 6), grid, return_deepstack=True)
            out[f"qwen3/{dtype}/tokens"] = tokens
            for k, f in enumerate(deep):
                out[f"qwen3/{dtype}/deepstack/{k}"] = f
            out[f"qwen3/{dtype}/images/0"] = enc.encode_images(images(7)[:1])[0]

        enc = qvj.VisionEncoder.from_pretrained(ckpt["paddle"])
        grid = [[1, 8, 12], [1, 6, 6]]
        out["paddle/float32/encode"] = enc.encode(pixels(grid, enc.cfg.patch_dim, 8), grid)
        for i, e in enumerate(enc.encode_images(images(9)[:2])):
            out[f"paddle/float32/images/{i}"] = e

        mesh = qvj.VisionEncoder.from_pretrained(ckpt["qwen25"], devices=jax.devices()[:2])
        out["mesh/float32/encode"] = mesh.encode(pixels(mixed, mesh.cfg.patch_dim, 0), mixed)
        rounds = qvj.VisionEncoder.from_pretrained(ckpt["qwen25"], devices=jax.devices()[:2], policy=small)
        out["mesh/float32/rounds"] = rounds.encode(pixels(many, mesh.cfg.patch_dim, 2), many)
        for i, e in enumerate(mesh.encode_images(images(1)[:2])):
            out[f"mesh/float32/images/{i}"] = e
    return out


def compare(want: dict, got: dict, bitwise: bool) -> list[str]:
    """The names whose arrays differ (bitwise, or past the bars)."""
    bad = [f"{k}: missing" for k in want if k not in got] + [f"{k}: new" for k in got if k not in want]
    for k in sorted(set(want) & set(got)):
        a, b = np.asarray(want[k]), np.asarray(got[k])
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif bitwise:
            if not np.array_equal(a, b):
                bad.append(f"{k}: {int((a != b).sum())} of {a.size} values differ")
        else:
            rel = np.linalg.norm(b - a) / np.linalg.norm(a)
            if rel > (2e-2 if "bfloat16" in k else 1e-5):
                bad.append(f"{k}: relative error {rel:.3g}")
    return bad


def main(argv: list[str]) -> int:
    got = {k: np.ascontiguousarray(v[:, :COLUMNS]) for k, v in outputs().items()}
    if argv == ["--write"]:
        GOLDEN.parent.mkdir(exist_ok=True)
        np.savez_compressed(GOLDEN, machine=np.array(machine()), **got)
        print(f"wrote {len(got)} arrays to {GOLDEN}")
        return 0
    if argv != ["--check"]:
        print("usage: encoder_golden.py --write | --check", file=sys.stderr)
        return 2
    with np.load(GOLDEN) as f:
        want = {k: f[k] for k in f.files}
    made_on = str(want.pop("machine"))
    bitwise = made_on == machine()
    bad = compare(want, got, bitwise)
    how = "bit for bit" if bitwise else f"at the numerics bars (made on {made_on}; this is {machine()})"
    if bad:
        print(f"{len(bad)} of {len(want)} arrays differ ({how}):\n" + "\n".join(bad))
        return 1
    print(f"all {len(want)} arrays equal ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
