"""The suites, in the results page's order: name -> its module, the page's section (the question it
answers) and one line on what it measures. A module of a suite (benchmarks/NAME.py) defines:

  add_args(parser)   its own flags (the shared ones are the runner's: __main__.py)
  DEFAULTS           {"repeats": (full, quick), "rounds": (full, quick)}: the shared flags it takes
  AGAINST            the help of --against REV where it takes one, else absent
  run(args) -> dict  the measurement (workers in processes of their own: common.run_worker)
  report(result) -> str   its tables, markdown, from a stored result (the runner prints it after a run;
                     render.py puts it on the page)
  WORKERS            kind -> function of the worker processes (benchmarks/worker.py)
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    section: str  # the results page's "## " heading
    title: str  # the result's "### " heading
    about: str  # `python -m benchmarks` lists it

    def module(self):
        return importlib.import_module(f"benchmarks.{self.name}")


SUITES = {
    s.name: s
    for s in (
        Suite(
            "forward",
            "Forward vs HF",
            "Real-size towers",
            "real-size towers vs HF `model.visual`, fp32 / bf16, dot peaks",
        ),
        Suite(
            "peer",
            "vs EasyDeL",
            "EasyDeL 0.3.0, Qwen2-VL-2B",
            "EasyDeL 0.3.0 vs ours, Qwen2-VL-2B fp32, one size and a stream",
        ),
        Suite(
            "host",
            "The host path and workers",
            "Host cost per input",
            "host cost per input stage by stage vs a revision and HF; workers",
        ),
        Suite(
            "encode",
            "The host path and workers",
            "The encode loop vs a revision",
            "`encode` of 1,000 small JPEGs through the host-bound tower: the tree vs a revision, outputs compared",
        ),
        Suite(
            "dataset",
            "Datasets",
            "A parquet dataset",
            "parquet JPEGs through `encode --workers 2` and Ray Data; RSS; --cache",
        ),
        Suite(
            "plan",
            "Host plans vs HF",
            "The five seed cases",
            "host plans (numba) vs HF's index work, the five seed cases",
        ),
        Suite(
            "cost",
            "Compile and padding cost",
            "Matmul FLOPs compiled vs ideal",
            "cost_report: compiled vs ideal matmul FLOPs, temp memory",
        ),
        Suite(
            "compile",
            "Compile and padding cost",
            "Compiles over a stream of sizes",
            "XLA compiles and padding over a stream of single-image sizes",
        ),
        Suite(
            "aot",
            "Deviceless accelerators",
            "Compiled for each target",
            "deviceless compiles for GPU / TPU targets: memory, FLOPs, roofline",
        ),
        Suite(
            "finetune",
            "Fine-tuning",
            "One Adam step on the 3B tower",
            "one Adam step, full vs LoRA, remat, fp32 / bf16: memory, time",
        ),
        Suite(
            "load", "Fine-tuning", "Loading the 3B tower", "the 3B tower loaded from the HF folder vs the converted one"
        ),
        Suite(
            "video",
            "Video",
            "Decode + sample + preprocess a clip",
            "a clip decoded, sampled and preprocessed: ours vs HF's processor",
        ),
        Suite(
            "long_video",
            "Video",
            "Long videos: encode's memory, the service's other clients",
            "`encode` of 1-10 minute clips: peak RSS, frames/s; an image beside a long video in `serve`",
        ),
        Suite(
            "positions",
            "Positions and splice vs HF",
            "Six requests",
            "`lm_inputs` vs HF's get_rope_index + placeholder masks",
        ),
        Suite(
            "vllm_store",
            "vLLM reading our embeddings",
            "Time to first token: vLLM's tower vs our store",
            "vLLM's time to first token with its own tower vs reading our encoder-cache store",
        ),
        Suite(
            "serve",
            "Service",
            "Under load, faults and bad input",
            "`serve` under load: throughput, latency, cache, overload, fuzz, kill",
        ),
        Suite(
            "batch_plans",
            "Service",
            "Batch plans, compute only",
            "one batch plan vs one ladder plan vs a call per image",
        ),
        Suite(
            "serve_cold", "Service", "Cold vs warm servers", "a cold server vs one warmed before ready, and its restart"
        ),
        Suite("hostile", "Service", "Hostile clients", "idle / slow sockets and a 49 MP image against `serve`"),
        Suite(
            "faults", "Encode under faults", "Stops and saves", "what each kind of stop and a checkpoint cost `encode`"
        ),
        Suite(
            "device",
            "On an accelerator",
            "HF vs ours on the device",
            "on a GPU / TPU: HF (sdpa, fa2) vs ours (XLA, kernel)",
        ),
    )
}
