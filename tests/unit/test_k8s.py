"""Tier 1: the KubeRay manifests, committed and rendered, validated strictly against the
KubeRay CRDs' openAPIV3Schema (shared/kuberay-crds, KubeRay v1.7): unknown fields are refused,
as kubeconform's openapi2jsonschema does, by closing every object schema that lists properties
and does not preserve unknown fields."""

import copy
import functools
import os

import jsonschema
import pytest
import yaml

from rayeval.errors import SpecError
from rayeval.integrations.k8s import render
from support import rayeval_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "configs", "digits", "sweep_s3.yaml")


def crd_folder() -> str:
    folder = os.environ.get("KUBERAY_CRDS") or os.path.join(REPO, "..", "shared", "kuberay-crds")
    if not os.path.isdir(folder):
        message = (f"the KubeRay CRDs are not at {folder}; set KUBERAY_CRDS to a folder with "
                   "ray.io_rayjobs.yaml and ray.io_rayclusters.yaml")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return folder


def strict(schema):
    """A copy where objects with properties (and no preserve-unknown-fields) refuse others."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if ("properties" in node and not node.get("x-kubernetes-preserve-unknown-fields")
                    and "additionalProperties" not in node):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@functools.lru_cache(maxsize=None)
def validator(kind: str):
    name = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}[kind]
    with open(os.path.join(crd_folder(), name), encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft202012Validator(strict(version["schema"]["openAPIV3Schema"]))


def check(doc: dict) -> None:
    if doc["kind"] == "Service":      # k8s/service.yaml's: the service's port, by its pod label
        assert doc["apiVersion"] == "v1" and set(doc) == {"apiVersion", "kind", "metadata",
                                                         "spec"}
        assert set(doc["spec"]) == {"selector", "ports"}
        return
    if doc["kind"] == "ConfigMap":
        assert doc["apiVersion"] == "v1" and set(doc) <= {"apiVersion", "kind", "metadata",
                                                         "data"}
        assert all(isinstance(v, str) for v in doc["data"].values())
        return
    assert doc["apiVersion"] == "ray.io/v1"
    errors = sorted(validator(doc["kind"]).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_strict_schema_refuses_a_misspelled_field():
    doc = yaml.safe_load(open(os.path.join(REPO, "k8s", "raycluster.yaml")))
    check(doc)
    doc["spec"]["headGroupSpec"]["rayStartParms"] = {}
    with pytest.raises(AssertionError, match="rayStartParms"):
        check(doc)
    doc = yaml.safe_load(open(os.path.join(REPO, "k8s", "raycluster.yaml")))
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(AssertionError, match="replicas"):
        check(doc)


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml", "service.yaml"])
def test_committed_manifests_are_valid(name):
    docs = [d for d in yaml.safe_load_all(open(os.path.join(REPO, "k8s", name))) if d]
    assert docs
    for doc in docs:
        check(doc)


def test_committed_rayjob_is_the_render_of_the_example():
    rendered = render(EXAMPLE, image="rayeval:0.1.0", workers=2, gpus_per_worker=1)
    committed = open(os.path.join(REPO, "k8s", "rayjob.yaml")).read()
    body = "".join(ln for ln in committed.splitlines(keepends=True) if not ln.startswith("#"))
    assert body == rendered, ("k8s/rayjob.yaml is out of date: rayeval k8s render "
                              "configs/digits/sweep_s3.yaml --image rayeval:0.1.0 --workers 2 "
                              "--gpus-per-worker 1")


def test_rendered_rayjob_runs_the_sweep_on_gpu_workers():
    configmap, job = yaml.safe_load_all(render(EXAMPLE, image="reg/rayeval:1", workers=3,
                                               gpus_per_worker=2, namespace="ml"))
    check(configmap)
    check(job)
    spec = job["spec"]
    assert spec["entrypoint"] == "rayeval run /etc/rayeval/sweep.yaml --address auto --workers 6"
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == 3
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2"
    assert set(configmap["data"]) == {"sweep.yaml", "my_models.py", "my_metrics.py"}
    assert job["metadata"]["namespace"] == "ml"
    for pod in (cluster["headGroupSpec"], group):
        mounts = pod["template"]["spec"]["containers"][0]["volumeMounts"]
        assert mounts[0]["mountPath"] == "/etc/rayeval"


def test_render_refuses_what_pods_cannot_reach(tmp_path):
    text = open(EXAMPLE).read()
    (tmp_path / "my_models.py").write_text("")
    cases = {
        "output: s3://rayeval-example/evals": ("output: out", "output: 'out' is a local folder"),
        "path: s3://rayeval-example/digits/eval.parquet": (
            "path: data.parquet", "dataset.path: 'data.parquet' is a local path"),
    }
    for old, (new, message) in cases.items():
        (tmp_path / "sweep.yaml").write_text(text.replace(old, new))
        (tmp_path / "data.parquet").write_text("")
        with pytest.raises(SpecError, match=message):
            render(str(tmp_path / "sweep.yaml"), image="x")
    (tmp_path / "sweep.yaml").write_text(text)
    with pytest.raises(SpecError, match="use_gpu is true but --gpus-per-worker is 0"):
        render(str(tmp_path / "sweep.yaml"), image="x", gpus_per_worker=0)


def test_render_through_the_cli(tmp_path):
    proc = rayeval_main("k8s", "render", EXAMPLE, "--image", "reg/rayeval:2", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayJob"]
    for d in docs:
        check(d)
    bad = rayeval_main("k8s", "render", os.path.join(REPO, "configs", "digits", "sweep.yaml"),
                       "--image", "x")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in \
        bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_service_manifest_serves_on_the_head_and_selects_its_pod():
    """k8s/service.yaml: the head pod's rayeval-serve container runs `rayeval serve` on the
    head's Ray with its token from a Secret, and the Service's selector is that pod's label
    and port (a Service that selects nothing would be valid and useless)."""
    cluster, service = [d for d in yaml.safe_load_all(open(os.path.join(REPO, "k8s",
                                                                         "service.yaml"))) if d]
    pod = cluster["spec"]["headGroupSpec"]["template"]
    (serve,) = [c for c in pod["spec"]["containers"] if c["name"] == "rayeval-serve"]
    command = " ".join(serve["args"])
    assert "rayeval serve --address 127.0.0.1:6379" in command and "--port 8000" in command
    assert "--host 0.0.0.0" in command
    assert {e["name"] for e in serve["env"]} >= {"RAYEVAL_SERVICE_TOKEN"}
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == serve["ports"][0]["containerPort"]
    from rayeval.ui.cli import parse

    args = parse(command.split("exec rayeval ", 1)[1].split())
    assert (args.command, args.workers, args.use_gpu, args.port) == ("serve", 2, True, 8000)
