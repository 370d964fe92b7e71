"""The service on Ray Serve: `qvj.serve.app` deployed on a local Ray whose HTTP proxy listens on
127.0.0.1 answers what `encode_images` gives, through the same routes as `qwen-vit-jax serve`; the
application's options (replicas, resources, autoscaling) and `build`'s strings."""

from __future__ import annotations

import numpy as np
import pytest

import qwen_vit_jax as qvj
from benchmarks.workloads import traffic as st
from qwen_vit_jax.data.inputs import load_image
from qwen_vit_jax.serve.ray_app import deployment_options, parse_args

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'qwen_vit_jax[ray]')")


def test_deployment_options(tiny_dirs):
    s = qvj.serve.Settings(checkpoint=str(tiny_dirs[1]), max_queue=64)
    o = deployment_options(s, num_gpus=0)
    assert o["name"] == "qwen_vit_jax"
    assert o["ray_actor_options"] == {"num_gpus": 0, "num_cpus": 1}
    assert o["max_replicas_per_node"] == 1  # CPU replicas: one per node
    auto = o["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 1, 16)
    assert o["max_ongoing_requests"] > 64 and o["max_queued_requests"] == 64  # the replica's 429 comes first
    o = deployment_options(s, num_gpus=1, max_replicas=4, target_ongoing_requests=3)
    assert o["ray_actor_options"]["num_gpus"] == 1 and "max_replicas_per_node" not in o
    assert (o["autoscaling_config"]["max_replicas"], o["autoscaling_config"]["target_ongoing_requests"]) == (4, 3)
    o = deployment_options(s, ray_actor_options={"resources": {"TPU": 4}})
    assert o["ray_actor_options"] == {"resources": {"TPU": 4}}
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        deployment_options(s, num_gpus=0, min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        deployment_options(s, num_gpus=-1)


def test_app_checks_its_arguments(tiny_dirs):
    from ray.serve import Application

    assert isinstance(qvj.serve.app(str(tiny_dirs[1]), max_queue=64, num_gpus=0), Application)
    with pytest.raises(ValueError, match="port= does not apply on Ray Serve"):
        qvj.serve.app(str(tiny_dirs[1]), port=8001)
    with pytest.raises(ValueError, match="max_queue must be a positive int"):
        qvj.serve.app(str(tiny_dirs[1]), max_queue=0)


def test_serve_run_strings():
    kw = parse_args({"checkpoint": "ck", "max_queue": "32", "max_wait_ms": "2.5", "declare": "4x4,2x4x6"})
    assert kw == {"checkpoint": "ck", "max_queue": 32, "max_wait_ms": 2.5, "declare": ((1, 4, 4), (2, 4, 6))}
    kw = parse_args({"checkpoint": "ck", "cache": "none", "max_batch_patches": "4096", "num_gpus": "0.5"})
    assert kw == {"checkpoint": "ck", "cache": None, "max_batch_patches": 4096, "num_gpus": 0.5}
    with pytest.raises(ValueError, match="unknown argument 'colour'"):
        parse_args({"checkpoint": "ck", "colour": "red"})
    with pytest.raises(ValueError, match="max_queue='many': not an int"):
        parse_args({"checkpoint": "ck", "max_queue": "many"})
    with pytest.raises(ValueError, match="needs checkpoint="):
        parse_args({"max_queue": "3"})


def test_ray_serve_answers_like_encode_images(tiny_dirs, ray_local, request):
    import httpx
    from ray import serve

    blobs = [st.jpeg(56, 84, seed=1), st.jpeg(84, 56, seed=2)]
    port = st.free_port()
    try:
        serve.start(http_options={"host": st.HOST, "port": port})
        serve.run(qvj.serve.app(str(tiny_dirs[1]), workers=0, num_gpus=0), name="qvj", route_prefix="/")
        url = f"http://{st.HOST}:{port}"
        assert httpx.get(url + "/readyz", timeout=60).status_code == 200  # ready before Ray routes to it
        r = httpx.post(url + st.ROUTE, content=st.body(blobs), timeout=120)
        assert r.status_code == 200, r.text
        again = httpx.post(url + st.ROUTE, content=st.body(blobs[:1]), timeout=60)
        assert again.json()["data"][0]["cached"]
        assert st.metrics(url)["qvj_requests_total{status=200}"] == 2
        assert httpx.post(url + st.ROUTE, content=b"{", timeout=60).status_code == 400
    finally:
        serve.shutdown()  # the session's Ray stays for the other tests
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1]
    refs = request.getfixturevalue("tiny_encoder").encode_images([load_image(b) for b in blobs])
    for d, ref in zip(data, refs):
        emb = np.asarray(d["embedding"], np.float32)
        assert emb.shape == ref.shape
        assert np.linalg.norm(emb - ref) <= 1e-6 * np.linalg.norm(ref)  # the padding bar (docs/serve.md)
        assert d["cached"] is False
