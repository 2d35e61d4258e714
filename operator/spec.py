"""A PolicyServer's spec: one typed model that is both the CRD's schema and the operator's parser.

``crds/policyservers.yaml`` and the field table of ``docs/crd.md`` are generated
from these classes (``make crd``; ``operator/crd.py``): every type, default,
bound, pattern and CEL rule below is what kube-apiserver enforces at admission.
The operator parses each spec with the same model before creating anything
(``parse_spec``), because a spec stored before a CRD upgrade was never checked
against today's rules.  Field docstrings are the descriptions ``kubectl
explain`` prints.

Checks the apiserver cannot make are operator-side only, each with its reason
in ``OPERATOR_ONLY_CHECKS`` (also listed in docs/crd.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, Field, PrivateAttr, ValidationError, model_validator

from policy_operator.builtin_policies import (
    BUILTIN_POLICIES,
    LEROBOT,
    LEROBOT_CFG_FAMILIES,
    LEROBOT_FAMILIES,
    REFERENCE,
    builtin,
    check_unconditional,
)
from policy_operator.constants import (
    AUTH_TOKEN_DIR,
    CACHE_MOUNT_PATH,
    CHECKPOINT_TOKEN_DIR,
    COMPILE_CACHE_MOUNT_PATH,
    DEFAULT_PORT,
    ENV_HF_HUB_CACHE,
    ENV_HF_HUB_OFFLINE,
    ENV_HF_TOKEN,
    ENV_HOME,
    ENV_XDG_CACHE_HOME,
    GPU_RESOURCE,
    HUB_VIEW_DIR,
    LABEL_CACHE_CLAIM,
    LABEL_CHECKPOINT_KEY,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_POLICYSERVER,
    SECRET_TOKEN_KEY,
)
from policy_operator.layout import SUPPORTED_CFGP, LayoutError, ParallelLayout
from policy_operator.operator.kube_model import (
    LIST_SET,
    RULE_ERROR,
    Affinity,
    EnvVarSource,
    KubeModel,
    Quantity,
    Rule,
    Toleration,
    TopologySpreadConstraint,
    Volume,
    VolumeMount,
    list_map,
    named_pattern,
)
from policy_operator.serve_flags import (
    COMPILE_FLAG,
    COMPILE_KEY_FLAG,
    COMPILE_MODES,
    COMPILE_OFF,
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_FRONTEND,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_CONNECTIONS,
    FRONTENDS,
    MANAGED_FLAGS,
    MAX_BATCH_WINDOW_MS,
    MAX_FRONTEND_PROCESSES,
    MAX_LATENCY_BUDGET_MS,
    MAX_MAX_BATCH,
    MAX_MAX_CONNECTIONS,
    MAX_RTC_DELAY,
    MAX_SESSION_IDLE_TIMEOUT_S,
    MIN_LATENCY_BUDGET_MS,
    RTC_MODES,
    check_compile_args,
    policy_guidance,
)
from policy_operator.serve_flags import DEFAULT_DRAIN_GRACE_S as RUNTIME_DRAIN_GRACE_S
from policy_operator.source_uri import SOURCE_PATTERN, InvalidSource, check_relpath, check_source, request_key

# Every child name derives from metadata.name: the fetch Job is ``<name>-fetch-<16-hex key>`` and must
# fit a 63-character label value.
MAX_NAME_LENGTH: Final = 40
# A pod runs on one node and gets one GPU per rank; no node sold has more than 16 GPUs, so a larger
# cfgp x dp could never be scheduled and is a typo.
MAX_RANKS_PER_POD: Final = 16
MAX_DRAIN_GRACE_S: Final = 25  # torchrun SIGKILLs its ranks 30 s after SIGTERM; leave a margin
MIN_STARTUP_TIMEOUT_S: Final = 30
MAX_SOURCE_LENGTH: Final = 2048
MAX_REVISION_LENGTH: Final = 256
MAX_SHA256_FILES: Final = 256
MAX_EXTRA_ARGS: Final = 64
MAX_EXTRA_ARG_LENGTH: Final = 1024
MAX_NAME_253: Final = 253  # object names that are DNS-1123 subdomains

DNS1035_LABEL: Final = named_pattern(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", "a DNS-1035 label")
DNS1123_SUBDOMAIN: Final = named_pattern(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", "a DNS-1123 subdomain"
)
SECRET_KEY: Final = named_pattern(r"^[-._a-zA-Z0-9]+$", "a Secret key (letters, digits, '-', '_', '.')")
ENV_NAME: Final = named_pattern(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", "an environment variable name")
SHA256_HEX: Final = named_pattern(r"^[0-9a-fA-F]{64}$", "64 hex digits")
NO_SPACE: Final = named_pattern(r"^\S+$", "no whitespace")
IMPORT_PATH: Final = named_pattern(
    r"^[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$", "an import path pkg.module:Class"
)
MAX_IMPORT_PATH_LENGTH: Final = 256
POLICY_IMPORT: Final = "import"
POLICY_TYPES: Final = (*BUILTIN_POLICIES, POLICY_IMPORT)
# built-in policies trained without a null condition: classifier-free guidance has no branch to run
UNGUIDED_POLICIES: Final = tuple(name for name, p in BUILTIN_POLICIES.items() if not p.has_unconditional)
LEROBOT_TYPES: Final = tuple(LEROBOT_FAMILIES)  # spec.policy.family: the registry's types
# CEL: the policy runs classifier-free guidance (a built-in trained for it, a LeRobot family that is, or an import,
# which its pods check): the spec may then ask for cfgp=2 or a guidance other than 1.0
GUIDED_POLICY_CEL: Final = (
    f"!has(self.policy.type) || !(self.policy.type in {list(UNGUIDED_POLICIES)}) || "
    f"(self.policy.type == '{LEROBOT}' && has(self.policy.family) && self.policy.family in {list(LEROBOT_CFG_FAMILIES)})"
)
UNGUIDED_TEXT: Final = (
    f"policy.type {'/'.join(UNGUIDED_POLICIES)} has no unconditional branch unless policy.family names a LeRobot "
    f"family trained for classifier-free guidance ({', '.join(LEROBOT_CFG_FAMILIES)})"
)

SERVICE_TYPES: Final = ("ClusterIP", "NodePort", "LoadBalancer")
ACCESS_MODES: Final = ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")
PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")
DEVICES: Final = ("cuda", "cpu")
SHARED_ACCESS_MODES: Final = ("ReadOnlyMany", "ReadWriteMany")
STORAGE_MODES: Final = ("shared", "perPod")
# labels the operator sets on every pod it makes; podLabels may not change them (selectors depend on them)
RESERVED_POD_LABELS: Final = (
    LABEL_NAME,
    LABEL_INSTANCE,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_PART_OF,
    LABEL_POLICYSERVER,
    LABEL_CHECKPOINT_KEY,
    LABEL_CACHE_CLAIM,
)
MAX_POD_METADATA: Final = 64
MAX_EXTRA_VOLUMES: Final = 32
# The volume sources spec.volumes may use: none mounts the node's filesystem, a device or a storage system by
# address, so creating a PolicyServer gives a pod nothing a user's own pod spec could not name in the namespace.
ALLOWED_VOLUME_SOURCES: Final = (
    "configMap",
    "secret",
    "emptyDir",
    "persistentVolumeClaim",
    "projected",
    "csi",
    "downwardAPI",
    "ephemeral",
)
# Every other source of core/v1 Volume (Kubernetes 1.37): CEL cannot list an object's keys, so the CRD's rule
# names each one; tests/test_spec_model.py checks that the two lists cover Kubernetes' Volume exactly.
REFUSED_VOLUME_SOURCES: Final = (
    "awsElasticBlockStore",
    "azureDisk",
    "azureFile",
    "cephfs",
    "cinder",
    "fc",
    "flexVolume",
    "flocker",
    "gcePersistentDisk",
    "gitRepo",
    "glusterfs",
    "hostPath",
    "image",
    "iscsi",
    "nfs",
    "photonPersistentDisk",
    "portworxVolume",
    "quobyte",
    "rbd",
    "scaleIO",
    "storageos",
    "vsphereVolume",
)
MAX_SPREAD_CONSTRAINTS: Final = 8
MAX_KEEP_CHECKPOINTS: Final = 10
# the volumes and mount paths of the operator's own pod spec (operator/manifests.py builds them)
TMP_PATH: Final = "/tmp"
SHM_PATH: Final = "/dev/shm"
VOL_CACHE, VOL_TMP, VOL_SHM = "checkpoint-cache", "tmp", "dshm"
VOL_CHECKPOINT_TOKEN, VOL_AUTH_TOKEN, VOL_COMPILE_KEY = "checkpoint-token", "auth-token", "compile-key"
# the PolicyServer's own compile-artifacts key (a Secret the operator creates), read-only in its server pods only
COMPILE_KEY_DIR: Final = "/var/run/secrets/policy-compile"
OPERATOR_VOLUMES: Final = (VOL_CACHE, VOL_TMP, VOL_SHM, VOL_CHECKPOINT_TOKEN, VOL_AUTH_TOKEN, VOL_COMPILE_KEY)
OPERATOR_MOUNT_PATHS: Final = (
    CACHE_MOUNT_PATH,
    TMP_PATH,
    SHM_PATH,
    CHECKPOINT_TOKEN_DIR,
    AUTH_TOKEN_DIR,
    COMPILE_KEY_DIR,
    COMPILE_CACHE_MOUNT_PATH,
)
# the environment the operator sets in every container it makes; a user env entry of the same name would be a
# duplicate key of the container's env list, which server-side apply refuses (500 "duplicate entries")
OPERATOR_ENV: Final = {ENV_HOME: TMP_PATH, ENV_XDG_CACHE_HOME: f"{TMP_PATH}/.cache"}
# Environment names an interpreter, loader or compiler in the pods reads to find code to run, or that point the
# runtime at its cache and hub (issue 39: PYTHONPATH + a downwardAPI file ran the author's code in the server pod;
# HF_HUB_OFFLINE=0 sends it to the hub).  The one list: the CRD's CEL (EnvVar below), the chart's admission policy
# on the operator's ServiceAccount (operator/admission.py) and docs/operator.md ("Threat model") read it from here.
RESERVED_ENV_NAMES: Final = (
    *OPERATOR_ENV,
    "PATH",  # which torchrun / python / cc runs
    ENV_HF_HUB_OFFLINE,
    ENV_HF_HUB_CACHE,
    ENV_HF_TOKEN,
    "HF_HOME",
    "HF_MODULES_CACHE",  # where trust_remote_code modules are imported from
    "HF_TOKEN_PATH",
    "TRANSFORMERS_CACHE",
    "TRANSFORMERS_OFFLINE",
    "BASH_ENV",  # a shell's start-up file
    "ENV",
    "GCONV_PATH",  # glibc loads iconv modules from it
    "LOCPATH",
    "CC",  # Triton and torch's C++ extensions build with these
    "CXX",
    "CUDA_HOME",
    "CUDA_PATH",
    "NCCL_NET_PLUGIN",  # shared libraries NCCL loads
    "NCCL_TUNER_PLUGIN",
    "NCCL_PROFILER_PLUGIN",
    "NCCL_ENV_PLUGIN",
)
# every name starting with one of these: PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, PYTHONBREAKPOINT..., LD_PRELOAD,
# LD_LIBRARY_PATH..., TORCH_*/TORCHINDUCTOR_* (cache and extension directories), TRITON_* (its kernel cache)
RESERVED_ENV_PREFIXES: Final = ("PYTHON", "LD_", "TORCH", "TRITON_")
# Directories of the image the interpreter and the dynamic loader read code or their configuration from: no
# extra volume is mounted at, under or above them (an author's file there is code; /etc/ld.so.preload is read by
# every process).  Checked by the operator (like the operator's own paths) and by the chart's admission policy.
RESERVED_MOUNT_PATHS: Final = (
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr",
    "/opt",
    "/src",
    "/root",
    "/home",
    "/etc/ld.so.preload",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ld.so.cache",
)
# what the server container gets besides OPERATOR_ENV: no hub, and the cache's view of the fetched repositories
SERVER_HUB_ENV: Final = {ENV_HF_HUB_OFFLINE: "1", ENV_HF_HUB_CACHE: f"{CACHE_MOUNT_PATH}/{HUB_VIEW_DIR}"}
MAX_ENV_NAME: Final = 256


def reserved_env(name: str) -> bool:
    """Whether ``name`` is one the pods' interpreters and loaders read (``RESERVED_ENV_NAMES``/``_PREFIXES``)."""
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def reserved_env_cel(name: str) -> str:
    """The CEL of ``reserved_env`` on the string expression ``name``."""
    prefixes = " || ".join(f"{name}.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
    return f"({name} in {list(RESERVED_ENV_NAMES)} || {prefixes})"


RESERVED_ENV_TEXT: Final = (
    f"{', '.join(RESERVED_ENV_NAMES)} and every name starting with {', '.join(RESERVED_ENV_PREFIXES)}"
)
LABEL_VALUE: Final = named_pattern(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$", "a label value")

DEFAULT_REPLICAS: Final = 1
DEFAULT_STORAGE_SIZE: Final = "20Gi"
DEFAULT_SHM_SIZE: Final = "2Gi"
DEFAULT_MAX_GPUS_PER_POD: Final = 8  # the usual GPU node; a larger layout is a typo more often than a 16-GPU node
DEFAULT_KEEP_CHECKPOINTS: Final = 1
# Server requests when resources.requests leaves them out (and no limit implies them): a pod without requests
# is BestEffort, first to be evicted, and the scheduler would pack it onto a node without the memory its
# ranks and its memory-backed /dev/shm need.
DEFAULT_CPU_PER_RANK: Final = "1"
DEFAULT_MEMORY_PER_RANK: Final = "2Gi"
# each front-end process (runtime.frontend): an interpreter with torch imported (~280 MB measured) and its ring,
# decoding and preparing every frame of its connections
DEFAULT_CPU_PER_FRONTEND: Final = "1"
DEFAULT_MEMORY_PER_FRONTEND: Final = "512Mi"
DEFAULT_DRAIN_GRACE_S: Final = int(RUNTIME_DRAIN_GRACE_S)  # the runtime's default, as a whole number of seconds
DEFAULT_STARTUP_TIMEOUT_S: Final = 600
DEFAULT_PROGRESS_DEADLINE_S: Final = 900  # Deployment's default progressDeadlineSeconds, read the same way
DEFAULT_BACKOFF_LIMIT: Final = 3
DEFAULT_TTL_AFTER_FINISHED_S: Final = 3600


def _prefixes(flag: str) -> str:
    """``--cfgp`` -> ``c(f(g(p)?)?)?``: the flag and every abbreviation argparse would accept for it."""
    regex = ""
    for char in reversed(flag.removeprefix("--")):
        char = char if char.isalnum() else f"[{char}]"  # no backslash escapes inside a CEL string
        regex = char + (f"({regex})?" if regex else "")
    return regex


# An extra argument that is a managed flag, an abbreviation of one (argparse expands unique prefixes,
# so "--guid 1" would override --guidance), or either with "=VALUE".
MANAGED_FLAG_PATTERN: Final = f"^--({'|'.join(_prefixes(f) for f in MANAGED_FLAGS)})(=.*)?$"
# ``--compile=MODE`` as one word: a mode torch.compile takes, or none (eager); serve refuses any other only at start.
COMPILE_WORDS: Final = tuple(f"{COMPILE_FLAG}={mode}" for mode in (*COMPILE_MODES, COMPILE_OFF))

OPERATOR_ONLY_CHECKS: Final = {
    "spec.checkpoint.source": "the key of an hf:// source is computed with the fetcher's own request_key, "
    "and the source and sha256 file names are checked with the fetcher's own "
    "check_source/check_relpath (policy_operator/source_uri.py); the CRD's CEL rules "
    "say the same, these are the runtime's definitions",
    "spec.parallelism": "the layout is built with the runtime's own ParallelLayout (cfgp, dp, guidance), so the "
    "operator refuses exactly what a pod would refuse at start",
    "spec.affinity, spec.tolerations[], env[].valueFrom": "core/v1 objects the operator copies into pod specs "
    "unchanged: the CRD embeds Kubernetes' own schema of "
    "them (unknown and mistyped fields are refused at "
    "admission); their cross-field rules are checked when "
    "the operator applies the StatefulSet or Job "
    "(Progressing=False, reason ApplyFailed, with the "
    "apiserver's message)",
    "spec.volumes[].name, spec.volumeMounts[].mountPath": "an extra volume may not reuse a name or mount path the "
    "operator uses (checkpoint-cache, /models, /tmp, "
    "/dev/shm...); Kubernetes' schema of Volume has no "
    "length bound on names, so a CEL rule comparing them "
    "would exceed the apiserver's cost budget",
    "spec.volumeMounts[].mountPath (interpreter paths), spec.volumes[].projected": "no extra volume is mounted "
    "at, under or above a directory the interpreter or the loader reads code from (RESERVED_MOUNT_PATHS: /usr, /opt, "
    "/etc/ld.so.preload...), and no projected source is a serviceAccountToken; the operator refuses both, and the "
    "chart's admission policy on PolicyServers refuses them at admission (operator/admission.py): a CEL rule over "
    "Kubernetes' unbounded Volume and VolumeMount schemas would exceed the CRD's cost budget",
    f"spec.runtime.extraArgs ({COMPILE_FLAG} MODE as two words)": f"a CEL rule sees one word of the list at a "
    f"time: {COMPILE_FLAG}=MODE is checked at admission, a mode in the word after {COMPILE_FLAG} by the operator, "
    "with serve's own flag definition (serve_flags.check_compile_args)",
    "spec.storage.mode": "the mode cannot change on an existing PolicyServer (a StatefulSet's "
    "volumeClaimTemplates are immutable): the operator keeps the pods as they are and reports "
    "StorageReady=False ImmutableChange",
}


class SpecError(ValueError):
    """A spec the operator will not run; ``str()`` names the field (``spec.parallelism.cfgp``) and the fix."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


# --- small shared types --------------------------------------------------------------------

Dns1123Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_253, pattern=DNS1123_SUBDOMAIN)]


class SecretKeySelector(KubeModel):
    """A key of a Secret in the PolicyServer's namespace."""

    name: Dns1123Name
    """Name of a Secret in the PolicyServer's namespace."""
    key: Annotated[str, Field(min_length=1, max_length=MAX_NAME_253, pattern=SECRET_KEY)] = SECRET_TOKEN_KEY
    """Key of the token inside the Secret."""


class LocalObjectReference(KubeModel):
    """An object in the PolicyServer's namespace, by name."""

    name: Dns1123Name
    """Name of a docker-registry Secret in the namespace."""


class EnvVar(KubeModel):
    """One environment variable (core/v1 EnvVar)."""

    cel_rules = (
        Rule("!has(self.value) || !has(self.valueFrom)", "set value or valueFrom, not both", field_path=".valueFrom"),
        Rule(
            f"!(self.name in {list(OPERATOR_ENV)})",
            f"{', '.join(OPERATOR_ENV)} are set by the operator (the root filesystem is read-only; they "
            f"point at the writable {TMP_PATH}) and cannot be set here",
            field_path=".name",
        ),
        Rule(
            f"!{reserved_env_cel('self.name')}",
            f"names the interpreter, loader or runtime reads to find code or its cache are reserved "
            f"({RESERVED_ENV_TEXT}): a PolicyServer's author may not choose what the pods import or load",
            field_path=".name",
            reason="FieldValueForbidden",
        ),
    )

    name: Annotated[str, Field(min_length=1, max_length=MAX_ENV_NAME, pattern=ENV_NAME)]
    """Environment variable name."""
    value: str | None = None
    """Literal value."""
    value_from: EnvVarSource | None = None
    """Source of the value (core/v1 EnvVarSource, e.g. secretKeyRef)."""


# a bound the CEL rules on each name need (the apiserver's cost estimate multiplies by the list's largest size)
MAX_ENV_VARS: Final = 128
EnvList = Annotated[list[EnvVar], Field(max_length=MAX_ENV_VARS, json_schema_extra=list_map("name"))]


class ResourceRequirements(KubeModel):
    """CPU, memory and other resources of one container."""

    requests: dict[str, Quantity] | None = None
    """Minimum resources, e.g. cpu, memory."""
    limits: dict[str, Quantity] | None = None
    """Maximum resources, e.g. memory."""


# --- spec sections ----------------------------------------------------------------------------


class FetchJob(KubeModel):
    """Settings of the fetch Job that downloads the checkpoint into the cache volume."""

    backoff_limit: int = Field(DEFAULT_BACKOFF_LIMIT, ge=0, le=20)
    """Retries of a failed download. Exit codes 2 (usage), 4 (verification), 5 (disk full) and 6 (hub
    repository or revision not found) fail the Job at once through podFailurePolicy, because retrying cannot fix
    them; a pod that was evicted or preempted (DisruptionTarget) is not counted."""
    ttl_seconds_after_finished: int = Field(DEFAULT_TTL_AFTER_FINISHED_S, ge=0)
    """How long a finished Job is kept. A finished download is recorded in status.checkpoint, so it is not
    fetched again after the Job is gone; a failed one is retried once its Job is gone (deleting the Job by hand
    retries at once)."""
    active_deadline_seconds: int | None = Field(None, ge=1)
    """Give up on a download that runs longer than this (reason DeadlineExceeded)."""
    resources: ResourceRequirements | None = None
    """CPU/memory of the fetch container; unset: requests 500m CPU and 1Gi, limit 4Gi."""
    env: EnvList = Field(default_factory=list)
    """Extra environment of the fetch container, e.g. AWS_* for s3:// or HF_ENDPOINT."""


def _source_is_fetchable(source: str) -> str:
    try:
        check_source(source)  # the fetcher's own definition; the CEL rule above says the same at admission
    except InvalidSource as exc:
        raise ValueError(str(exc)) from None
    return source


def _relpaths(digests: dict[str, str]) -> dict[str, str]:
    try:
        for name in digests:
            check_relpath(name)
    except InvalidSource as exc:
        raise ValueError(f"must name files inside the checkpoint: {exc}") from None
    return {name: digest.lower() for name, digest in digests.items()}


Source = Annotated[
    str,
    Field(min_length=1, max_length=MAX_SOURCE_LENGTH),
    Rule(
        f"self.matches('{SOURCE_PATTERN.pattern}')",
        "checkpoint.source must start with hf://, http://, https://, s3:// or file://, or be an absolute path",
    ),
    Rule(
        "!self.startsWith('hf://') || self.matches('^hf://[^@]+(@[^@]+)?$')",
        "an hf:// source is hf://ORG/REPO or hf://ORG/REPO@REVISION (one '@', a revision after it)",
    ),
    AfterValidator(_source_is_fetchable),
]

Sha256Map = Annotated[
    dict[str, Annotated[str, Field(pattern=SHA256_HEX)]],
    Field(max_length=MAX_SHA256_FILES),
    Rule(
        "self.all(f, !f.contains('\\\\') && !f.matches('(^|/)[.]{0,2}(/|$)'))",
        "checkpoint.sha256 keys must be relative paths inside the checkpoint: no leading '/', no empty, '.' or "
        "'..' components, no '\\'",
    ),
    AfterValidator(_relpaths),
]


class CheckpointSpec(KubeModel):
    """The policy checkpoint (config.json + model.safetensors + manifest.json). A fetch Job downloads it once into
    the cache volume at /models/<key>, where key is a hash of (source, revision); changing source or revision
    starts exactly one new download, then rolls the pods."""

    cel_rules = (
        Rule(
            "!has(self.revision) || !self.source.matches('^hf://.*@') || self.source.endsWith('@' + self.revision)",
            "checkpoint.revision conflicts with the revision after '@' in checkpoint.source; set it in one place",
            field_path=".revision",
        ),
    )

    source: Source
    """Where the checkpoint lives: hf://ORG/REPO[@REV] (Hugging Face Hub), http(s)://HOST/DIR/ (a directory
    with manifest.json) or http(s)://HOST/FILE, s3://BUCKET/PREFIX/, file:///PATH, or an absolute path the
    fetch Job can see (docs/fetch.md)."""
    revision: str | None = Field(None, min_length=1, max_length=MAX_REVISION_LENGTH)
    """Branch, tag or commit (hf://). Part of the cache key for every scheme: hf://ORG/REPO@REV and
    source hf://ORG/REPO with revision REV are the same checkpoint."""
    secret_ref: SecretKeySelector | None = None
    """Secret holding the source's token, mounted into the fetch Job only (at
    /var/run/secrets/policy-checkpoint/token; for hf:// also passed as HF_TOKEN)."""
    sha256: Sha256Map = Field(default_factory=dict)
    """Expected sha256 per file (relative path -> 64 hex digits), checked by the fetch Job on top of the
    source's own hashes."""
    fetch_job: FetchJob = Field(default_factory=FetchJob)

    @property
    def key(self) -> str:
        """Cache directory and Job-name suffix, computed exactly as ``policyserver fetch`` does."""
        return request_key(self.source, self.revision)

    @property
    def path(self) -> str:
        return f"{CACHE_MOUNT_PATH}/{self.key}"

    @property
    def is_hf(self) -> bool:
        return self.source.startswith("hf://")


class Parallelism(KubeModel):
    """Parallel layout of each pod: cfgp x dp ranks, one GPU each. cfgp=2 computes the two classifier-free-guidance
    branches on two GPUs at once; dp independent replicas inside the pod serve requests concurrently."""

    # has(): the apiserver also checks the rule against this section's `default: {}`, before nested defaulting
    cel_rules = (
        Rule(
            f"!has(self.cfgp) || !has(self.dp) || self.cfgp * self.dp <= {MAX_RANKS_PER_POD}",
            f"cfgp x dp must be at most {MAX_RANKS_PER_POD}: a pod runs on one node, with one GPU per rank",
            field_path=".dp",
        ),
    )

    cfgp: Literal[SUPPORTED_CFGP] = 1  # type: ignore[valid-type]
    """Classifier-free-guidance parallel degree: 1 runs both branches on one GPU, 2 runs the conditional and the
    unconditional branch on two GPUs at once."""
    dp: int = Field(1, ge=1, le=MAX_RANKS_PER_POD)
    """Independent data-parallel replicas inside one pod; rank = dp_index x cfgp + cfg_index."""


def _quantity_map_without_gpus(field: str) -> Rule:
    return Rule(
        f"!('{GPU_RESOURCE}' in self)",
        f"resources.{field} must not set {GPU_RESOURCE}: the operator requests cfgp x dp GPUs per pod itself",
        reason="FieldValueForbidden",
    )


class ServerResources(KubeModel):
    """Resources of the server container on top of its GPUs. The GPU count is derived (nvidia.com/gpu = cfgp x dp
    in both requests and limits, none with runtime.device cpu) and may not be set here."""

    requests: Annotated[dict[str, Quantity], _quantity_map_without_gpus("requests")] = Field(default_factory=dict)
    """CPU, memory, ephemeral-storage... of the server container."""
    limits: Annotated[dict[str, Quantity], _quantity_map_without_gpus("limits")] = Field(default_factory=dict)
    """Limits of the server container, e.g. memory."""
    shm_size: Quantity = DEFAULT_SHM_SIZE
    """Size of the in-memory /dev/shm NCCL uses between local ranks; it counts against the pod's memory."""

    # Unset cpu/memory requests get defaults (1 CPU and 2Gi per rank, plus shmSize of memory), unless a limit is
    # set, from which Kubernetes takes the request.


class StorageSpec(KubeModel):
    """The checkpoint cache volume(s), written by the fetch and mounted read-only by every server pod."""

    cel_rules = (
        Rule(
            "!has(self.existingClaim) || !has(self.storageClassName)",
            "storage.storageClassName has no effect with storage.existingClaim; set one of them",
            field_path=".storageClassName",
        ),
        Rule(
            "!has(self.mode) || self.mode != 'perPod' || !has(self.existingClaim)",
            "storage.existingClaim is one claim; mode perPod makes one claim per pod",
            field_path=".existingClaim",
        ),
        Rule(
            "!has(self.mode) || self.mode == 'perPod' || !has(self.accessModes) || "
            "!self.accessModes.exists(m, m == 'ReadWriteOncePod')",
            "storage.accessModes ReadWriteOncePod lets one pod at a time mount the cache; in mode shared "
            "the fetch Job must mount it while a server pod serves from it: use ReadWriteOnce (the "
            "operator keeps the pods that mount it on one node) or mode perPod",
            field_path=".accessModes",
        ),
    )

    mode: Literal[STORAGE_MODES] = "shared"  # type: ignore[valid-type]
    """shared: one cache claim <name>-cache for all pods, filled once by a fetch Job (one download in total);
    with more than one replica it must be ReadWriteMany (or ReadOnlyMany) storage. perPod: every pod gets its
    own claim (a volumeClaimTemplate) filled by an init container with the same fetch (one download per pod),
    which works on ReadWriteOnce storage on any number of nodes. Cannot change once the PolicyServer exists."""
    size: Quantity = DEFAULT_STORAGE_SIZE
    """Requested size of each cache claim. Leave room for the next checkpoint, which downloads next to the one
    being served. An increase is applied to existing claims when their StorageClass has allowVolumeExpansion
    (StorageReady=False ExpansionNotAllowed when it has not); a claim never shrinks."""
    storage_class_name: Dns1123Name | None = None
    """StorageClass of the cache claims; the cluster default when unset. Cannot change on an existing claim."""
    access_modes: list[Literal[ACCESS_MODES]] = Field(  # type: ignore[valid-type]
        default_factory=list, max_length=len(ACCESS_MODES), json_schema_extra=LIST_SET
    )
    """Access modes of the cache claims; they cannot change on an existing claim. Unset: in mode shared
    ReadWriteMany when the claim is created with replicas > 1, else ReadWriteOnce; in mode perPod
    ReadWriteOnce. Explicit modes without ReadWriteMany/ReadOnlyMany are refused with replicas > 1 in mode
    shared. Every pod that mounts a ReadWriteOnce shared cache (fetch Job, cleanup Job, server pods) is kept
    on one node by a required pod affinity, so they never wait on a Multi-Attach error."""
    keep_checkpoints: int = Field(DEFAULT_KEEP_CHECKPOINTS, ge=1, le=MAX_KEEP_CHECKPOINTS)
    """Checkpoint directories kept on the cache after a switch, the served one included. Older ones are
    removed once every pod serves the new checkpoint (never earlier), by a cleanup Job (mode shared) or by each
    pod's init container (mode perPod); an existingClaim is never cleaned."""
    existing_claim: Dns1123Name | None = None
    """Use this PVC instead of creating one; the operator never creates, owns or deletes it."""
    retain_on_delete: bool = False
    """Keep the cache PVC when the PolicyServer is deleted (it gets no ownerReference); a new PolicyServer of the
    same name reuses and adopts it without downloading again."""

    @property
    def per_pod(self) -> bool:
        return self.mode == "perPod"

    def access_modes_for(self, replicas: int) -> tuple[str, ...]:
        """RWX when several pods (on different nodes) must mount the one cache, unless told otherwise."""
        if self.access_modes:
            return tuple(self.access_modes)
        return ("ReadWriteMany",) if replicas > 1 and not self.per_pod else ("ReadWriteOnce",)


class ServiceSpec(KubeModel):
    """The Service in front of the pods."""

    cel_rules = (
        Rule(
            "!has(self.lerobotGrpcPort) || self.lerobotGrpcPort != self.port",
            "service.lerobotGrpcPort must differ from service.port: LeRobot's gRPC service has a listener of its own",
            field_path=".lerobotGrpcPort",
        ),
    )

    type: Literal[SERVICE_TYPES] = "ClusterIP"  # type: ignore[valid-type]
    """Type of the Service <name>."""
    port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    """Port of the WebSocket and of the HTTP endpoints /healthz, /readyz and /metrics, on the Service and in the
    container."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations of the Service, e.g. for a cloud load balancer."""
    lerobot_grpc_port: int | None = Field(None, ge=1, le=65535)
    """Also serve LeRobot's AsyncInference gRPC service on this port (--lerobot-grpc-port), on the Service and in
    the container: LeRobot's own robot_client (lerobot.async_inference) connects to <name>:<port> unchanged, each
    client its own session, batched with the WebSocket robots. policy.type lerobot only; unset: no gRPC port."""


ExtraArg = Annotated[
    str,
    Field(max_length=MAX_EXTRA_ARG_LENGTH),
    Rule(
        f"!self.startsWith('{COMPILE_KEY_FLAG[:11]}')",
        f"runtime.extraArgs must not set {COMPILE_KEY_FLAG} (nor an abbreviation of it): the operator passes the "
        f"PolicyServer's own key; another key would let whoever holds it plant compile artifacts the pods load",
        reason="FieldValueForbidden",
    ),
    Rule(
        f"!self.matches('{MANAGED_FLAG_PATTERN}')",
        f"runtime.extraArgs must not set {', '.join(MANAGED_FLAGS)} (nor an abbreviation of one): the operator "
        f"sets them from the spec; change the corresponding field instead",
        reason="FieldValueForbidden",
    ),
    Rule(
        f"!self.startsWith('{COMPILE_FLAG}=') || self in {list(COMPILE_WORDS)}",
        f"runtime.extraArgs: {COMPILE_FLAG} takes one of {', '.join(COMPILE_MODES)} (torch.compile's modes) or "
        f"{COMPILE_OFF} (eager); another mode would fail only at warm-up, after the model loaded",
    ),
]


class BatchingSpec(KubeModel):
    """How one replica batches concurrent requests of different sessions into one forward pass (--max-batch,
    --batch-window-ms)."""

    max_batch: int = Field(DEFAULT_MAX_BATCH, ge=1, le=MAX_MAX_BATCH)
    """Most requests one replica runs as one batch. 1 runs one request at a time (the behaviour before batching).
    With --compile in extraArgs (e.g. --compile=reduce-overhead: CUDA graphs) a batch is padded to a bucket (1, 2,
    4, ... and maxBatch itself, or the sizes --batch-buckets in extraArgs names) and every bucket is compiled at
    warm-up: a larger value means a longer warm-up (see startupTimeoutSeconds) and more GPU memory."""
    window_ms: float = Field(DEFAULT_BATCH_WINDOW_MS, ge=0, le=MAX_BATCH_WINDOW_MS)
    """Milliseconds a batch with room waits for the next request expected soon (sessions that sent within the
    last second and have none queued: robots between reply and next request), counted from the latest request
    that joined it, so at most maxBatch windows in all. A lone session never waits. 0: never waits; a batch holds
    what queued while the replica was busy."""
    latency_budget_ms: float | None = Field(None, ge=MIN_LATENCY_BUDGET_MS, le=MAX_LATENCY_BUDGET_MS)
    """A robot's control period in milliseconds (--latency-budget-ms). Warm-up measures one batch of every size
    (bucket) up to maxBatch, and no batch is formed whose measured time exceeds this budget; /metrics
    (policy_batch_bucket_seconds), /readyz and status.batching show the times. Unset: batches of up to maxBatch."""


class PolicySpec(KubeModel):
    """Which policy the server pods run (their --policy flag)."""

    cel_rules = (
        Rule(
            f"!has(self.type) || (self.type == '{POLICY_IMPORT}') == has(self.importPath)",
            f"policy.importPath (pkg.module:Class) is set with policy.type {POLICY_IMPORT}, and only then",
            field_path=".importPath",
        ),
        Rule(
            f"!has(self.trustRemoteCode) || !self.trustRemoteCode || (has(self.type) && self.type != '{REFERENCE}')",
            f"policy.trustRemoteCode lets a LeRobot checkpoint (or an import's) run its own code; policy.type "
            f"{REFERENCE} loads none",
            field_path=".trustRemoteCode",
        ),
        Rule(
            f"!has(self.family) || (has(self.type) && self.type == '{LEROBOT}')",
            f"policy.family names a LeRobot checkpoint's type: it needs policy.type {LEROBOT}",
            field_path=".family",
        ),
    )

    type: Literal[POLICY_TYPES] = REFERENCE  # type: ignore[valid-type]
    """reference: the runtime's reference flow-matching policy (a checkpoint made by policyserver checkpoint init).
    lerobot: a LeRobot pretrained directory (SmolVLA, pi0, pi0.5, Diffusion Policy, LingBot-VA, X-VLA, GR00T:
    config.json, model.safetensors
    and the saved processors); the fetch Job also downloads every hub repository it names (a VLM config, a
    tokenizer) into the cache, and the pods load them with HF_HUB_OFFLINE=1. Only a family trained for
    classifier-free guidance (LingBot-VA) has an unconditional branch: parallelism.cfgp 2 and a runtime.guidance
    other than 1.0 need policy.family naming it. import: a Policy class the image can import, named by
    importPath."""
    family: Literal[LEROBOT_TYPES] | None = None  # type: ignore[valid-type]
    """The LeRobot policy type of the checkpoint (the "type" its config.json names), as KServe's
    modelFormat.name names a model's format; policy.type lerobot only. The operator cannot read the checkpoint
    before admitting the spec, so a family trained for classifier-free guidance (lingbot_va) is what admits
    parallelism.cfgp 2 and a runtime.guidance other than 1.0 for lerobot, and guidance unset is then the
    checkpoint's own (LingBot-VA's guidance_scale, 5.0). The pods refuse a checkpoint of another type before
    loading it (exit 2, naming both types). Unset: any served type, without classifier-free guidance."""
    import_path: Annotated[str, Field(max_length=MAX_IMPORT_PATH_LENGTH, pattern=IMPORT_PATH)] | None = None
    """pkg.module:Class of a Policy subclass inside the image (policy.type import only). Whether it has an
    unconditional branch is checked when a pod loads it."""
    trust_remote_code: bool = False
    """Let the checkpoint run its own Python code (transformers' trust_remote_code): a tokenizer or config inside
    it whose auto_map names a Python file, and the trust_remote_code of its saved processor steps (the pods get
    --trust-remote-code). Off (the default), such a LeRobot checkpoint fails the pods' checkpoint verification
    naming the file or step; import paths and unregistered steps in its saved processors, pickled weights and
    unserved policy types are refused either way."""

    @property
    def flag(self) -> str:
        """The value of the pods' --policy flag: a built-in's name or the import path."""
        return self.import_path if self.type == POLICY_IMPORT and self.import_path else self.type

    @property
    def has_unconditional(self) -> bool | None:
        """Whether classifier-free guidance can run; None for an import, which only a pod can tell. A LeRobot
        checkpoint has its declared family's trait (none declared: the built-in's, no unconditional branch)."""
        if self.type == LEROBOT and self.family is not None:
            return LEROBOT_FAMILIES[self.family].has_unconditional
        found = builtin(self.type)
        return None if found is None else found.has_unconditional

    @property
    def own_guidance(self) -> bool:
        """The pods' guidance unset is the checkpoint's own (a LeRobot CFG family's config), not a default the
        operator can know."""
        return self.type == LEROBOT and bool(self.has_unconditional)


class RtcSpec(KubeModel):
    """Real-time chunking (--rtc, --rtc-max-delay): a robot executes one chunk while it asks for the next, and
    the server makes the new chunk continue the actions executed meanwhile (docs/protocol.md, rtc)."""

    mode: Literal[RTC_MODES] = "off"  # type: ignore[valid-type]
    """off refuses rtc requests (rtc_unsupported); inpaint freezes the first inference_delay actions to the
    previous chunk's and guides the rest toward it without gradients (compiled denoisers and CUDA graphs stay as
    they are); guided is the published method, a vector-Jacobian product through the denoiser at every step (a
    backward pass per step)."""
    max_inference_delay: int | None = Field(None, ge=0, le=MAX_RTC_DELAY)
    """The largest inference_delay (control steps) a request may ask for; unset: any below the action horizon."""


class FrontendSpec(KubeModel):
    """Where a pod's WebSocket I/O, msgpack decoding and prepare run (--frontend, --frontend-processes)."""

    cel_rules = (
        Rule(
            "!has(self.processes) || self.processes == 1 || (has(self.mode) && self.mode == 'process')",
            "frontend.processes above 1 needs frontend.mode process",
            field_path=".processes",
        ),
    )

    mode: Literal[FRONTENDS] = DEFAULT_FRONTEND  # type: ignore[valid-type]
    """inline: in the model process (rank 0), on the event loop whose interpreter also launches the model; the
    lowest latency for a few robots. process: in child processes of rank 0 that hand prepared tensors to it
    through shared memory, so decoding many robots' frames no longer delays the model (docs/runtime.md). Each
    front-end process adds 1 CPU and 512Mi to the pod's default requests."""
    processes: int = Field(1, ge=1, le=MAX_FRONTEND_PROCESSES)
    """With mode process: how many front-end processes share the port (the kernel spreads connections over them);
    runtime.maxConnections bounds their sessions together. Several help when many robots share a large batch (32 robots at
    maxBatch 32 on an H200: docs/benchmarks.md)."""


class RuntimeSpec(KubeModel):
    """How the policy runs."""

    guidance: float | None = Field(None, ge=0)
    """Classifier-free guidance scale. Unset: the policy's own (3.0 for the reference policy, the checkpoint's for
    a LeRobot family trained for guidance (policy.family lingbot_va: 5.0), 1.0 = no guidance for a policy without
    an unconditional branch, such as the other LeRobot families). 1.0 turns CFG off, and then parallelism.cfgp
    must be 1."""
    steps: int | None = Field(None, ge=1, le=1000)
    """Flow-matching / diffusion integration steps per action chunk. Unset: the policy's own (a LeRobot config's
    num_steps; 10 for the reference policy)."""
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    rtc: RtcSpec = Field(default_factory=RtcSpec)
    extra_args: list[ExtraArg] = Field(default_factory=list, max_length=MAX_EXTRA_ARGS)
    """Further flags of policyserver serve, appended to the worker's command line, e.g. --dtype bfloat16."""
    env: EnvList = Field(default_factory=list)
    """Extra environment of the server container."""
    drain_grace_seconds: int = Field(DEFAULT_DRAIN_GRACE_S, ge=0, le=MAX_DRAIN_GRACE_S)
    """On SIGTERM the server stops accepting and finishes in-flight requests for up to this long (at most 25:
    torchrun kills its ranks 30 s after SIGTERM)."""
    startup_timeout_seconds: int = Field(DEFAULT_STARTUP_TIMEOUT_S, ge=MIN_STARTUP_TIMEOUT_S)
    """Time a pod may take to start answering /healthz (model load, NCCL init) before the kubelet restarts it
    (the startupProbe)."""
    device: Literal[DEVICES] = "cuda"  # type: ignore[valid-type]
    """cuda requests cfgp x dp GPUs per pod; cpu requests none (tests, CPU-only clusters)."""
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, ge=1, le=MAX_MAX_CONNECTIONS)
    """WebSocket connections one pod accepts at once (--max-connections), whichever of its front-end processes
    holds them; more get HTTP 503 before the upgrade and are counted in
    policy_connections_closed_total{reason="max_connections"}."""
    session_idle_timeout_seconds: int | None = Field(None, ge=0, le=MAX_SESSION_IDLE_TIMEOUT_S)
    """A session that sends no frame this long after its last reply is closed with 1001, so idle sockets cannot
    hold maxConnections (--session-idle-timeout-s); unset: the server's default, 30 s (three times a slow
    policy's 10 s chunk); 0: never."""
    frontend: FrontendSpec = Field(default_factory=FrontendSpec)


class AuthSpec(KubeModel):
    """Client authentication."""

    secret_ref: SecretKeySelector | None = None
    """Secret whose token clients must present (Authorization: Bearer ...); mounted at
    /var/run/secrets/policy-auth/token and passed as --auth-token-file. Unset: no authentication."""


ExtraVolume = Annotated[
    Volume,
    Rule(
        " && ".join(f"!has(self.{source})" for source in REFUSED_VOLUME_SOURCES),
        f"only {', '.join(ALLOWED_VOLUME_SOURCES)} volumes may be added: hostPath and the other "
        f"sources reach the node or storage by address, which a PolicyServer must not hand out",
        reason="FieldValueForbidden",
    ),
]


MAX_TOLERATIONS: Final = 64  # a bound the rule below needs (the apiserver's cost estimate)
# a toleration without a key tolerates every taint: checked over the list (an item rule on Kubernetes' unbounded
# Toleration.key string would exceed the CRD's cost budget)
Tolerations = Annotated[
    list[Toleration],
    Field(max_length=MAX_TOLERATIONS),
    Rule(
        "self.all(t, has(t.key) && t.key != '')",
        "spec.tolerations: every toleration names the taint's key: one without a key tolerates every taint, a "
        "DaemonSet's pattern that would put the PolicyServer's pods on nodes kept for others (control plane, "
        "dedicated pools)",
        reason="FieldValueForbidden",
    ),
]


class PolicyServerSpec(KubeModel):
    """Desired state of the policy server."""

    cel_rules = (
        Rule(
            "self.parallelism.cfgp != 2 || !has(self.runtime.guidance) || self.runtime.guidance != 1.0",
            "cfgp=2 needs classifier-free guidance: with runtime.guidance 1.0 the unconditional branch is "
            "never used and the second GPU of every replica would idle; use cfgp=1 or a guidance other "
            "than 1.0",
            field_path=".parallelism.cfgp",
        ),
        Rule(
            f"{GUIDED_POLICY_CEL} || self.parallelism.cfgp != 2",
            f"{UNGUIDED_TEXT}, so cfgp=2 would have nothing to run on its second rank; use parallelism.cfgp 1 "
            "(or set policy.family to the checkpoint's CFG family)",
            field_path=".parallelism.cfgp",
        ),
        Rule(
            f"{GUIDED_POLICY_CEL} || !has(self.runtime.guidance) || self.runtime.guidance == 1.0",
            f"{UNGUIDED_TEXT}: runtime.guidance must be 1.0 or unset",
            field_path=".runtime.guidance",
        ),
        Rule(
            "!has(self.service) || !has(self.service.lerobotGrpcPort) || "
            f"(has(self.policy) && has(self.policy.type) && self.policy.type == '{LEROBOT}')",
            f"service.lerobotGrpcPort serves LeRobot's robot_client, which describes a LeRobot policy: it needs "
            f"policy.type {LEROBOT}",
            field_path=".service.lerobotGrpcPort",
        ),
        Rule(
            "self.runtime.device != 'cuda' || self.parallelism.cfgp * self.parallelism.dp <= self.maxGpusPerPod",
            "parallelism.cfgp x parallelism.dp GPUs per pod exceeds maxGpusPerPod: no node of this "
            "cluster has that many; lower dp (or cfgp) or raise maxGpusPerPod",
            field_path=".parallelism",
        ),
        Rule(
            "self.storage.mode == 'perPod' || self.replicas <= 1 || !has(self.storage.accessModes) || "
            "size(self.storage.accessModes) == 0 || self.storage.accessModes.exists(m, m == 'ReadWriteMany' || m == 'ReadOnlyMany')",
            "replicas > 1 with storage.mode shared needs storage.accessModes ReadWriteMany (pods on "
            "several nodes mount the one cache; a ReadWriteOnce claim attaches to one node only): use "
            "ReadWriteMany storage, or storage.mode perPod",
            field_path=".storage.accessModes",
        ),
    )

    image: Annotated[str, Field(min_length=1, pattern=NO_SPACE)]
    """Image with the policy-operator runtime (policyserver and torchrun on PATH), used by the fetch Job, the
    init container and the server."""
    image_pull_policy: Literal[PULL_POLICIES] | None = None  # type: ignore[valid-type]
    """Pull policy of every container; Kubernetes' default when unset."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, json_schema_extra=list_map("name"))
    """Registry Secrets for pulling the image."""
    checkpoint: CheckpointSpec
    policy: PolicySpec = Field(default_factory=PolicySpec)
    parallelism: Parallelism = Field(default_factory=Parallelism)
    replicas: int = Field(DEFAULT_REPLICAS, ge=0)
    """Number of pods; the scale subresource (kubectl scale, HPAs) changes it. 0 stops every pod but keeps the
    cache."""
    progress_deadline_seconds: int = Field(DEFAULT_PROGRESS_DEADLINE_S, ge=1)
    """Seconds a rollout (pods starting, or being replaced after a spec change) may go without progress -- no new
    pod created or ready on the current spec -- before status reports Progressing=False ProgressDeadlineExceeded
    and phase Failed (Degraded while older pods still serve), with the failing container's last log lines. The
    download has its own limit, checkpoint.fetchJob.activeDeadlineSeconds."""
    resources: ServerResources = Field(default_factory=ServerResources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods (server and fetch Job) must match."""
    tolerations: Tolerations = Field(default_factory=list)
    """Tolerations of the pods (core/v1 Toleration), e.g. for nvidia.com/gpu:NoSchedule."""
    affinity: Affinity | None = None
    """Affinity of the pods (core/v1 Affinity)."""
    priority_class_name: Dns1123Name | None = None
    """PriorityClass of the pods."""
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, max_length=MAX_SPREAD_CONSTRAINTS
    )
    """How the server pods spread across zones or nodes (core/v1 TopologySpreadConstraint); give it a
    labelSelector such as app.kubernetes.io/instance: <name>."""
    scheduler_name: Dns1123Name | None = None
    """Scheduler of every pod (server, fetch, cleanup), e.g. a gang scheduler; the default scheduler when unset."""
    runtime_class_name: Dns1123Name | None = None
    """RuntimeClass of the server pods, e.g. nvidia where the NVIDIA container runtime is not the default."""
    pod_labels: Annotated[
        dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]],
        Field(max_length=MAX_POD_METADATA),
        Rule(
            f"!self.exists(k, k in {list(RESERVED_POD_LABELS)})",
            f"podLabels may not set a label the operator manages ({', '.join(RESERVED_POD_LABELS)}): selectors and "
            f"Services depend on them",
            reason="FieldValueForbidden",
        ),
    ] = Field(default_factory=dict)
    """Extra labels of every pod (server, fetch, cleanup), e.g. kueue.x-k8s.io/queue-name."""
    pod_annotations: dict[str, str] = Field(default_factory=dict, max_length=MAX_POD_METADATA)
    """Extra annotations of every pod (server, fetch, cleanup), e.g. for a service mesh or a log shipper."""
    volumes: Annotated[list[ExtraVolume], Field(max_length=MAX_EXTRA_VOLUMES, json_schema_extra=list_map("name"))] = (
        Field(default_factory=list)
    )
    """Extra volumes of the server pods (core/v1 Volume), mounted through volumeMounts. Only configMap, secret,
    emptyDir, persistentVolumeClaim, projected, csi, downwardAPI and ephemeral sources: hostPath and the other
    sources are refused at admission."""
    volume_mounts: Annotated[
        list[VolumeMount], Field(max_length=MAX_EXTRA_VOLUMES, json_schema_extra=list_map("mountPath"))
    ] = Field(default_factory=list)
    """Extra mounts of the server container (core/v1 VolumeMount)."""
    max_gpus_per_pod: int = Field(DEFAULT_MAX_GPUS_PER_POD, ge=1, le=MAX_RANKS_PER_POD)
    """The most GPUs one pod may ask for (cfgp x dp with runtime.device cuda); a layout above it is refused at
    admission. Raise it on clusters with larger GPU nodes."""
    service_account_name: Dns1123Name | None = None
    """ServiceAccount of the pods; its token is never mounted (the runtime needs no API access)."""
    storage: StorageSpec = Field(default_factory=StorageSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)

    @model_validator(mode="after")
    def _extra_volumes_are_the_users(self) -> PolicyServerSpec:
        for index, volume in enumerate(self.volumes):  # a source newer than REFUSED_VOLUME_SOURCES too
            other = sorted(set(volume) - {"name", *ALLOWED_VOLUME_SOURCES})
            if other:
                raise ValueError(
                    f"volumes[{index}]: {other[0]} is not an allowed volume source "
                    f"({', '.join(ALLOWED_VOLUME_SOURCES)})"
                )
        taken = sorted({str(v.get("name")) for v in self.volumes} & set(OPERATOR_VOLUMES))
        if taken:
            raise ValueError(
                f"volumes: {', '.join(map(str, taken))} is a volume the operator adds itself; "
                f"rename it (taken: {', '.join(OPERATOR_VOLUMES)})"
            )
        for index, volume in enumerate(self.volumes):
            sources = (volume.get("projected") or {}).get("sources") or []
            if any(isinstance(s, dict) and "serviceAccountToken" in s for s in sources):
                raise ValueError(
                    f"volumes[{index}].projected.sources: a serviceAccountToken is never mounted: the pods need no "
                    "API access, and a token would lend the PolicyServer's author the ServiceAccount's identity"
                )
        names = {v.get("name") for v in self.volumes}
        for m in self.volume_mounts:
            path = str(m.get("mountPath", "")).rstrip("/") or "/"
            if path == "/" or any(
                path == p or p.startswith(path + "/") or path.startswith(p + "/") for p in RESERVED_MOUNT_PATHS
            ):
                raise ValueError(
                    f"volumeMounts: {path} overlaps a directory the interpreter or the loader reads code from "
                    f"({', '.join(RESERVED_MOUNT_PATHS)}); mount it elsewhere"
                )
            if path in OPERATOR_MOUNT_PATHS or any(
                p.startswith(path + "/") or path.startswith(p + "/") for p in OPERATOR_MOUNT_PATHS
            ):
                raise ValueError(
                    f"volumeMounts: {path} overlaps a path the operator mounts "
                    f"({', '.join(OPERATOR_MOUNT_PATHS)}); mount it elsewhere"
                )
            if m.get("name") not in names:
                raise ValueError(f"volumeMounts: {m.get('name')!r} is not one of spec.volumes")
        return self

    # metadata the spec's derived names need; set by parse_spec, never part of the schema
    _name: str = PrivateAttr("")
    _namespace: str = PrivateAttr("")

    @property
    def name(self) -> str:
        return self._name

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def layout(self) -> ParallelLayout:
        """The runtime's own layout object: rank arithmetic and the checks a pod makes at start."""
        return ParallelLayout(cfgp=self.parallelism.cfgp, dp=self.parallelism.dp)

    @property
    def guidance(self) -> float | None:
        """The guidance the pods run with: runtime.guidance, else the policy's own (None: an import or a LeRobot
        CFG family's checkpoint decides)."""
        has_unconditional = self.policy.has_unconditional
        if has_unconditional is None or self.policy.own_guidance:
            return self.runtime.guidance
        return policy_guidance(self.runtime.guidance, has_unconditional)

    @property
    def gpus_per_pod(self) -> int:
        """One GPU per rank: cfgp x dp, none on the CPU device."""
        return self.layout.world_size if self.runtime.device == "cuda" else 0

    @property
    def access_modes(self) -> tuple[str, ...]:
        return self.storage.access_modes_for(self.replicas)


class ObjectMeta(KubeModel, extra="allow"):
    """The metadata the schema may constrain: only name (the apiserver owns the rest of ObjectMeta)."""

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DNS1035_LABEL)]
    """A DNS-1035 label of at most 40 characters, so that every child name derived from it stays valid."""
    namespace: str | None = None


# --- parsing -------------------------------------------------------------------------------------


def _path(loc: tuple[int | str, ...], field_path: str = "") -> str:
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return text + field_path


def _message(error: Any) -> str:
    pattern = (error.get("ctx") or {}).get("pattern")
    if error["type"] == "string_pattern_mismatch" and pattern:
        from policy_operator.operator.kube_model import PATTERN_NAMES

        return f"{error['input']!r} is not {PATTERN_NAMES.get(pattern, f'matched by {pattern}')}"
    if error["type"] == "missing":
        return "is required"
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if error["type"] in ("value_error", "assertion_error"):
        return str(error["msg"]).removeprefix("Value error, ")
    message = str(error["msg"])
    if error["type"] != RULE_ERROR and "input" in error and not isinstance(error["input"], dict | list):
        message += f" (got {error['input']!r})"
    return message


def spec_error(exc: ValidationError, prefix: tuple[str, ...] = ()) -> SpecError:
    """One SpecError for every problem pydantic found: the first one's path, all of them in the message."""
    problems = []
    for error in exc.errors():
        field_path = str((error.get("ctx") or {}).get("field_path") or "")
        problems.append((_path((*prefix, *error["loc"]), field_path), _message(error)))
    (path, message), *rest = problems
    if rest:
        message += "".join(f"; {p}: {m}" for p, m in rest)
    return SpecError(path, message)


def check_name(name: str) -> None:
    try:
        ObjectMeta.model_validate({"name": name})
    except ValidationError as exc:
        raise spec_error(exc, ("metadata",)) from None


def parse_spec(spec: Any, *, name: str, namespace: str) -> PolicyServerSpec:
    """The typed spec of one PolicyServer, or a ``SpecError`` naming the bad field(s) as the CRD spells them."""
    check_name(name)
    try:
        parsed = PolicyServerSpec.model_validate({} if spec is None else spec)
    except ValidationError as exc:
        raise spec_error(exc, ("spec",)) from None
    try:
        guidance = parsed.guidance
        if guidance is not None:  # the runtime's own checks, as a pod makes them
            parsed.layout.check_guidance(guidance)
            if parsed.policy.has_unconditional is not None:
                check_unconditional(
                    parsed.policy.flag, parsed.policy.has_unconditional, cfgp=parsed.layout.cfgp, guidance=guidance
                )
    except LayoutError as exc:
        raise SpecError("spec.parallelism", str(exc)) from None
    try:
        parsed.checkpoint.key  # noqa: B018 - the fetcher's own split of hf://repo@rev against revision
    except InvalidSource as exc:
        raise SpecError("spec.checkpoint.source", str(exc)) from None
    try:
        check_compile_args(parsed.runtime.extra_args)  # "--compile foo" as two words: no CEL rule can see it
    except ValueError as exc:
        raise SpecError("spec.runtime.extraArgs", str(exc)) from None
    parsed._name, parsed._namespace = name, namespace
    return parsed
