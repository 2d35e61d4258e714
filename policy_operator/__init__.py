"""policy-operator: serve flow-matching robot action policies on multi-GPU Kubernetes pods."""

from importlib.metadata import version

# pyproject.toml's version, as installed (both images pip-install the package); tests/test_version.py holds the
# chart's appVersion and every image tag in examples/ and docs/ to it.
__version__ = version("policy-operator")
