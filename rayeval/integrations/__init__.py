"""rayeval inside other systems: Ray Train validation, Ray Jobs, KubeRay, watching a training run."""
