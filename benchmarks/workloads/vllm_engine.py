"""vLLM's side of tests/test_vllm.py, run in the vLLM venv (benchmarks/workloads/vllm_env.py) as a script:

    python benchmarks/workloads/vllm_engine.py PLAN.json RESULTS.json

One engine per run (one start per configuration), every case of the plan through it, the results as
JSON: per case the greedy tokens and every step's top logprobs; the store items vLLM's connector logged as
loaded ("Success load encoder cache for hash <id>", a DEBUG line); vLLM's own identifiers of the
plan's images (MultiModalHasher, as its server computes them from bytes and as LLM.generate does
from a PIL image); the engine's start time and the process's peak memory. Nothing of qwen_vit_jax
is imported here: the two sides meet in files.

A case: {"name", "modality": "image" | "video", "how": one of
  "pixels"  the image file or the video's frames (.npy, with its metadata) for vLLM's own tower;
            "uuid" given: the request's multi_modal_uuids (a store item, or one the store lacks)
  "embeds"  "mm": a torch.save'd multi_modal_data (qwen_vit_jax.vllm.mm_data's), "scale": spoil it
            by a factor, "zero_from": zero the columns from there on, "drop": leave a field out
  "chat"    the image as a data: URL through LLM.chat: vLLM's own identifier, as its server does}
"""

from __future__ import annotations

import base64
import json
import logging
import resource
import sys
import time

LOADED = "Success load encoder cache for hash "


class _Loaded(logging.Handler):
    """The store items vLLM's connector loaded, from its own log records."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.hashes: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith(LOADED):
            self.hashes.append(message[len(LOADED) :].strip())


def main(plan_file: str, results_file: str) -> None:
    plan = json.loads(open(plan_file).read())
    import numpy as np
    import torch
    import vllm
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media import ImageMediaIO

    hashes = {}
    for path in plan.get("hash_images", []):
        data = open(path, "rb").read()
        with Image.open(path) as im:
            im.load()
            hashes[path] = {
                "bytes": MultiModalHasher.hash_kwargs(
                    "blake3", model_id=plan["model"], image=ImageMediaIO().load_bytes(data)
                ),
                "pil": MultiModalHasher.hash_kwargs("blake3", model_id=plan["model"], image=im),
            }
    kw = dict(plan["engine"])
    if plan.get("store"):
        kw["ec_transfer_config"] = {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": plan["store"]},
        }
    t0 = time.perf_counter()
    llm = LLM(model=plan["model"], **kw)
    start_s = time.perf_counter() - t0
    loaded = _Loaded()  # after the engine's start: it configures vLLM's loggers anew
    logging.getLogger("vllm").addHandler(loaded)
    sp = SamplingParams(temperature=0.0, max_tokens=plan["new_tokens"], logprobs=plan["top_logprobs"])

    def answer(out) -> dict:
        o = out.outputs[0]
        top = [{str(t): p.logprob for t, p in lp.items()} for lp in o.logprobs]  # each step's top ids (+ the chosen)
        return {
            "tokens": list(o.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)],
            "top": top,
        }

    cases = {}
    for case in plan["cases"]:
        t1 = time.perf_counter()
        before = len(loaded.hashes)
        modality, how = case["modality"], case["how"]
        if how == "chat":
            data = open(case["file"], "rb").read()
            url = "data:image/png;base64," + base64.b64encode(data).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": case["text"]}]
            out = llm.chat([{"role": "user", "content": content}], sp, use_tqdm=False)[0]
        else:
            if how == "pixels" and modality == "image":
                with Image.open(case["file"]) as im:
                    item = im.convert("RGB")
            elif how == "pixels":
                item = (np.load(case["frames"]), case["metadata"])
            else:
                item = torch.load(case["mm"], weights_only=False)[modality]
                for field in case.get("drop", []):
                    del item[field]
                key = f"{modality}_embeds"
                if "scale" in case:
                    item = dict(item, **{key: item[key] * case["scale"]})
                if "zero_from" in case:  # the columns from there on zeroed (Qwen3-VL: its deepstack features)
                    spoiled = item[key].clone()
                    spoiled[:, case["zero_from"] :] = 0
                    item = dict(item, **{key: spoiled})
            request = {"prompt": case["prompt"], "multi_modal_data": {modality: item}}
            if case.get("uuid"):
                request["multi_modal_uuids"] = {modality: [case["uuid"]]}
            out = llm.generate([request], sp, use_tqdm=False)[0]
        cases[case["name"]] = dict(answer(out), seconds=time.perf_counter() - t1, loaded=loaded.hashes[before:])
    results = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "start_s": start_s,
        "cases": cases,
        "loaded": loaded.hashes,
        "hashes": hashes,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    open(results_file, "w").write(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
