"""Pure builders for a PolicyServer's children: cache PVC, fetch Job, StatefulSet, Services.

No API calls and no kopf here: each builder takes the parsed spec and returns
a plain dict, so every variant can be checked offline against the Kubernetes
schemas (``tests/test_manifests.py``).  Names are deterministic functions of
the PolicyServer (and, for the Job, of the checkpoint), which is what makes
reconciling idempotent: a restarted operator finds what it created by name.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.client import V1PersistentVolumeClaim, V1Service, V1ServiceSpec

from policy_operator.builtin_policies import LEROBOT
from policy_operator.constants import (
    ANNOTATION_CHECKPOINT_REVISION,
    ANNOTATION_CHECKPOINT_SOURCE,
    ANNOTATION_SECRETS,
    ANNOTATION_TEMPLATE_HASH,
    APP_NAME,
    AUTH_TOKEN_DIR,
    CACHE_MOUNT_PATH,
    CHECKPOINT_TOKEN_DIR,
    COMPILE_CACHE_DIR,
    COMPILE_CACHE_MOUNT_PATH,
    COMPONENT_CACHE,
    COMPONENT_CACHE_GC,
    COMPONENT_FETCH,
    COMPONENT_SERVER,
    ENV_HF_HUB_CACHE,
    ENV_HF_HUB_OFFLINE,
    ENV_HF_TOKEN,
    FETCH_PROGRESS_PORT,
    FETCH_PROGRESS_PORT_NAME,
    GPU_RESOURCE,
    HEALTHZ_PATH,
    HUB_VIEW_DIR,
    LABEL_CACHE_CLAIM,
    LABEL_CHECKPOINT_KEY,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_POLICYSERVER,
    MANAGED_BY,
    PORT_NAME,
    READYZ_PATH,
    SECRET_TOKEN_KEY,
)
from policy_operator.exit_codes import FETCH_FATAL
from policy_operator.operator.kube_objects import meta_of, typed
from policy_operator.operator.spec import (
    DEFAULT_CPU_PER_RANK,
    DEFAULT_MEMORY_PER_RANK,
    OPERATOR_ENV,
    SHARED_ACCESS_MODES,
    SHM_PATH,
    TMP_PATH,
    VOL_AUTH_TOKEN,
    VOL_CACHE,
    VOL_CHECKPOINT_TOKEN,
    VOL_SHM,
    VOL_TMP,
    PolicyServerSpec,
)
from policy_operator.serve_flags import managed_argv, serve_argv

# The image's user is not known; any non-root uid works because the runtime
# only reads the image's files and writes to the volumes mounted below.
RUN_AS_USER = 1000
TOKEN_FILE = SECRET_TOKEN_KEY
PRESTOP_SLEEP_S = 5  # long enough for endpoint controllers to drop the pod before SIGTERM
TORCHRUN_KILL_S = 30  # torchrun SIGKILLs ranks this long after forwarding SIGTERM
GRACE_MARGIN_S = 10
SERVER_CONTAINER, VERIFY_CONTAINER, FETCH_CONTAINER = "server", "verify-checkpoint", "fetch"
PRUNE_CONTAINER = "prune-cache"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
PDB_MAX_UNAVAILABLE = 1  # a drain takes one server pod at a time; the others keep serving


@dataclass(frozen=True)
class Names:
    """Every child name of one PolicyServer, in one place."""

    policyserver: str

    @property
    def pvc(self) -> str:
        return f"{self.policyserver}-cache"

    @property
    def statefulset(self) -> str:
        return self.policyserver

    @property
    def service(self) -> str:
        return self.policyserver

    @property
    def headless_service(self) -> str:
        return f"{self.policyserver}-pods"

    @property
    def pdb(self) -> str:
        return self.policyserver

    def job(self, key: str) -> str:
        return f"{self.policyserver}-fetch-{key}"

    def gc_job(self, key: str) -> str:
        """The cleanup Job run once every pod serves ``key``."""
        return f"{self.policyserver}-gc-{key}"


@dataclass(frozen=True)
class ServingCheckpoint:
    """The checkpoint a StatefulSet's pods load, which lags the spec while a new one downloads."""

    key: str
    source: str
    revision: str | None = None

    @property
    def path(self) -> str:
        return f"{CACHE_MOUNT_PATH}/{self.key}"

    @classmethod
    def of(cls, spec: PolicyServerSpec) -> ServingCheckpoint:
        return cls(spec.checkpoint.key, spec.checkpoint.source, spec.checkpoint.revision)


def selector_labels(name: str, component: str = COMPONENT_SERVER) -> dict[str, str]:
    """The immutable part of the labels: StatefulSet and Service selectors use exactly these."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def labels(name: str, component: str) -> dict[str, str]:
    return {
        **selector_labels(name, component),
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: APP_NAME,
        LABEL_POLICYSERVER: name,
    }


def selector_string(name: str) -> str:
    """``status.selector`` for the scale subresource (kubectl scale, HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def claim_name(spec: PolicyServerSpec) -> str:
    return spec.storage.existing_claim or Names(spec.name).pvc


def endpoint(spec: PolicyServerSpec) -> str:
    return f"ws://{Names(spec.name).service}.{spec.namespace}.svc:{spec.service.port}"


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        # a checkpoint volume holds a few large files; never chown them all on every mount
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _home_env() -> list[dict[str, Any]]:
    return [{"name": name, "value": value} for name, value in OPERATOR_ENV.items()]


def _server_env(spec: PolicyServerSpec) -> list[dict[str, Any]]:
    """The server container's environment: no hub, the cache's view of the fetched repositories, then the user's
    (a name the user sets replaces the operator's: one entry per name)."""
    own = {ENV_HF_HUB_OFFLINE: "1", ENV_HF_HUB_CACHE: f"{CACHE_MOUNT_PATH}/{HUB_VIEW_DIR}"}
    user = [e.to_api() for e in spec.runtime.env]
    taken = {e["name"] for e in user}
    return _home_env() + [{"name": k, "value": v} for k, v in own.items() if k not in taken] + user


def _secret_volume(volume: str, secret: str, key: str) -> dict[str, Any]:
    return {
        "name": volume,
        "secret": {"secretName": secret, "items": [{"key": key, "path": TOKEN_FILE}], "defaultMode": 0o440},
    }


# --- PVC ------------------------------------------------------------------------------


def _claim_spec(spec: PolicyServerSpec) -> dict[str, Any]:
    storage = spec.storage
    claim: dict[str, Any] = {
        "accessModes": list(storage.access_modes_for(spec.replicas)),
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": storage.size}},
    }
    if storage.storage_class_name is not None:
        claim["storageClassName"] = storage.storage_class_name
    return claim


def build_pvc(spec: PolicyServerSpec) -> dict[str, Any]:
    """The shared cache claim (storage.mode shared)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": Names(spec.name).pvc,
            "namespace": spec.namespace,
            "labels": labels(spec.name, COMPONENT_CACHE),
        },
        "spec": _claim_spec(spec),
    }


def claim_template(spec: PolicyServerSpec) -> dict[str, Any]:
    """The StatefulSet's volumeClaimTemplate (storage.mode perPod): claim checkpoint-cache-<name>-<ordinal>."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": VOL_CACHE, "labels": labels(spec.name, COMPONENT_CACHE)},
        "spec": _claim_spec(spec),
    }


def claim_storage(claim: V1PersistentVolumeClaim) -> str | None:
    """The storage a claim requests (``spec.resources.requests.storage``, a quantity), None when it says none."""
    resources = claim.spec.resources if claim.spec else None
    return ((resources.requests if resources else None) or {}).get("storage")


def cache_is_shared(modes: Sequence[str]) -> bool:
    """Whether pods on several nodes may mount a claim of these access modes at once."""
    return bool(set(modes) & set(SHARED_ACCESS_MODES))


def grown_claim_patch(size: str) -> dict[str, Any]:
    """The merge patch that asks for a larger claim (PVC expansion; only the size may change after binding)."""
    return {"spec": {"resources": {"requests": {"storage": size}}}}


# --- fetch Job ------------------------------------------------------------------------


def fetch_command(spec: PolicyServerSpec) -> list[str]:
    ck = spec.checkpoint
    cmd = ["policyserver", "fetch", ck.source, CACHE_MOUNT_PATH]
    if ck.revision is not None:
        cmd += ["--revision", ck.revision]
    for file, digest in sorted(ck.sha256.items()):
        cmd += ["--sha256", f"{file}={digest}"]
    if spec.policy.type == LEROBOT:  # its VLM and tokenizer repositories too: the pods load offline
        cmd += ["--references"]
    if ck.secret_ref is not None:
        cmd += ["--token-file", f"{CHECKPOINT_TOKEN_DIR}/{TOKEN_FILE}"]
    return cmd


def _fetch_container(spec: PolicyServerSpec) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The fetch container and the volumes it needs besides the cache and /tmp (the checkpoint token)."""
    ck = spec.checkpoint
    env = _home_env()
    mounts: list[dict[str, Any]] = [
        {"name": VOL_CACHE, "mountPath": CACHE_MOUNT_PATH},
        {"name": VOL_TMP, "mountPath": TMP_PATH},
    ]
    volumes: list[dict[str, Any]] = []
    if ck.secret_ref is not None:
        volumes.append(_secret_volume(VOL_CHECKPOINT_TOKEN, ck.secret_ref.name, ck.secret_ref.key))
        mounts.append({"name": VOL_CHECKPOINT_TOKEN, "mountPath": CHECKPOINT_TOKEN_DIR, "readOnly": True})
        if ck.is_hf:
            env.append(
                {
                    "name": ENV_HF_TOKEN,
                    "valueFrom": {"secretKeyRef": {"name": ck.secret_ref.name, "key": ck.secret_ref.key}},
                }
            )
    env += [e.to_api() for e in ck.fetch_job.env]
    container: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": spec.image,
        "command": fetch_command(spec),
        "env": env,
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        # the last lines of a failed fetch ("policyserver fetch: error: ...") become the
        # termination message, which the operator copies into CheckpointReady
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": (ck.fetch_job.resources.to_api() if ck.fetch_job.resources else None)
        or {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container, volumes


def _cache_volumes(spec: PolicyServerSpec, *, read_only: bool) -> list[dict[str, Any]]:
    claim: dict[str, Any] = {"claimName": claim_name(spec)}
    if read_only:
        claim["readOnly"] = True
    return [{"name": VOL_CACHE, "persistentVolumeClaim": claim}, {"name": VOL_TMP, "emptyDir": {}}]


def _colocate(
    pod_spec: dict[str, Any], pod_labels: dict[str, str], spec: PolicyServerSpec, cache_modes: Sequence[str]
) -> None:
    """Label a pod that mounts the shared cache claim; keep it on the node of the others when the claim is RWO.

    A ReadWriteOnce volume attaches to one node: a fetch Job pod scheduled
    elsewhere than the server pod (or a second server pod) would wait on
    Multi-Attach forever.  A required pod affinity on the claim's label puts
    them on one node; the first such pod matches its own term, so it may go
    anywhere.
    """
    pod_labels[LABEL_CACHE_CLAIM] = claim_name(spec)
    if cache_is_shared(cache_modes):
        return
    affinity = pod_spec.setdefault("affinity", {})
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
        {
            "labelSelector": {"matchLabels": {LABEL_CACHE_CLAIM: claim_name(spec)}},
            "topologyKey": HOSTNAME_TOPOLOGY,
        }
    )


def _job_pod_spec(
    spec: PolicyServerSpec, containers: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "securityContext": _pod_security_context(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": containers,
        "volumes": volumes,
    }
    _apply_scheduling(pod_spec, spec)
    return pod_spec


def _pod_metadata(
    spec: PolicyServerSpec, own_labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """A pod template's metadata: podLabels/podAnnotations first, the operator's own on top."""
    meta: dict[str, Any] = {"labels": {**spec.pod_labels, **own_labels}}
    merged = {**spec.pod_annotations, **(annotations or {})}
    if merged:
        meta["annotations"] = merged
    return meta


def build_fetch_job(spec: PolicyServerSpec, cache_modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The Job that downloads the spec's checkpoint into the shared cache claim."""
    ck = spec.checkpoint
    job_labels = {**labels(spec.name, COMPONENT_FETCH), LABEL_CHECKPOINT_KEY: ck.key}
    container, secret_volumes = _fetch_container(spec)
    # the operator reads the download's progress here (operator/observe.py), never from the pod's log
    container["command"] = [*container["command"], "--progress-port", str(FETCH_PROGRESS_PORT)]
    container["ports"] = [{"name": FETCH_PROGRESS_PORT_NAME, "containerPort": FETCH_PROGRESS_PORT, "protocol": "TCP"}]
    pod_spec = _job_pod_spec(spec, [container], _cache_volumes(spec, read_only=False) + secret_volumes)
    pod_labels = dict(job_labels)
    _colocate(pod_spec, pod_labels, spec, spec.access_modes if cache_modes is None else cache_modes)
    job_spec: dict[str, Any] = {
        "backoffLimit": ck.fetch_job.backoff_limit,
        "ttlSecondsAfterFinished": ck.fetch_job.ttl_seconds_after_finished,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": FETCH_CONTAINER,
                        "operator": "In",
                        "values": [int(code) for code in FETCH_FATAL],
                    },
                },
                # a drained or preempted node is not the download's fault
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": {"metadata": _pod_metadata(spec, pod_labels), "spec": pod_spec},
    }
    if ck.fetch_job.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = ck.fetch_job.active_deadline_seconds
    annotations = {ANNOTATION_CHECKPOINT_SOURCE: ck.source, **secrets_annotation(pod_spec)}
    if ck.revision is not None:
        annotations[ANNOTATION_CHECKPOINT_REVISION] = ck.revision
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": Names(spec.name).job(ck.key),
            "namespace": spec.namespace,
            "labels": job_labels,
            "annotations": annotations,
        },
        "spec": job_spec,
    }


def secret_names(pod_spec: Mapping[str, Any]) -> list[str]:
    """The Secrets a pod spec names: secret volumes, projected secret sources, env secretKeyRef and envFrom."""
    names: set[str] = set()
    for volume in pod_spec.get("volumes") or []:
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "secret" in source:
                names.add(source["secret"]["name"])
    for container in [*(pod_spec.get("containers") or []), *(pod_spec.get("initContainers") or [])]:
        for env in container.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                names.add(source["secretRef"]["name"])
    return sorted(names)


def secrets_annotation(pod_spec: Mapping[str, Any]) -> dict[str, str]:
    """``ANNOTATION_SECRETS`` of a workload: every Secret its template names, as the chart's admission policy
    (operator/admission.py) requires of the operator's ServiceAccount; none when it names none."""
    names = secret_names(pod_spec)
    return {ANNOTATION_SECRETS: ",".join(names)} if names else {}


def prune_command(spec: PolicyServerSpec, keep_key: str) -> list[str]:
    return [
        "policyserver",
        "checkpoint",
        "prune",
        CACHE_MOUNT_PATH,
        "--keep",
        keep_key,
        "--keep-last",
        str(spec.storage.keep_checkpoints),
    ]


def _prune_container(spec: PolicyServerSpec, keep_key: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": PRUNE_CONTAINER,
        "image": spec.image,
        "command": prune_command(spec, keep_key),
        "env": _home_env(),
        "volumeMounts": [{"name": VOL_CACHE, "mountPath": CACHE_MOUNT_PATH}, {"name": VOL_TMP, "mountPath": TMP_PATH}],
        "securityContext": _container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def build_gc_job(spec: PolicyServerSpec, keep_key: str, cache_modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The cleanup Job that removes old checkpoints from the shared cache once every pod serves ``keep_key``."""
    gc_labels = {**labels(spec.name, COMPONENT_CACHE_GC), LABEL_CHECKPOINT_KEY: keep_key}
    pod_spec = _job_pod_spec(spec, [_prune_container(spec, keep_key)], _cache_volumes(spec, read_only=False))
    pod_labels = dict(gc_labels)
    _colocate(pod_spec, pod_labels, spec, spec.access_modes if cache_modes is None else cache_modes)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": Names(spec.name).gc_job(keep_key), "namespace": spec.namespace, "labels": gc_labels},
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": spec.checkpoint.fetch_job.ttl_seconds_after_finished,
            "template": {"metadata": _pod_metadata(spec, pod_labels), "spec": pod_spec},
        },
    }


# --- StatefulSet ----------------------------------------------------------------------


def worker_command(spec: PolicyServerSpec, serving: ServingCheckpoint, *, compile_cache: bool = False) -> list[str]:
    """``policyserver serve`` with the flags the spec manages, then extraArgs; serve runs torchrun as its child.

    ``compile_cache``: the pod mounts the cache volume's compile-artifacts directory, so ``--compile`` (in
    extraArgs) loads and saves there; extraArgs may point ``--compile-cache-dir`` elsewhere.
    """
    rt, layout = spec.runtime, spec.layout
    flags = managed_argv(
        checkpoint=serving.path,
        policy=spec.policy.flag,
        port=spec.service.port,
        cfgp=layout.cfgp,
        dp=layout.dp,
        guidance=rt.guidance,
        steps=rt.steps,
        max_batch=rt.batching.max_batch,
        batch_window_ms=rt.batching.window_ms,
        device=rt.device,
        drain_grace_s=rt.drain_grace_seconds,
        latency_budget_ms=rt.batching.latency_budget_ms,
        max_connections=rt.max_connections,
        rtc=rt.rtc.mode if rt.rtc.mode != "off" else None,
        rtc_max_delay=rt.rtc.max_inference_delay,
        auth_token_file=f"{AUTH_TOKEN_DIR}/{TOKEN_FILE}" if spec.auth.secret_ref is not None else None,
    )
    if compile_cache:
        flags += ["--compile-cache-dir", COMPILE_CACHE_MOUNT_PATH]
    return serve_argv([*flags, *rt.extra_args])


def compile_cache_writable(per_pod: bool, cache_modes: Sequence[str]) -> bool:
    """Whether server pods mount the cache's compile-artifacts directory writable: always on a per-pod claim; on the
    shared claim unless its only access mode is ReadOnlyMany, which some CSI drivers attach only with a read-only
    pod volume (those pods compile as before)."""
    return per_pod or set(cache_modes) != {"ReadOnlyMany"}


def termination_grace_seconds(spec: PolicyServerSpec) -> int:
    """preStop sleep + torchrun's own SIGTERM->SIGKILL window + a margin, so the kubelet never kills first."""
    return PRESTOP_SLEEP_S + max(TORCHRUN_KILL_S, spec.runtime.drain_grace_seconds) + GRACE_MARGIN_S


def _quantity(value: Decimal) -> str:
    """A byte count as a quantity: whole Gi or Mi when it is one, else bytes."""
    for unit, size in (("Gi", Decimal(1024**3)), ("Mi", Decimal(1024**2))):
        if value % size == 0:
            return f"{int(value / size)}{unit}"
    return str(int(value))


def default_requests(spec: PolicyServerSpec) -> dict[str, str]:
    """cpu/memory requests for what resources leaves unset: per rank, plus the memory-backed /dev/shm.

    A request the user left out but bounded with a limit is left to
    Kubernetes, which takes the limit as the request.
    """
    from kubernetes.utils import parse_quantity

    ranks = spec.layout.world_size
    out: dict[str, str] = {}
    if "cpu" not in spec.resources.requests and "cpu" not in spec.resources.limits:
        out["cpu"] = str(int(parse_quantity(DEFAULT_CPU_PER_RANK) * ranks))
    if "memory" not in spec.resources.requests and "memory" not in spec.resources.limits:
        memory = parse_quantity(DEFAULT_MEMORY_PER_RANK) * ranks + parse_quantity(spec.resources.shm_size)
        out["memory"] = _quantity(memory)
    return out


def _server_resources(spec: PolicyServerSpec) -> dict[str, Any]:
    requests = {**default_requests(spec), **spec.resources.requests}
    limits = dict(spec.resources.limits)
    if spec.gpus_per_pod:
        # extended resources: requests must equal limits; setting both states it plainly
        requests[GPU_RESOURCE] = str(spec.gpus_per_pod)
        limits[GPU_RESOURCE] = str(spec.gpus_per_pod)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _apply_scheduling(pod_spec: dict[str, Any], spec: PolicyServerSpec) -> None:
    sched = spec  # the scheduling fields sit at the top level of the spec, as in a pod spec
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [copy.deepcopy(dict(t)) for t in sched.tolerations]
    if sched.affinity:
        pod_spec["affinity"] = copy.deepcopy(dict(sched.affinity))
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if sched.scheduler_name:
        pod_spec["schedulerName"] = sched.scheduler_name
    if sched.service_account_name:
        pod_spec["serviceAccountName"] = sched.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [ref.to_api() for ref in spec.image_pull_secrets]


def build_pod_template(
    spec: PolicyServerSpec, serving: ServingCheckpoint, cache_modes: Sequence[str] | None = None
) -> dict[str, Any]:
    """The server pod: (perPod: fetch, prune) verify, then torchrun; ``cache_modes`` are the shared claim's."""
    port = spec.service.port
    rt = spec.runtime
    per_pod = spec.storage.per_pod
    compile_cache = compile_cache_writable(per_pod, spec.access_modes if cache_modes is None else cache_modes)
    mounts = [
        {"name": VOL_CACHE, "mountPath": CACHE_MOUNT_PATH, "readOnly": True},
        {"name": VOL_TMP, "mountPath": TMP_PATH},
        {"name": VOL_SHM, "mountPath": SHM_PATH},
    ]
    if compile_cache:  # the kubelet creates the directory with the volume root's mode (group-writable: fsGroup)
        mounts.append({"name": VOL_CACHE, "mountPath": COMPILE_CACHE_MOUNT_PATH, "subPath": COMPILE_CACHE_DIR})
    # perPod: the cache volume is the StatefulSet's volumeClaimTemplate, not a pod volume; the checkpoints stay
    # read-only through their mount when the volume itself is writable
    volumes: list[dict[str, Any]] = [] if per_pod else _cache_volumes(spec, read_only=not compile_cache)[:1]
    volumes += [
        {"name": VOL_TMP, "emptyDir": {}},
        # NCCL moves tensors between local ranks through /dev/shm; the runtime's 64 MiB default is too small
        {"name": VOL_SHM, "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
    ]
    if spec.auth.secret_ref is not None:
        volumes.append(_secret_volume(VOL_AUTH_TOKEN, spec.auth.secret_ref.name, spec.auth.secret_ref.key))
        mounts.append({"name": VOL_AUTH_TOKEN, "mountPath": AUTH_TOKEN_DIR, "readOnly": True})

    def http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": PORT_NAME},
            "periodSeconds": period,
            "timeoutSeconds": 3,
            "failureThreshold": failures,
        }

    startup_period = 5
    server: dict[str, Any] = {
        "name": SERVER_CONTAINER,
        "image": spec.image,
        "command": worker_command(spec, serving, compile_cache=compile_cache),
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": _server_env(spec),
        "volumeMounts": mounts,
        "resources": _server_resources(spec),
        "securityContext": _container_security_context(),
        # model load + warm-up can take minutes: liveness only starts once the process answers
        "startupProbe": http_probe(
            HEALTHZ_PATH, startup_period, max(1, -(-rt.startup_timeout_seconds // startup_period))
        ),
        "livenessProbe": http_probe(HEALTHZ_PATH, 10, 3),
        "readinessProbe": http_probe(READYZ_PATH, 5, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    verify: dict[str, Any] = {
        "name": VERIFY_CONTAINER,
        "image": spec.image,
        "command": [
            "policyserver",
            "checkpoint",
            "verify",
            serving.path,
            "--require-marker",
            *(["--references"] if spec.policy.type == LEROBOT else []),
        ],
        "env": _home_env(),
        "volumeMounts": mounts[:2],
        "securityContext": _container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
    }
    if spec.image_pull_policy:
        server["imagePullPolicy"] = verify["imagePullPolicy"] = spec.image_pull_policy
    server["volumeMounts"] += [copy.deepcopy(dict(m)) for m in spec.volume_mounts]
    volumes += [copy.deepcopy(dict(v)) for v in spec.volumes]
    init_containers = [verify]
    if per_pod:
        # one download per pod into its own claim, with the fetch Job's command (same lock and marker), then
        # the old checkpoints of this claim go: nothing else mounts it, and this pod no longer serves them
        fetch, secret_volumes = _fetch_container(spec)
        volumes += secret_volumes
        init_containers = [fetch, _prune_container(spec, serving.key), verify]
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security_context(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "initContainers": init_containers,
        "containers": [server],
        "volumes": volumes,
    }
    _apply_scheduling(pod_spec, spec)
    if spec.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    if spec.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [copy.deepcopy(dict(c)) for c in spec.topology_spread_constraints]
    annotations = {ANNOTATION_CHECKPOINT_SOURCE: serving.source}
    if serving.revision is not None:
        annotations[ANNOTATION_CHECKPOINT_REVISION] = serving.revision
    pod_labels = {**labels(spec.name, COMPONENT_SERVER), LABEL_CHECKPOINT_KEY: serving.key}
    if not per_pod:
        _colocate(pod_spec, pod_labels, spec, spec.access_modes if cache_modes is None else cache_modes)
    template = {"metadata": _pod_metadata(spec, pod_labels, annotations), "spec": pod_spec}
    template["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] = template_hash(template)
    return template


def template_hash(template: dict[str, Any]) -> str:
    """A digest of everything that should roll the pods (image, runtime, checkpoint...)."""
    body = copy.deepcopy(template)
    body.get("metadata", {}).get("annotations", {}).pop(ANNOTATION_TEMPLATE_HASH, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def build_statefulset(
    spec: PolicyServerSpec, serving: ServingCheckpoint | None = None, cache_modes: Sequence[str] | None = None
) -> dict[str, Any]:
    serving = serving or ServingCheckpoint.of(spec)
    names = Names(spec.name)
    template = build_pod_template(spec, serving, cache_modes)
    sts: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": names.statefulset,
            "namespace": spec.namespace,
            "labels": {**labels(spec.name, COMPONENT_SERVER), LABEL_CHECKPOINT_KEY: serving.key},
            "annotations": {
                ANNOTATION_TEMPLATE_HASH: template["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH],
                **secrets_annotation(template["spec"]),
            },
        },
        "spec": {
            "replicas": spec.replicas,
            "serviceName": names.headless_service,
            # pods are independent replicas: start and replace them all at once, not in ordinal order
            "podManagementPolicy": "Parallel",
            # the operator replaces pods itself (operator/rollout.py): a template edited behind its back restarts
            # nothing before it is put back, and a rollout surges instead of stopping a pod first
            "updateStrategy": {"type": "OnDelete"},
            "ordinals": {"start": 0},  # moved up by a rollout that retires the lowest pod (rollout.py)
            "selector": {"matchLabels": selector_labels(spec.name)},
            "template": template,
        },
    }
    if spec.storage.per_pod:
        sts["spec"]["volumeClaimTemplates"] = [claim_template(spec)]
        # a scaled-down pod's claim stays (scaling back up reuses its download); deletion follows retainOnDelete
        sts["spec"]["persistentVolumeClaimRetentionPolicy"] = {
            "whenDeleted": "Retain" if spec.storage.retain_on_delete else "Delete",
            "whenScaled": "Retain",
        }
    return sts


# --- PodDisruptionBudget ------------------------------------------------------------------


def build_pdb(spec: PolicyServerSpec) -> dict[str, Any]:
    """At most one server pod voluntarily disrupted at a time (node drains, cluster upgrades): replicas > 1 only.

    maxUnavailable, not minAvailable, so a drain still makes progress while a
    pod is unready for another reason (an eviction is allowed whenever no
    more than one pod is down) and an HPA scale-down is never blocked.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": Names(spec.name).pdb,
            "namespace": spec.namespace,
            "labels": labels(spec.name, COMPONENT_SERVER),
        },
        "spec": {
            "maxUnavailable": PDB_MAX_UNAVAILABLE,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # a pod that never became ready (a crash loop) may be evicted: it serves nobody
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# --- Services -------------------------------------------------------------------------


def _service_ports(spec: PolicyServerSpec) -> list[dict[str, Any]]:
    return [{"name": PORT_NAME, "port": spec.service.port, "targetPort": PORT_NAME, "protocol": "TCP"}]


def build_service(spec: PolicyServerSpec) -> dict[str, Any]:
    svc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": Names(spec.name).service,
            "namespace": spec.namespace,
            "labels": labels(spec.name, COMPONENT_SERVER),
        },
        "spec": {"type": spec.service.type, "selector": selector_labels(spec.name), "ports": _service_ports(spec)},
    }
    if spec.service.annotations:
        svc["metadata"]["annotations"] = dict(spec.service.annotations)
    return svc


def build_headless_service(spec: PolicyServerSpec) -> dict[str, Any]:
    """Per-pod DNS (``<name>-0.<name>-pods``) for the StatefulSet, including pods not ready yet."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": Names(spec.name).headless_service,
            "namespace": spec.namespace,
            "labels": labels(spec.name, COMPONENT_SERVER),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(spec.name),
            "ports": _service_ports(spec),
        },
    }


def service_fingerprint(svc: V1Service) -> tuple[Any, ...]:
    """The spec fields of a Service the operator owns; the API server adds others (clusterIP, nodePort...)."""
    spec = svc.spec or V1ServiceSpec()
    ports = tuple((p.name, p.port, p.target_port, p.protocol or "TCP") for p in spec.ports or [])
    return (spec.type or "ClusterIP", tuple(sorted((spec.selector or {}).items())), ports)


def service_needs_patch(existing: V1Service, desired: Mapping[str, Any]) -> bool:
    """True when the operator's fields differ (``desired``: the body it applies); annotations others added (cloud
    controllers) are left alone."""
    want = typed(V1Service, desired)
    if service_fingerprint(existing) != service_fingerprint(want):
        return True
    have = meta_of(existing).annotations or {}
    return any(have.get(k) != v for k, v in (meta_of(want).annotations or {}).items())
