"""A PolicyServer's spec as typed, validated dataclasses.

The CRD's openAPIV3Schema and CEL rules reject bad specs at admission, but an
API server without CEL (or the test emulator, which checks nothing) would let
them through, and defaults are only applied by a real API server.  So the
operator parses every spec again here, with the same defaults as the CRD and
the same ``ParallelLayout`` as the runtime, and refuses anything it could not
run *before* creating a single object.  ``tests/test_crd.py`` checks that the
defaults and verdicts here agree with the CRD's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policy_operator.constants import CACHE_MOUNT_PATH, DEFAULT_PORT, GPU_RESOURCE, SECRET_TOKEN_KEY
from policy_operator.layout import LayoutError, ParallelLayout
from policy_operator.serve_flags import DEFAULT_GUIDANCE, DEFAULT_STEPS, MANAGED_FLAGS
from policy_operator.sources import InvalidSource, check_relpath, request_key
from policy_operator.sources import check_source as check_source_scheme

# Limits that keep every derived child name valid: the fetch Job is
# ``<name>-fetch-<16-hex key>`` and must fit a 63-character label value.
MAX_NAME_LENGTH = 40
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
ACCESS_MODES = ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DEVICES = ("cuda", "cpu")
MAX_DRAIN_GRACE_S = 25  # torchrun SIGKILLs its ranks 30 s after SIGTERM; leave a margin
MIN_STARTUP_TIMEOUT_S = 30

# Defaults, mirrored by the CRD's `default:` values (tests/test_crd.py compares them).
DEFAULT_REPLICAS = 1
DEFAULT_STORAGE_SIZE = "20Gi"
DEFAULT_SHM_SIZE = "2Gi"
DEFAULT_DRAIN_GRACE_S = 20
DEFAULT_STARTUP_TIMEOUT_S = 600
DEFAULT_BACKOFF_LIMIT = 3
DEFAULT_TTL_AFTER_FINISHED_S = 3600

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class SpecError(ValueError):
    """A spec the operator will not run; ``str()`` names the field and the fix."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str = SECRET_TOKEN_KEY


@dataclass(frozen=True)
class FetchJobSpec:
    backoff_limit: int = DEFAULT_BACKOFF_LIMIT
    ttl_seconds_after_finished: int = DEFAULT_TTL_AFTER_FINISHED_S
    active_deadline_seconds: int | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class CheckpointSpec:
    source: str
    revision: str | None = None
    secret_ref: SecretRef | None = None
    sha256: tuple[tuple[str, str], ...] = ()  # sorted (file, hash) pairs
    fetch_job: FetchJobSpec = field(default_factory=FetchJobSpec)

    @property
    def key(self) -> str:
        """Cache directory and Job-name suffix; computed exactly as ``policyserver fetch`` does."""
        return request_key(self.source, self.revision)

    @property
    def path(self) -> str:
        return f"{CACHE_MOUNT_PATH}/{self.key}"

    @property
    def is_hf(self) -> bool:
        return self.source.startswith("hf://")


@dataclass(frozen=True)
class ResourcesSpec:
    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)
    shm_size: str = DEFAULT_SHM_SIZE


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None
    service_account_name: str | None = None


@dataclass(frozen=True)
class StorageSpec:
    size: str = DEFAULT_STORAGE_SIZE
    storage_class_name: str | None = None
    access_modes: tuple[str, ...] = ()  # empty: derived from replicas (see access_modes_for)
    existing_claim: str | None = None
    retain_on_delete: bool = False

    def access_modes_for(self, replicas: int) -> tuple[str, ...]:
        """RWX when several pods (on different nodes) must mount the one cache, unless told otherwise."""
        if self.access_modes:
            return self.access_modes
        return ("ReadWriteMany",) if replicas > 1 else ("ReadWriteOnce",)


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = DEFAULT_PORT
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeSpec:
    guidance: float = DEFAULT_GUIDANCE
    steps: int = DEFAULT_STEPS
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    drain_grace_seconds: int = DEFAULT_DRAIN_GRACE_S
    startup_timeout_seconds: int = DEFAULT_STARTUP_TIMEOUT_S
    device: str = "cuda"


@dataclass(frozen=True)
class AuthSpec:
    secret_ref: SecretRef | None = None


@dataclass(frozen=True)
class PolicyServerSpec:
    name: str
    namespace: str
    image: str
    checkpoint: CheckpointSpec
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    replicas: int = DEFAULT_REPLICAS
    image_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    service: ServiceSpec = field(default_factory=ServiceSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    auth: AuthSpec = field(default_factory=AuthSpec)

    @property
    def gpus_per_pod(self) -> int:
        """One GPU per rank: cfgp x dp, none on the CPU device."""
        return self.layout.world_size if self.runtime.device == "cuda" else 0


# --- parsing helpers ------------------------------------------------------------------

def _obj(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, got {type(value).__name__}")
    return value


def _known(value: Mapping[str, Any], path: str, allowed: Sequence[str]) -> None:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise SpecError(path, f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def _str(value: Any, path: str, *, required: bool = False, default: str | None = None) -> str | None:
    if value is None:
        if required:
            raise SpecError(path, "is required")
        return default
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {value!r}")
    if required and not value.strip():
        raise SpecError(path, "must not be empty")
    return value


def _int(value: Any, path: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SpecError(path, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(path, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"must be <= {maximum}, got {value}")
    return value


def _enum(value: Any, path: str, allowed: Sequence[str], default: str | None) -> str | None:
    value = _str(value, path, default=default)
    if value is not None and value not in allowed:
        raise SpecError(path, f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _quantity(value: Any, path: str, default: str | None = None) -> str | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise SpecError(path, f"must be a quantity such as 20Gi, got {value!r}")
    text = str(value)
    if not _QUANTITY.match(text):
        raise SpecError(path, f"{text!r} is not a Kubernetes quantity (e.g. 500m, 4Gi, 2)")
    return text


def _str_map(value: Any, path: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for k, v in _obj(value, path).items():
        if not isinstance(v, str):
            raise SpecError(f"{path}.{k}", f"must be a string, got {v!r}")
        result[str(k)] = v
    return result


def _quantity_map(value: Any, path: str) -> dict[str, str]:
    return {str(k): _quantity(v, f"{path}.{k}") or "" for k, v in _obj(value, path).items()}


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(path, f"must be a list, got {type(value).__name__}")
    return value


def _env(value: Any, path: str) -> tuple[Mapping[str, Any], ...]:
    items = []
    for i, item in enumerate(_list(value, path)):
        item = _obj(item, f"{path}[{i}]")
        name = _str(item.get("name"), f"{path}[{i}].name", required=True)
        assert name is not None
        if not _ENV_NAME.match(name):
            raise SpecError(f"{path}[{i}].name", f"{name!r} is not a valid environment variable name")
        if "value" in item and "valueFrom" in item:
            raise SpecError(f"{path}[{i}]", "set value or valueFrom, not both")
        items.append(dict(item))
    return tuple(items)


def _secret_ref(value: Any, path: str) -> SecretRef | None:
    if value is None:
        return None
    value = _obj(value, path)
    _known(value, path, ("name", "key"))
    name = _str(value.get("name"), f"{path}.name", required=True)
    assert name is not None
    if not _DNS1123_SUBDOMAIN.match(name):
        raise SpecError(f"{path}.name", f"{name!r} is not a valid Secret name")
    key = _str(value.get("key"), f"{path}.key", default=SECRET_TOKEN_KEY)
    assert key is not None
    return SecretRef(name=name, key=key)


def check_source(source: str, path: str = "spec.checkpoint.source") -> None:
    try:
        check_source_scheme(source)
    except InvalidSource as exc:
        raise SpecError(path, str(exc)) from None


def check_name(name: str) -> None:
    if len(name) > MAX_NAME_LENGTH or not _DNS1035.match(name):
        raise SpecError("metadata.name", f"{name!r} must be a DNS-1035 label (lower-case letters, digits, '-', "
                                         f"starting with a letter) of at most {MAX_NAME_LENGTH} characters, so every "
                                         f"child object's name stays valid")


# --- sections -------------------------------------------------------------------------

def _checkpoint(value: Any) -> CheckpointSpec:
    path = "spec.checkpoint"
    if value is None:
        raise SpecError(path, "is required")
    value = _obj(value, path)
    _known(value, path, ("source", "revision", "secretRef", "sha256", "fetchJob"))
    source = _str(value.get("source"), f"{path}.source", required=True)
    assert source is not None
    check_source(source)
    revision = _str(value.get("revision"), f"{path}.revision")
    if revision is not None and not revision.strip():
        raise SpecError(f"{path}.revision", "must not be empty when set")
    sha = []
    for file, digest in _str_map(value.get("sha256"), f"{path}.sha256").items():
        try:
            check_relpath(file)
        except InvalidSource as exc:
            raise SpecError(f"{path}.sha256", f"must name files inside the checkpoint: {exc}") from None
        if not _SHA256.match(digest):
            raise SpecError(f"{path}.sha256.{file}", f"{digest!r} is not a 64-hex-digit sha256")
        sha.append((file, digest.lower()))
    job = _obj(value.get("fetchJob"), f"{path}.fetchJob")
    _known(job, f"{path}.fetchJob", ("backoffLimit", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                                     "resources", "env"))
    deadline = job.get("activeDeadlineSeconds")
    fetch_job = FetchJobSpec(
        backoff_limit=_int(job.get("backoffLimit"), f"{path}.fetchJob.backoffLimit", DEFAULT_BACKOFF_LIMIT,
                           minimum=0, maximum=20),
        ttl_seconds_after_finished=_int(job.get("ttlSecondsAfterFinished"), f"{path}.fetchJob.ttlSecondsAfterFinished",
                                        DEFAULT_TTL_AFTER_FINISHED_S, minimum=0),
        active_deadline_seconds=None if deadline is None else _int(
            deadline, f"{path}.fetchJob.activeDeadlineSeconds", 0, minimum=1),
        resources=_resource_requirements(job.get("resources"), f"{path}.fetchJob.resources"),
        env=_env(job.get("env"), f"{path}.fetchJob.env"),
    )
    spec = CheckpointSpec(source=source, revision=revision, secret_ref=_secret_ref(value.get("secretRef"),
                          f"{path}.secretRef"), sha256=tuple(sorted(sha)), fetch_job=fetch_job)
    try:
        spec.key  # noqa: B018 - an hf://repo@rev that conflicts with revision is refused here
    except InvalidSource as exc:
        raise SpecError(f"{path}.source", str(exc)) from None
    return spec


def _resource_requirements(value: Any, path: str) -> dict[str, dict[str, str]]:
    value = _obj(value, path)
    _known(value, path, ("requests", "limits"))
    return {k: _quantity_map(value.get(k), f"{path}.{k}") for k in ("requests", "limits") if value.get(k)}


def _resources(value: Any) -> ResourcesSpec:
    path = "spec.resources"
    value = _obj(value, path)
    _known(value, path, ("requests", "limits", "shmSize"))
    requests = _quantity_map(value.get("requests"), f"{path}.requests")
    limits = _quantity_map(value.get("limits"), f"{path}.limits")
    for section, values in (("requests", requests), ("limits", limits)):
        if GPU_RESOURCE in values:
            raise SpecError(f"{path}.{section}", f"must not set {GPU_RESOURCE}: the operator requests "
                                                 f"cfgp x dp GPUs per pod itself")
    shm = _quantity(value.get("shmSize"), f"{path}.shmSize", DEFAULT_SHM_SIZE)
    assert shm is not None
    return ResourcesSpec(requests=requests, limits=limits, shm_size=shm)


def _storage(value: Any) -> StorageSpec:
    path = "spec.storage"
    value = _obj(value, path)
    _known(value, path, ("size", "storageClassName", "accessModes", "existingClaim", "retainOnDelete"))
    modes = tuple(_enum(m, f"{path}.accessModes[{i}]", ACCESS_MODES, None) or ""
                  for i, m in enumerate(_list(value.get("accessModes"), f"{path}.accessModes")))
    claim = _str(value.get("existingClaim"), f"{path}.existingClaim")
    if claim is not None and not _DNS1123_SUBDOMAIN.match(claim):
        raise SpecError(f"{path}.existingClaim", f"{claim!r} is not a valid PersistentVolumeClaim name")
    retain = value.get("retainOnDelete", False)
    if not isinstance(retain, bool):
        raise SpecError(f"{path}.retainOnDelete", f"must be true or false, got {retain!r}")
    size = _quantity(value.get("size"), f"{path}.size", DEFAULT_STORAGE_SIZE)
    assert size is not None
    storage_class = _str(value.get("storageClassName"), f"{path}.storageClassName")
    if claim is not None and storage_class is not None:
        raise SpecError(path, "storageClassName has no effect with existingClaim; set one of them")
    return StorageSpec(size=size, storage_class_name=storage_class,
                       access_modes=modes, existing_claim=claim, retain_on_delete=retain)


def _service(value: Any) -> ServiceSpec:
    path = "spec.service"
    value = _obj(value, path)
    _known(value, path, ("type", "port", "annotations"))
    return ServiceSpec(
        type=_enum(value.get("type"), f"{path}.type", SERVICE_TYPES, "ClusterIP") or "ClusterIP",
        port=_int(value.get("port"), f"{path}.port", DEFAULT_PORT, minimum=1, maximum=65535),
        annotations=_str_map(value.get("annotations"), f"{path}.annotations"),
    )


def _runtime(value: Any) -> RuntimeSpec:
    path = "spec.runtime"
    value = _obj(value, path)
    _known(value, path, ("guidance", "steps", "extraArgs", "env", "drainGraceSeconds", "startupTimeoutSeconds",
                         "device"))
    guidance = value.get("guidance", DEFAULT_GUIDANCE)
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) \
            or guidance < 0:
        raise SpecError(f"{path}.guidance", f"must be a finite number >= 0, got {guidance!r}")
    extra = []
    for i, arg in enumerate(_list(value.get("extraArgs"), f"{path}.extraArgs")):
        if not isinstance(arg, str):
            raise SpecError(f"{path}.extraArgs[{i}]", f"must be a string, got {arg!r}")
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise SpecError(f"{path}.extraArgs[{i}]", f"{flag} is set by the operator from the spec; "
                                                      f"change the corresponding field instead")
        extra.append(arg)
    return RuntimeSpec(
        guidance=float(guidance),
        steps=_int(value.get("steps"), f"{path}.steps", DEFAULT_STEPS, minimum=1, maximum=1000),
        extra_args=tuple(extra),
        env=_env(value.get("env"), f"{path}.env"),
        drain_grace_seconds=_int(value.get("drainGraceSeconds"), f"{path}.drainGraceSeconds", DEFAULT_DRAIN_GRACE_S,
                                 minimum=0, maximum=MAX_DRAIN_GRACE_S),
        startup_timeout_seconds=_int(value.get("startupTimeoutSeconds"), f"{path}.startupTimeoutSeconds",
                                     DEFAULT_STARTUP_TIMEOUT_S, minimum=MIN_STARTUP_TIMEOUT_S),
        device=_enum(value.get("device"), f"{path}.device", DEVICES, "cuda") or "cuda",
    )


def _layout(value: Any, guidance: float) -> ParallelLayout:
    path = "spec.parallelism"
    value = _obj(value, path)
    _known(value, path, ("cfgp", "dp"))
    try:
        layout = ParallelLayout(cfgp=value.get("cfgp", 1), dp=value.get("dp", 1))
        layout.check_guidance(guidance)
    except LayoutError as exc:
        raise SpecError(path, str(exc)) from None
    return layout


def _scheduling(spec: Mapping[str, Any]) -> SchedulingSpec:
    tolerations = []
    for i, t in enumerate(_list(spec.get("tolerations"), "spec.tolerations")):
        tolerations.append(dict(_obj(t, f"spec.tolerations[{i}]")))
    return SchedulingSpec(
        node_selector=_str_map(spec.get("nodeSelector"), "spec.nodeSelector"),
        tolerations=tuple(tolerations),
        affinity=dict(_obj(spec.get("affinity"), "spec.affinity")),
        priority_class_name=_str(spec.get("priorityClassName"), "spec.priorityClassName"),
        service_account_name=_str(spec.get("serviceAccountName"), "spec.serviceAccountName"),
    )


TOP_LEVEL_FIELDS = (
    "checkpoint", "parallelism", "replicas", "image", "imagePullPolicy", "imagePullSecrets", "resources",
    "nodeSelector", "tolerations", "affinity", "priorityClassName", "serviceAccountName", "storage", "service",
    "runtime", "auth",
)


def parse_spec(spec: Mapping[str, Any] | None, *, name: str, namespace: str) -> PolicyServerSpec:
    """The typed spec of one PolicyServer, or a ``SpecError`` naming the first bad field."""
    check_name(name)
    spec = _obj(spec, "spec")
    _known(spec, "spec", TOP_LEVEL_FIELDS)
    runtime = _runtime(spec.get("runtime"))
    layout = _layout(spec.get("parallelism"), runtime.guidance)
    image = _str(spec.get("image"), "spec.image", required=True)
    assert image is not None
    pull_secrets = []
    for i, ref in enumerate(_list(spec.get("imagePullSecrets"), "spec.imagePullSecrets")):
        ref_name = _str(_obj(ref, f"spec.imagePullSecrets[{i}]").get("name"), f"spec.imagePullSecrets[{i}].name",
                        required=True)
        pull_secrets.append(ref_name or "")
    auth = _obj(spec.get("auth"), "spec.auth")
    _known(auth, "spec.auth", ("secretRef",))
    return PolicyServerSpec(
        name=name,
        namespace=namespace,
        image=image,
        checkpoint=_checkpoint(spec.get("checkpoint")),
        layout=layout,
        replicas=_int(spec.get("replicas"), "spec.replicas", DEFAULT_REPLICAS, minimum=0),
        image_pull_policy=_enum(spec.get("imagePullPolicy"), "spec.imagePullPolicy", PULL_POLICIES, None),
        image_pull_secrets=tuple(pull_secrets),
        resources=_resources(spec.get("resources")),
        scheduling=_scheduling(spec),
        storage=_storage(spec.get("storage")),
        service=_service(spec.get("service")),
        runtime=runtime,
        auth=AuthSpec(secret_ref=_secret_ref(auth.get("secretRef"), "spec.auth.secretRef")),
    )
