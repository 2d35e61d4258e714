"""Pure builders for a PolicyServer's children: cache PVC, fetch Job, StatefulSet, Services.

No API calls and no kopf here: each builder takes the parsed spec and returns
the server-side apply body, so every variant can be checked offline against
the Kubernetes schemas (``tests/test_manifests.py``).  The objects are put
together from the installed client's models (``V1StatefulSet``, ``V1Container``...),
so a misspelt field is a mypy error and a mistyped value a pydantic error where
the object is built, not an apiserver refusal in a reconcile; each builder turns
its model into the API's JSON once, at its end (``kube_objects.api_json``), and
the rest of the operator (plan, apply, drift) keeps handling that JSON.  What
the PolicyServer passes through (affinity, tolerations, volumes, env...) goes
in through ``kube_objects.passthrough``, which refuses a section the model
would not give back unchanged.  Names are deterministic functions of the
PolicyServer (and, for the Job, of the checkpoint), which is what makes
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

from kubernetes.client import (
    V1Affinity,
    V1Capabilities,
    V1Container,
    V1ContainerPort,
    V1EmptyDirVolumeSource,
    V1EnvVar,
    V1EnvVarSource,
    V1HTTPGetAction,
    V1Job,
    V1JobSpec,
    V1KeyToPath,
    V1LabelSelector,
    V1Lifecycle,
    V1LifecycleHandler,
    V1LocalObjectReference,
    V1ObjectMeta,
    V1PersistentVolumeClaim,
    V1PersistentVolumeClaimSpec,
    V1PersistentVolumeClaimVolumeSource,
    V1PodAffinity,
    V1PodAffinityTerm,
    V1PodDisruptionBudget,
    V1PodDisruptionBudgetSpec,
    V1PodFailurePolicy,
    V1PodFailurePolicyOnExitCodesRequirement,
    V1PodFailurePolicyOnPodConditionsPattern,
    V1PodFailurePolicyRule,
    V1PodSecurityContext,
    V1PodSpec,
    V1PodTemplateSpec,
    V1Probe,
    V1ResourceRequirements,
    V1SeccompProfile,
    V1Secret,
    V1SecretKeySelector,
    V1SecretVolumeSource,
    V1SecurityContext,
    V1Service,
    V1ServicePort,
    V1ServiceSpec,
    V1SleepAction,
    V1StatefulSet,
    V1StatefulSetOrdinals,
    V1StatefulSetPersistentVolumeClaimRetentionPolicy,
    V1StatefulSetSpec,
    V1StatefulSetUpdateStrategy,
    V1Toleration,
    V1TopologySpreadConstraint,
    V1Volume,
    V1VolumeMount,
    V1VolumeResourceRequirements,
)

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
    ENV_HF_TOKEN,
    FETCH_PROGRESS_PORT,
    FETCH_PROGRESS_PORT_NAME,
    GPU_RESOURCE,
    HEALTHZ_PATH,
    LABEL_CACHE_CLAIM,
    LABEL_CHECKPOINT_KEY,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_POLICYSERVER,
    LEROBOT_GRPC_PORT_NAME,
    MANAGED_BY,
    PORT_NAME,
    READYZ_PATH,
    SECRET_TOKEN_KEY,
)
from policy_operator.exit_codes import FETCH_FATAL
from policy_operator.operator.kube_objects import api_json, meta_of, passthrough, typed
from policy_operator.operator.spec import (
    COMPILE_KEY_DIR,
    DEFAULT_CPU_PER_FRONTEND,
    DEFAULT_CPU_PER_RANK,
    DEFAULT_MEMORY_PER_FRONTEND,
    DEFAULT_MEMORY_PER_RANK,
    OPERATOR_ENV,
    SERVER_HUB_ENV,
    SHARED_ACCESS_MODES,
    SHM_PATH,
    TMP_PATH,
    VOL_AUTH_TOKEN,
    VOL_CACHE,
    VOL_CHECKPOINT_TOKEN,
    VOL_COMPILE_KEY,
    VOL_SHM,
    VOL_TMP,
    EnvVar,
    PolicyServerSpec,
)
from policy_operator.serve_flags import (
    COMPILE_KEY_FLAG,
    DEFAULT_FRONTEND,
    TRUST_REMOTE_CODE_FLAG,
    lerobot_gpu_defaults,
    managed_argv,
    serve_argv,
)

# The image's user is not known; any non-root uid works because the runtime
# only reads the image's files and writes to the volumes mounted below.
RUN_AS_USER = 1000
TOKEN_FILE = SECRET_TOKEN_KEY
COMPILE_KEY_DATA = "key"  # the compile key Secret's one data key
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

    @property
    def compile_key(self) -> str:
        """The Secret of the PolicyServer's compile-artifacts key."""
        return f"{self.policyserver}-compile-key"

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


def lerobot_grpc_endpoint(spec: PolicyServerSpec) -> str | None:
    """LeRobot's robot_client ``--server_address`` (host:port, no scheme), or None without the gRPC port."""
    port = spec.service.lerobot_grpc_port
    return None if port is None else f"{Names(spec.name).service}.{spec.namespace}.svc:{port}"


def _pod_security_context() -> V1PodSecurityContext:
    return V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=RUN_AS_USER,
        run_as_group=RUN_AS_USER,
        fs_group=RUN_AS_USER,
        # a checkpoint volume holds a few large files; never chown them all on every mount
        fs_group_change_policy="OnRootMismatch",
        seccomp_profile=V1SeccompProfile(type="RuntimeDefault"),
    )


def _container_security_context() -> V1SecurityContext:
    return V1SecurityContext(
        allow_privilege_escalation=False,
        read_only_root_filesystem=True,
        run_as_non_root=True,
        capabilities=V1Capabilities(drop=["ALL"]),
    )


def _home_env() -> list[V1EnvVar]:
    return [V1EnvVar(name=name, value=value) for name, value in OPERATOR_ENV.items()]


def _user_env(env: Sequence[EnvVar]) -> list[V1EnvVar]:
    return [passthrough(V1EnvVar, e.to_api()) for e in env]


def _server_env(spec: PolicyServerSpec) -> list[V1EnvVar]:
    """The server container's environment: no hub, the cache's view of the fetched repositories, then the user's
    (whose names never repeat these: spec.RESERVED_ENV_NAMES)."""
    return _home_env() + [V1EnvVar(name=k, value=v) for k, v in SERVER_HUB_ENV.items()] + _user_env(spec.runtime.env)


def _secret_volume(volume: str, secret: str, key: str) -> V1Volume:
    return V1Volume(
        name=volume,
        secret=V1SecretVolumeSource(
            secret_name=secret, items=[V1KeyToPath(key=key, path=TOKEN_FILE)], default_mode=0o440
        ),
    )


def _mount(volume: str, path: str, *, read_only: bool = False, sub_path: str | None = None) -> V1VolumeMount:
    return V1VolumeMount(name=volume, mount_path=path, read_only=True if read_only else None, sub_path=sub_path)


def _small_resources() -> V1ResourceRequirements:
    """A short-lived helper container's (verify, prune)."""
    return V1ResourceRequirements(requests={"cpu": "100m", "memory": "128Mi"}, limits={"memory": "512Mi"})


# --- PVC ------------------------------------------------------------------------------


def _claim_spec(spec: PolicyServerSpec) -> V1PersistentVolumeClaimSpec:
    storage = spec.storage
    return V1PersistentVolumeClaimSpec(
        access_modes=list(storage.access_modes_for(spec.replicas)),
        volume_mode="Filesystem",
        resources=V1VolumeResourceRequirements(requests={"storage": storage.size}),
        storage_class_name=storage.storage_class_name,
    )


def _owned_meta(
    spec: PolicyServerSpec, name: str, component: str, annotations: Mapping[str, str] | None = None
) -> V1ObjectMeta:
    """The metadata of an object the operator makes for ``spec``: its name in the spec's namespace, the component's
    labels, and ``annotations`` when there are any."""
    return V1ObjectMeta(
        name=name,
        namespace=spec.namespace,
        labels=labels(spec.name, component),
        annotations=dict(annotations) if annotations else None,
    )


def build_pvc(spec: PolicyServerSpec) -> dict[str, Any]:
    """The shared cache claim (storage.mode shared)."""
    return api_json(
        V1PersistentVolumeClaim(
            api_version="v1",
            kind="PersistentVolumeClaim",
            metadata=_owned_meta(spec, Names(spec.name).pvc, COMPONENT_CACHE),
            spec=_claim_spec(spec),
        )
    )


def _claim_template(spec: PolicyServerSpec) -> V1PersistentVolumeClaim:
    """The StatefulSet's volumeClaimTemplate (storage.mode perPod): claim checkpoint-cache-<name>-<ordinal>."""
    return V1PersistentVolumeClaim(
        api_version="v1",
        kind="PersistentVolumeClaim",
        metadata=V1ObjectMeta(name=VOL_CACHE, labels=labels(spec.name, COMPONENT_CACHE)),
        spec=_claim_spec(spec),
    )


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


def _fetch_container(spec: PolicyServerSpec) -> tuple[V1Container, list[V1Volume]]:
    """The fetch container and the volumes it needs besides the cache and /tmp (the checkpoint token)."""
    ck = spec.checkpoint
    env = _home_env()
    mounts = [
        _mount(VOL_CACHE, CACHE_MOUNT_PATH),
        # the compile artifacts are the server pods' (issue 39): the download cannot write them
        _mount(VOL_CACHE, f"{CACHE_MOUNT_PATH}/{COMPILE_CACHE_DIR}", read_only=True, sub_path=COMPILE_CACHE_DIR),
        _mount(VOL_TMP, TMP_PATH),
    ]
    volumes: list[V1Volume] = []
    if ck.secret_ref is not None:
        volumes.append(_secret_volume(VOL_CHECKPOINT_TOKEN, ck.secret_ref.name, ck.secret_ref.key))
        mounts.append(_mount(VOL_CHECKPOINT_TOKEN, CHECKPOINT_TOKEN_DIR, read_only=True))
        if ck.is_hf:
            env.append(
                V1EnvVar(
                    name=ENV_HF_TOKEN,
                    value_from=V1EnvVarSource(
                        secret_key_ref=V1SecretKeySelector(name=ck.secret_ref.name, key=ck.secret_ref.key)
                    ),
                )
            )
    env += _user_env(ck.fetch_job.env)
    user_resources = ck.fetch_job.resources.to_api() if ck.fetch_job.resources else None
    container = V1Container(
        name=FETCH_CONTAINER,
        image=spec.image,
        command=fetch_command(spec),
        env=env,
        volume_mounts=mounts,
        security_context=_container_security_context(),
        # the last lines of a failed fetch ("policyserver fetch: error: ...") become the
        # termination message, which the operator copies into CheckpointReady
        termination_message_policy="FallbackToLogsOnError",
        resources=passthrough(V1ResourceRequirements, user_resources)
        if user_resources
        else V1ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "4Gi"}),
        image_pull_policy=spec.image_pull_policy or None,
    )
    return container, volumes


def _cache_volumes(spec: PolicyServerSpec, *, read_only: bool) -> list[V1Volume]:
    claim = V1PersistentVolumeClaimVolumeSource(claim_name=claim_name(spec), read_only=True if read_only else None)
    return [
        V1Volume(name=VOL_CACHE, persistent_volume_claim=claim),
        V1Volume(name=VOL_TMP, empty_dir=V1EmptyDirVolumeSource()),
    ]


def _colocate(
    pod_spec: V1PodSpec, pod_labels: dict[str, str], spec: PolicyServerSpec, cache_modes: Sequence[str]
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
    affinity = pod_spec.affinity or V1Affinity()
    pod_affinity = affinity.pod_affinity or V1PodAffinity()
    required = pod_affinity.required_during_scheduling_ignored_during_execution or []
    required.append(
        V1PodAffinityTerm(
            label_selector=V1LabelSelector(match_labels={LABEL_CACHE_CLAIM: claim_name(spec)}),
            topology_key=HOSTNAME_TOPOLOGY,
        )
    )
    pod_affinity.required_during_scheduling_ignored_during_execution = required
    affinity.pod_affinity = pod_affinity
    pod_spec.affinity = affinity


def _job_pod_spec(spec: PolicyServerSpec, containers: list[V1Container], volumes: list[V1Volume]) -> V1PodSpec:
    pod_spec = V1PodSpec(
        restart_policy="Never",
        security_context=_pod_security_context(),
        automount_service_account_token=False,
        enable_service_links=False,
        containers=containers,
        volumes=volumes,
    )
    _apply_scheduling(pod_spec, spec)
    return pod_spec


def _pod_metadata(
    spec: PolicyServerSpec, own_labels: dict[str, str], annotations: dict[str, str] | None = None
) -> V1ObjectMeta:
    """A pod template's metadata: podLabels/podAnnotations first, the operator's own on top."""
    merged = {**spec.pod_annotations, **(annotations or {})}
    return V1ObjectMeta(labels={**spec.pod_labels, **own_labels}, annotations=merged or None)


def build_fetch_job(spec: PolicyServerSpec, cache_modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The Job that downloads the spec's checkpoint into the shared cache claim."""
    ck = spec.checkpoint
    job_labels = {**labels(spec.name, COMPONENT_FETCH), LABEL_CHECKPOINT_KEY: ck.key}
    container, secret_volumes = _fetch_container(spec)
    # the operator reads the download's progress here (operator/observe.py), never from the pod's log
    container.command = [*(container.command or []), "--progress-port", str(FETCH_PROGRESS_PORT)]
    container.ports = [
        V1ContainerPort(name=FETCH_PROGRESS_PORT_NAME, container_port=FETCH_PROGRESS_PORT, protocol="TCP")
    ]
    pod_spec = _job_pod_spec(spec, [container], _cache_volumes(spec, read_only=False) + secret_volumes)
    pod_labels = dict(job_labels)
    _colocate(pod_spec, pod_labels, spec, spec.access_modes if cache_modes is None else cache_modes)
    job_spec = V1JobSpec(
        backoff_limit=ck.fetch_job.backoff_limit,
        ttl_seconds_after_finished=ck.fetch_job.ttl_seconds_after_finished,
        pod_failure_policy=V1PodFailurePolicy(
            rules=[
                V1PodFailurePolicyRule(
                    action="FailJob",
                    on_exit_codes=V1PodFailurePolicyOnExitCodesRequirement(
                        container_name=FETCH_CONTAINER, operator="In", values=[int(code) for code in FETCH_FATAL]
                    ),
                ),
                # a drained or preempted node is not the download's fault
                V1PodFailurePolicyRule(
                    action="Ignore",
                    on_pod_conditions=[
                        V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")
                    ],
                ),
            ]
        ),
        template=V1PodTemplateSpec(metadata=_pod_metadata(spec, pod_labels), spec=pod_spec),
        active_deadline_seconds=ck.fetch_job.active_deadline_seconds,
    )
    annotations = {ANNOTATION_CHECKPOINT_SOURCE: ck.source, **secrets_annotation(pod_spec)}
    if ck.revision is not None:
        annotations[ANNOTATION_CHECKPOINT_REVISION] = ck.revision
    return api_json(
        V1Job(
            api_version="batch/v1",
            kind="Job",
            metadata=V1ObjectMeta(
                name=Names(spec.name).job(ck.key), namespace=spec.namespace, labels=job_labels, annotations=annotations
            ),
            spec=job_spec,
        )
    )


def secret_names(pod_spec: V1PodSpec) -> list[str]:
    """The Secrets a pod spec names: secret volumes, projected secret sources, env secretKeyRef and envFrom."""
    names: set[str] = set()
    for volume in pod_spec.volumes or []:
        if volume.secret is not None and volume.secret.secret_name is not None:
            names.add(volume.secret.secret_name)
        for source in (volume.projected.sources if volume.projected else None) or []:
            if source.secret is not None and source.secret.name is not None:
                names.add(source.secret.name)
    for container in [*pod_spec.containers, *(pod_spec.init_containers or [])]:
        for env in container.env or []:
            ref = env.value_from.secret_key_ref if env.value_from else None
            if ref is not None and ref.name is not None:
                names.add(ref.name)
        for env_source in container.env_from or []:
            if env_source.secret_ref is not None and env_source.secret_ref.name is not None:
                names.add(env_source.secret_ref.name)
    return sorted(names)


def secrets_annotation(pod_spec: V1PodSpec) -> dict[str, str]:
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


def _prune_container(spec: PolicyServerSpec, keep_key: str) -> V1Container:
    return V1Container(
        name=PRUNE_CONTAINER,
        image=spec.image,
        command=prune_command(spec, keep_key),
        env=_home_env(),
        volume_mounts=[_mount(VOL_CACHE, CACHE_MOUNT_PATH), _mount(VOL_TMP, TMP_PATH)],
        security_context=_container_security_context(),
        termination_message_policy="FallbackToLogsOnError",
        resources=_small_resources(),
        image_pull_policy=spec.image_pull_policy or None,
    )


def build_gc_job(spec: PolicyServerSpec, keep_key: str, cache_modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The cleanup Job that removes old checkpoints from the shared cache once every pod serves ``keep_key``."""
    gc_labels = {**labels(spec.name, COMPONENT_CACHE_GC), LABEL_CHECKPOINT_KEY: keep_key}
    pod_spec = _job_pod_spec(spec, [_prune_container(spec, keep_key)], _cache_volumes(spec, read_only=False))
    pod_labels = dict(gc_labels)
    _colocate(pod_spec, pod_labels, spec, spec.access_modes if cache_modes is None else cache_modes)
    return api_json(
        V1Job(
            api_version="batch/v1",
            kind="Job",
            metadata=V1ObjectMeta(name=Names(spec.name).gc_job(keep_key), namespace=spec.namespace, labels=gc_labels),
            spec=V1JobSpec(
                backoff_limit=2,
                ttl_seconds_after_finished=spec.checkpoint.fetch_job.ttl_seconds_after_finished,
                template=V1PodTemplateSpec(metadata=_pod_metadata(spec, pod_labels), spec=pod_spec),
            ),
        )
    )


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
        lerobot_family=spec.policy.family,
        port=spec.service.port,
        lerobot_grpc_port=spec.service.lerobot_grpc_port,
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
        session_idle_timeout_s=rt.session_idle_timeout_seconds,
        frontend=rt.frontend.mode if rt.frontend.mode != DEFAULT_FRONTEND else None,
        frontend_processes=rt.frontend.processes if rt.frontend.processes != 1 else None,
        rtc=rt.rtc.mode if rt.rtc.mode != "off" else None,
        rtc_max_delay=rt.rtc.max_inference_delay,
        auth_token_file=f"{AUTH_TOKEN_DIR}/{TOKEN_FILE}" if spec.auth.secret_ref is not None else None,
        trust_remote_code=spec.policy.trust_remote_code,
    )
    if compile_cache:
        flags += ["--compile-cache-dir", COMPILE_CACHE_MOUNT_PATH, COMPILE_KEY_FLAG, f"{COMPILE_KEY_DIR}/{TOKEN_FILE}"]
    flags += lerobot_gpu_defaults(spec.policy.flag, rt.device, rt.extra_args)  # extraArgs may set them otherwise
    return serve_argv([*flags, *rt.extra_args])


def compile_subpath(spec: PolicyServerSpec) -> str:
    """The PolicyServer's own directory of compile artifacts on its cache volume: the only one its pods mount, so
    a PolicyServer sharing the claim (an existingClaim) can neither read nor plant another's."""
    return f"{COMPILE_CACHE_DIR}/{spec.name}"


def build_compile_key_secret(spec: PolicyServerSpec, key: str) -> dict[str, Any]:
    """The Secret of the PolicyServer's compile-artifacts key (``key``: hex, fresh from ``secrets.token_hex``).

    Created once (``Verb.CREATE``: a POST that never overwrites) and never
    read back: the operator holds no ``get`` on Secrets; owned by the
    PolicyServer, so it goes with it.  Only the server pods mount it
    (``--compile-key-file``): the fetch and cleanup Jobs, which also mount the
    cache, cannot tag an artifact the servers would load.
    """
    return api_json(
        V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=_owned_meta(spec, Names(spec.name).compile_key, COMPONENT_SERVER),
            type="Opaque",
            string_data={COMPILE_KEY_DATA: key},
        )
    )


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
    """cpu/memory requests for what resources leaves unset: per rank and per front-end process, plus the
    memory-backed /dev/shm.

    A request the user left out but bounded with a limit is left to
    Kubernetes, which takes the limit as the request.
    """
    from kubernetes.utils import parse_quantity

    ranks = spec.layout.world_size
    frontend = spec.runtime.frontend
    fronts = frontend.processes if frontend.mode != DEFAULT_FRONTEND else 0  # inline: rank 0 itself
    out: dict[str, str] = {}
    if "cpu" not in spec.resources.requests and "cpu" not in spec.resources.limits:
        cpu = parse_quantity(DEFAULT_CPU_PER_RANK) * ranks + parse_quantity(DEFAULT_CPU_PER_FRONTEND) * fronts
        out["cpu"] = str(int(cpu))
    if "memory" not in spec.resources.requests and "memory" not in spec.resources.limits:
        memory = (
            parse_quantity(DEFAULT_MEMORY_PER_RANK) * ranks
            + parse_quantity(DEFAULT_MEMORY_PER_FRONTEND) * fronts
            + parse_quantity(spec.resources.shm_size)
        )
        out["memory"] = _quantity(memory)
    return out


def _server_resources(spec: PolicyServerSpec) -> V1ResourceRequirements:
    requests = {**default_requests(spec), **spec.resources.requests}
    limits = dict(spec.resources.limits)
    if spec.gpus_per_pod:
        # extended resources: requests must equal limits; setting both states it plainly
        requests[GPU_RESOURCE] = str(spec.gpus_per_pod)
        limits[GPU_RESOURCE] = str(spec.gpus_per_pod)
    return V1ResourceRequirements(requests=requests or None, limits=limits or None)


def _apply_scheduling(pod_spec: V1PodSpec, spec: PolicyServerSpec) -> None:
    sched = spec  # the scheduling fields sit at the top level of the spec, as in a pod spec
    if sched.node_selector:
        pod_spec.node_selector = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec.tolerations = [passthrough(V1Toleration, t) for t in sched.tolerations]
    if sched.affinity:
        pod_spec.affinity = passthrough(V1Affinity, sched.affinity)
    pod_spec.priority_class_name = sched.priority_class_name or None
    pod_spec.scheduler_name = sched.scheduler_name or None
    pod_spec.service_account_name = sched.service_account_name or None
    if spec.image_pull_secrets:
        pod_spec.image_pull_secrets = [V1LocalObjectReference(name=ref.name) for ref in spec.image_pull_secrets]


def _http_probe(path: str, period: int, failures: int) -> V1Probe:
    return V1Probe(
        http_get=V1HTTPGetAction(path=path, port=PORT_NAME),
        period_seconds=period,
        timeout_seconds=3,
        failure_threshold=failures,
    )


def _server_storage(spec: PolicyServerSpec, compile_cache: bool) -> tuple[list[V1Volume], list[V1VolumeMount]]:
    """The server pod's own volumes and the server container's mounts (the verify container takes the first two):
    the checkpoints read-only, /tmp, /dev/shm, the PolicyServer's compile directory and key, the clients' token."""
    mounts = [
        _mount(VOL_CACHE, CACHE_MOUNT_PATH, read_only=True),
        _mount(VOL_TMP, TMP_PATH),
        _mount(VOL_SHM, SHM_PATH),
    ]
    if compile_cache:  # the kubelet creates the directory with the volume root's mode (group-writable: fsGroup)
        mounts.append(_mount(VOL_CACHE, COMPILE_CACHE_MOUNT_PATH, sub_path=compile_subpath(spec)))
    # perPod: the cache volume is the StatefulSet's volumeClaimTemplate, not a pod volume; the checkpoints stay
    # read-only through their mount when the volume itself is writable
    volumes = [] if spec.storage.per_pod else _cache_volumes(spec, read_only=not compile_cache)[:1]
    volumes += [
        V1Volume(name=VOL_TMP, empty_dir=V1EmptyDirVolumeSource()),
        # NCCL moves tensors between local ranks through /dev/shm; the runtime's 64 MiB default is too small
        V1Volume(name=VOL_SHM, empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.resources.shm_size)),
    ]
    if spec.auth.secret_ref is not None:
        volumes.append(_secret_volume(VOL_AUTH_TOKEN, spec.auth.secret_ref.name, spec.auth.secret_ref.key))
        mounts.append(_mount(VOL_AUTH_TOKEN, AUTH_TOKEN_DIR, read_only=True))
    if compile_cache:  # the key that authenticates the artifacts: this PolicyServer's server pods only
        volumes.append(_secret_volume(VOL_COMPILE_KEY, Names(spec.name).compile_key, COMPILE_KEY_DATA))
        mounts.append(_mount(VOL_COMPILE_KEY, COMPILE_KEY_DIR, read_only=True))
    return volumes, mounts


def _server_container(
    spec: PolicyServerSpec, serving: ServingCheckpoint, mounts: list[V1VolumeMount], *, compile_cache: bool
) -> V1Container:
    """``policyserver serve`` with its probes, drain and resources; the user's extra mounts after the operator's."""
    startup_period = 5
    return V1Container(
        name=SERVER_CONTAINER,
        image=spec.image,
        command=worker_command(spec, serving, compile_cache=compile_cache),
        ports=_container_ports(spec),
        env=_server_env(spec),
        volume_mounts=mounts + [passthrough(V1VolumeMount, m) for m in spec.volume_mounts],
        resources=_server_resources(spec),
        security_context=_container_security_context(),
        # model load + warm-up can take minutes: liveness only starts once the process answers
        startup_probe=_http_probe(
            HEALTHZ_PATH, startup_period, max(1, -(-spec.runtime.startup_timeout_seconds // startup_period))
        ),
        liveness_probe=_http_probe(HEALTHZ_PATH, 10, 3),
        readiness_probe=_http_probe(READYZ_PATH, 5, 2),
        lifecycle=V1Lifecycle(pre_stop=V1LifecycleHandler(sleep=V1SleepAction(seconds=PRESTOP_SLEEP_S))),
        termination_message_policy="FallbackToLogsOnError",
        image_pull_policy=spec.image_pull_policy or None,
    )


def _verify_container(spec: PolicyServerSpec, serving: ServingCheckpoint, mounts: list[V1VolumeMount]) -> V1Container:
    """The init container that refuses a checkpoint whose completion marker or hashes do not match."""
    return V1Container(
        name=VERIFY_CONTAINER,
        image=spec.image,
        command=[
            "policyserver",
            "checkpoint",
            "verify",
            serving.path,
            "--require-marker",
            *(["--references"] if spec.policy.type == LEROBOT else []),
            *([TRUST_REMOTE_CODE_FLAG] if spec.policy.trust_remote_code else []),
        ],
        env=_home_env(),
        volume_mounts=mounts[:2],
        security_context=_container_security_context(),
        termination_message_policy="FallbackToLogsOnError",
        resources=_small_resources(),
        image_pull_policy=spec.image_pull_policy or None,
    )


def _server_pod_spec(
    spec: PolicyServerSpec,
    serving: ServingCheckpoint,
    server: V1Container,
    verify: V1Container,
    volumes: list[V1Volume],
) -> V1PodSpec:
    """The pod around the containers: (perPod: fetch, prune) then verify as init containers, the user's volumes,
    scheduling and the pod's security."""
    volumes = volumes + [passthrough(V1Volume, v) for v in spec.volumes]
    init_containers = [verify]
    if spec.storage.per_pod:
        # one download per pod into its own claim, with the fetch Job's command (same lock and marker), then
        # the old checkpoints of this claim go: nothing else mounts it, and this pod no longer serves them
        fetch, secret_volumes = _fetch_container(spec)
        volumes += secret_volumes
        init_containers = [fetch, _prune_container(spec, serving.key), verify]
    pod_spec = V1PodSpec(
        security_context=_pod_security_context(),
        automount_service_account_token=False,
        enable_service_links=False,
        termination_grace_period_seconds=termination_grace_seconds(spec),
        init_containers=init_containers,
        containers=[server],
        volumes=volumes,
    )
    _apply_scheduling(pod_spec, spec)
    pod_spec.runtime_class_name = spec.runtime_class_name or None
    if spec.topology_spread_constraints:
        pod_spec.topology_spread_constraints = [
            passthrough(V1TopologySpreadConstraint, c) for c in spec.topology_spread_constraints
        ]
    return pod_spec


def _pod_template(
    spec: PolicyServerSpec, serving: ServingCheckpoint, cache_modes: Sequence[str] | None = None
) -> V1PodTemplateSpec:
    """The server pod: (perPod: fetch, prune) verify, then torchrun; ``cache_modes`` are the shared claim's."""
    modes = spec.access_modes if cache_modes is None else cache_modes
    compile_cache = compile_cache_writable(spec.storage.per_pod, modes)
    volumes, mounts = _server_storage(spec, compile_cache)
    server = _server_container(spec, serving, mounts, compile_cache=compile_cache)
    pod_spec = _server_pod_spec(spec, serving, server, _verify_container(spec, serving, mounts), volumes)
    annotations = {ANNOTATION_CHECKPOINT_SOURCE: serving.source}
    if serving.revision is not None:
        annotations[ANNOTATION_CHECKPOINT_REVISION] = serving.revision
    pod_labels = {**labels(spec.name, COMPONENT_SERVER), LABEL_CHECKPOINT_KEY: serving.key}
    if not spec.storage.per_pod:
        _colocate(pod_spec, pod_labels, spec, modes)
    meta = _pod_metadata(spec, pod_labels, annotations)
    template = V1PodTemplateSpec(metadata=meta, spec=pod_spec)
    meta.annotations = {**(meta.annotations or {}), ANNOTATION_TEMPLATE_HASH: template_hash(api_json(template))}
    template.metadata = meta
    return template


def build_pod_template(
    spec: PolicyServerSpec, serving: ServingCheckpoint, cache_modes: Sequence[str] | None = None
) -> dict[str, Any]:
    """The server pod: (perPod: fetch, prune) verify, then torchrun; ``cache_modes`` are the shared claim's."""
    return api_json(_pod_template(spec, serving, cache_modes))


def template_hash(template: Mapping[str, Any]) -> str:
    """A digest of everything that should roll the pods (image, runtime, checkpoint...), over the template's JSON."""
    body = copy.deepcopy(dict(template))
    body.get("metadata", {}).get("annotations", {}).pop(ANNOTATION_TEMPLATE_HASH, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def build_statefulset(
    spec: PolicyServerSpec, serving: ServingCheckpoint | None = None, cache_modes: Sequence[str] | None = None
) -> dict[str, Any]:
    serving = serving or ServingCheckpoint.of(spec)
    names = Names(spec.name)
    template = _pod_template(spec, serving, cache_modes)
    assert template.spec is not None
    sts_spec = V1StatefulSetSpec(
        replicas=spec.replicas,
        service_name=names.headless_service,
        # pods are independent replicas: start and replace them all at once, not in ordinal order
        pod_management_policy="Parallel",
        # the operator replaces pods itself (operator/rollout.py): a template edited behind its back restarts
        # nothing before it is put back, and a rollout surges instead of stopping a pod first
        update_strategy=V1StatefulSetUpdateStrategy(type="OnDelete"),
        ordinals=V1StatefulSetOrdinals(start=0),  # moved up by a rollout that retires the lowest pod (rollout.py)
        selector=V1LabelSelector(match_labels=selector_labels(spec.name)),
        template=template,
    )
    if spec.storage.per_pod:
        sts_spec.volume_claim_templates = [_claim_template(spec)]
        # a scaled-down pod's claim stays (scaling back up reuses its download); deletion follows retainOnDelete
        sts_spec.persistent_volume_claim_retention_policy = V1StatefulSetPersistentVolumeClaimRetentionPolicy(
            when_deleted="Retain" if spec.storage.retain_on_delete else "Delete", when_scaled="Retain"
        )
    return api_json(
        V1StatefulSet(
            api_version="apps/v1",
            kind="StatefulSet",
            metadata=V1ObjectMeta(
                name=names.statefulset,
                namespace=spec.namespace,
                labels={**labels(spec.name, COMPONENT_SERVER), LABEL_CHECKPOINT_KEY: serving.key},
                annotations={
                    ANNOTATION_TEMPLATE_HASH: (meta_of(template).annotations or {})[ANNOTATION_TEMPLATE_HASH],
                    **secrets_annotation(template.spec),
                },
            ),
            spec=sts_spec,
        )
    )


# --- PodDisruptionBudget ------------------------------------------------------------------


def build_pdb(spec: PolicyServerSpec) -> dict[str, Any]:
    """At most one server pod voluntarily disrupted at a time (node drains, cluster upgrades): replicas > 1 only.

    maxUnavailable, not minAvailable, so a drain still makes progress while a
    pod is unready for another reason (an eviction is allowed whenever no
    more than one pod is down) and an HPA scale-down is never blocked.
    """
    return api_json(
        V1PodDisruptionBudget(
            api_version="policy/v1",
            kind="PodDisruptionBudget",
            metadata=_owned_meta(spec, Names(spec.name).pdb, COMPONENT_SERVER),
            spec=V1PodDisruptionBudgetSpec(
                max_unavailable=PDB_MAX_UNAVAILABLE,
                selector=V1LabelSelector(match_labels=selector_labels(spec.name)),
                # a pod that never became ready (a crash loop) may be evicted: it serves nobody
                unhealthy_pod_eviction_policy="AlwaysAllow",
            ),
        )
    )


# --- Services -------------------------------------------------------------------------


def _service_ports(spec: PolicyServerSpec) -> list[V1ServicePort]:
    ports = [V1ServicePort(name=PORT_NAME, port=spec.service.port, target_port=PORT_NAME, protocol="TCP")]
    grpc_port = spec.service.lerobot_grpc_port
    if grpc_port is not None:
        ports.append(
            V1ServicePort(
                name=LEROBOT_GRPC_PORT_NAME,
                port=grpc_port,
                target_port=LEROBOT_GRPC_PORT_NAME,
                protocol="TCP",
                app_protocol="grpc",
            )
        )
    return ports


def _container_ports(spec: PolicyServerSpec) -> list[V1ContainerPort]:
    """The server container's ports: the WebSocket/HTTP one, and LeRobot's gRPC service when it is on."""
    ports = [V1ContainerPort(name=PORT_NAME, container_port=spec.service.port, protocol="TCP")]
    grpc_port = spec.service.lerobot_grpc_port
    if grpc_port is not None:
        ports.append(V1ContainerPort(name=LEROBOT_GRPC_PORT_NAME, container_port=grpc_port, protocol="TCP"))
    return ports


def build_service(spec: PolicyServerSpec) -> dict[str, Any]:
    return api_json(
        V1Service(
            api_version="v1",
            kind="Service",
            metadata=_owned_meta(spec, Names(spec.name).service, COMPONENT_SERVER, spec.service.annotations),
            spec=V1ServiceSpec(type=spec.service.type, selector=selector_labels(spec.name), ports=_service_ports(spec)),
        )
    )


def build_headless_service(spec: PolicyServerSpec) -> dict[str, Any]:
    """Per-pod DNS (``<name>-0.<name>-pods``) for the StatefulSet, including pods not ready yet."""
    return api_json(
        V1Service(
            api_version="v1",
            kind="Service",
            metadata=_owned_meta(spec, Names(spec.name).headless_service, COMPONENT_SERVER),
            spec=V1ServiceSpec(
                cluster_ip="None",
                publish_not_ready_addresses=True,
                selector=selector_labels(spec.name),
                ports=_service_ports(spec),
            ),
        )
    )


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
