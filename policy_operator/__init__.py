"""policy-operator: serve flow-matching robot action policies on multi-GPU Kubernetes pods."""

__version__ = "0.1.0"
