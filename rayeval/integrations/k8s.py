"""``rayeval k8s render``: a KubeRay RayJob (and the ConfigMap that carries the sweep) for a sweep.

The sweep file and the Python modules next to it (model factory, custom metrics) go into a
ConfigMap mounted at ``/etc/rayeval`` on the head and on every worker, so the factory is found
the same way as on a laptop. Data and checkpoints must be where pods can read them (``s3://``,
``gs://``, or an absolute path on a volume the image or the pods provide), and so must the
result store.
"""

from __future__ import annotations

import os
import re

import yaml

from rayeval.errors import SpecError
from rayeval.plan.loader import is_relative_local, load_sweep, written_locations

MOUNT = "/etc/rayeval"
CONFIGMAP_LIMIT = 900 * 1024      # a ConfigMap holds at most 1 MiB, metadata included


def _name(text: str) -> str:
    """A DNS-1123 name from a sweep name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (name or "sweep")[:40].rstrip("-")


def _check_portable(sweep_path: str, raw: dict) -> None:
    for key, value in written_locations(raw):
        if not is_relative_local(value):
            continue
        if key == "output":
            raise SpecError(f"{sweep_path}: output: {value!r} is a local folder; pods cannot "
                            "write back to this machine: use s3://bucket/prefix (or an absolute "
                            "path on a volume the pods mount)")
        raise SpecError(f"{sweep_path}: {key}: {value!r} is a local path; pods cannot read "
                        "this machine's files: use s3://... (or an absolute path in the image "
                        "or on a mounted volume)")


def render(sweep_path: str, *, image: str, workers: int = 1, gpus_per_worker: int = 1,
           cpus_per_worker: int = 8, memory_per_worker: str = "32Gi", namespace: str | None = None,
           ttl_seconds: int = 3600) -> str:
    """The manifests (a YAML stream: ConfigMap, RayJob) for running the sweep on KubeRay."""
    if workers < 1:
        raise SpecError(f"--workers: must be at least 1, got {workers}")
    if gpus_per_worker < 0 or cpus_per_worker < 1:
        raise SpecError("--gpus-per-worker must be 0 or more and --cpus-per-worker 1 or more")
    sweep = load_sweep(sweep_path)
    with open(sweep_path, encoding="utf-8") as f:
        text = f.read()
    raw = yaml.safe_load(text) or {}
    _check_portable(sweep_path, raw)
    if sweep.use_gpu and gpus_per_worker == 0:
        raise SpecError(f"{sweep_path}: use_gpu is true but --gpus-per-worker is 0; give the "
                        "worker pods GPUs or set use_gpu: false")
    if not sweep.use_gpu and gpus_per_worker > 0:
        raise SpecError(f"{sweep_path}: use_gpu is false but --gpus-per-worker is "
                        f"{gpus_per_worker}; set use_gpu: true (or --gpus-per-worker 0)")

    folder = os.path.dirname(os.path.abspath(sweep_path))
    files = {"sweep.yaml": text}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                files[name] = f.read()
    size = sum(len(v.encode()) for v in files.values())
    if size > CONFIGMAP_LIMIT:
        raise SpecError(f"{folder}: the sweep and its Python modules are {size // 1024} KiB, "
                        f"over the {CONFIGMAP_LIMIT // 1024} KiB a ConfigMap can hold; put the "
                        "modules in the image instead")

    name = _name(sweep.name)
    ranks = workers * gpus_per_worker if gpus_per_worker else workers
    meta = {"name": f"rayeval-{name}", "labels": {"app.kubernetes.io/name": "rayeval",
                                                  "rayeval/sweep": name}}
    if namespace:
        meta["namespace"] = namespace
    configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {**meta, "name": f"rayeval-{name}-sweep"}, "data": files}
    volume = {"name": "sweep", "configMap": {"name": f"rayeval-{name}-sweep"}}
    mount = {"name": "sweep", "mountPath": MOUNT, "readOnly": True}
    worker_resources = {"cpu": str(cpus_per_worker), "memory": memory_per_worker}
    if gpus_per_worker:
        worker_resources["nvidia.com/gpu"] = str(gpus_per_worker)
    container = {"image": image, "imagePullPolicy": "IfNotPresent", "volumeMounts": [mount]}
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": meta,
        "spec": {
            "entrypoint": f"rayeval run {MOUNT}/sweep.yaml --address auto --workers {ranks}",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": ttl_seconds,
            "backoffLimit": 0,
            "rayClusterSpec": {
                "authOptions": {"mode": "token"},
                "headGroupSpec": {
                    # The head schedules no work: evaluation runs on the workers.
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {
                        "containers": [{**container, "name": "ray-head",
                                        "ports": [{"containerPort": 6379, "name": "gcs"},
                                                  {"containerPort": 8265, "name": "dashboard"}],
                                        "resources": {"limits": {"cpu": "2", "memory": "8Gi"},
                                                      "requests": {"cpu": "2",
                                                                   "memory": "8Gi"}}}],
                        "volumes": [volume]}},
                },
                "workerGroupSpecs": [{
                    "groupName": "gpu" if gpus_per_worker else "cpu",
                    "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
                    "rayStartParams": {},
                    "template": {"spec": {
                        "containers": [{**container, "name": "ray-worker",
                                        "resources": {"limits": worker_resources,
                                                      "requests": dict(worker_resources)}}],
                        "volumes": [volume]}},
                }],
            },
        },
    }
    return yaml.dump_all([configmap, rayjob], Dumper=_Dumper, sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the files in the ConfigMap) as readable literal blocks; no anchors."""

    def ignore_aliases(self, data):
        return True


def _str(dumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
