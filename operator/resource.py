"""The whole PolicyServer resource as one typed model: apiVersion, kind, metadata, spec and status.

``crd.py`` generates the CRD's ``openAPIV3Schema`` from ``PolicyServer``, so the
status the operator writes (``status.py``) has a schema written once too: the
apiserver prunes any field of a status that is not declared here, which is how
a status field silently disappears on a real cluster.  The status models are
closed like the spec's, so ``PolicyServerStatus.model_validate`` of what
``status.build_status`` returns fails on such a field in the tests.  No status
field is required: a status an older operator wrote must stay writable.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from policy_operator.constants import (
    API_VERSION,
    KIND,
    PHASE_DEGRADED,
    PHASE_DOWNLOADING,
    PHASE_FAILED,
    PHASE_PENDING,
    PHASE_READY,
    PHASE_STARTING,
)
from policy_operator.operator.conditions import MAX_CONDITION_MESSAGE, MAX_REASON, REASON_PATTERN
from policy_operator.operator.download_state import CheckpointPhase
from policy_operator.operator.kube_model import KubeModel, list_map
from policy_operator.operator.spec import ObjectMeta, PolicyServerSpec

PHASES = (PHASE_PENDING, PHASE_DOWNLOADING, PHASE_STARTING, PHASE_READY, PHASE_DEGRADED, PHASE_FAILED)


class RankStatus(KubeModel):
    """One rank of a pod, from the pod's /readyz."""

    rank: int | None = None
    """Global rank in the pod (dp_index x cfgp + cfg_index)."""
    dp_index: int | None = None
    """Data-parallel replica the rank belongs to."""
    cfg_index: int | None = None
    """0: conditional branch (and the replica's driver), 1: unconditional branch (cfgp=2)."""
    state: str | None = None
    """The rank's state as /readyz reports it (loading, warming, serving...)."""
    ready: bool | None = None
    """Whether the rank is alive and warm."""


class PodStatus(KubeModel):
    """Rank readiness of one server pod."""

    name: str | None = None
    """Pod name."""
    pod_ip: str | None = Field(None, alias="podIP")
    """Pod IP, once it has one."""
    phase: str | None = None
    """The pod's phase (Pending, Running...)."""
    ready: bool | None = None
    """Whether /readyz reports every rank ready."""
    ranks_ready: str | None = None
    """Ranks ready / world size, e.g. 1/2."""
    message: str | None = None
    """Why the pod is not ready, e.g. "1/2 ranks ready (rank 1 loading)", "verify-checkpoint: CrashLoopBackOff:
    ...", "/readyz unreachable: ..."."""
    ranks_known: bool | None = None
    """false when the operator could not reach the pod's /readyz (a NetworkPolicy, a mesh in STRICT mTLS): ready is
    then the kubelet's Ready condition and the per-rank detail is unknown; absent when /readyz answered."""
    revision: str | None = None
    """The StatefulSet revision (controller-revision-hash) the pod runs."""
    ranks: list[RankStatus] = Field(default_factory=list)
    """One entry per rank."""


class DownloadProgress(KubeModel):
    """Progress of the running fetch, from the last progress line of the fetch pod's log (pods/log)."""

    bytes_done: int | None = None
    """Bytes of the checkpoint on the cache volume so far, including those of an earlier attempt."""
    bytes_total: int | None = None
    """Size of the checkpoint in bytes, when the source says."""
    bytes_per_second: int | None = None
    """Download rate over the current attempt."""
    text: str | None = None
    """The three as one line, e.g. 1.2 GiB / 3.4 GiB (35.0%) 12.3 MB/s (printer column PROGRESS)."""


class CheckpointStatus(KubeModel):
    """The checkpoint the spec asks for: cache directory /models/<key>, fetch Job <name>-fetch-<key>."""

    key: str | None = None
    """Cache key: a hash of (source, revision)."""
    source: str | None = None
    """checkpoint.source of the spec."""
    revision: str | None = None
    """checkpoint.revision of the spec."""
    path: str | None = None
    """Directory of the checkpoint inside the pods, /models/<key>."""
    job_name: str | None = None
    """Name of the fetch Job."""
    phase: CheckpointPhase | None = Field(None, strict=False)  # the enum, or its value as JSON has it
    """Where the download stands (printer column CHECKPOINT)."""
    message: str | None = None
    """The attempt count, or the fetch's own error line."""
    progress: DownloadProgress | None = None
    """Bytes done, total and rate while the fetch Job downloads; absent otherwise."""
    serving_key: str | None = None
    """Key of the checkpoint the pods load; it differs from key while a new checkpoint downloads, because the old
    one keeps serving until then."""
    claim_uid: str | None = None
    """uid of the cache claim the download landed on: a claim deleted and made again is empty, and the checkpoint
    is fetched again."""


class BatchingStatus(KubeModel):
    """How the pods batch under spec.runtime.batching.latencyBudgetMs, as the newest ready pod's /readyz says."""

    max_batch: int | None = None
    """The largest batch the pods form: the largest bucket whose measured time fits the budget (1 when none
    does), at most spec.runtime.batching.maxBatch (printer column MAXBATCH, in -o wide)."""
    buckets_ms: dict[str, float] | None = None
    """Warm-up's time of one batch of each bucket size in milliseconds, keyed by the size, e.g. {"1": 14.5, "2":
    15.1, "4": 16.8, "8": 19.9}; the same times as /metrics' policy_batch_bucket_seconds."""
    pod: str | None = None
    """The pod that measured them."""


# metav1.Condition's own validation, as Kubernetes' generated CRDs state it
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)


class Condition(KubeModel):
    """One condition (metav1.Condition), e.g. Ready, Reconciling, Stalled, Valid, CheckpointReady, Available or
    Progressing (docs/operator.md#conditions)."""

    type: Annotated[str, Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)]
    """Condition type (the list's key)."""
    status: Literal["True", "False", "Unknown"]
    """Condition status."""
    reason: Annotated[str, Field(min_length=1, max_length=MAX_REASON, pattern=REASON_PATTERN)]
    """CamelCase reason of the last change."""
    message: Annotated[str, Field(max_length=MAX_CONDITION_MESSAGE)]
    """Human-readable details."""
    last_transition_time: Annotated[str, Field(json_schema_extra={"format": "date-time"})]
    """When the status last flipped."""
    observed_generation: int | None = Field(None, ge=0)
    """metadata.generation the condition describes."""


class PolicyServerStatus(KubeModel):
    """Observed state, written by the operator through the status subresource."""

    observed_generation: int | None = None
    """metadata.generation this status describes."""
    phase: Literal[PHASES] | None = None  # type: ignore[valid-type]
    """Pending (objects being created, scaled to zero, or pods refused/unschedulable), Downloading (fetch Job
    running), Starting (pods starting or rolling), Ready (the rollout is done and every pod has every rank ready),
    Degraded (serving with fewer ready pods than desired),
    Failed (invalid spec, download failed or progress deadline exceeded with nothing serving);
    docs/operator.md#phase."""
    replicas: int | None = None
    """Pods that exist (the scale subresource's status replicas)."""
    ready_replicas: int | None = None
    """Pods whose /readyz reports every rank ready (the kubelet's Ready where /readyz is unreachable)."""
    updated_replicas: int | None = None
    """Pods that run the StatefulSet's current template (the current spec)."""
    updated_ready_replicas: int | None = None
    """Ready pods that run the current spec; phase Ready needs spec.replicas of them and a finished rollout."""
    ready: str | None = None
    """readyReplicas/spec.replicas as text, e.g. 2/2 (printer column READY)."""
    ranks_ready: str | None = None
    """Ranks ready across pods / replicas x cfgp x dp, e.g. 4/4 (printer column RANKS)."""
    layout: str | None = None
    """The parallel layout, e.g. cfgp=2,dp=1."""
    selector: str | None = None
    """Label selector of the server pods (for the scale subresource and HPAs)."""
    endpoint: str | None = None
    """WebSocket URL of the Service, ws://NAME.NAMESPACE.svc:PORT, once the Service exists."""
    lerobot_grpc_endpoint: str | None = None
    """Address of LeRobot's AsyncInference gRPC service, NAME.NAMESPACE.svc:PORT (robot_client's --server_address),
    once the Service exists and spec.service.lerobotGrpcPort is set."""
    template_hash: str | None = None
    """Hash of the pod template the StatefulSet runs (annotation policyoperator.io/template-hash)."""
    last_progress_time: Annotated[str, Field(json_schema_extra={"format": "date-time"})] | None = None
    """While pods start or roll: when the rollout last moved (a new spec, a pod created or ready on it);
    spec.progressDeadlineSeconds counts from here. Absent otherwise."""
    checkpoint: CheckpointStatus | None = None
    """The checkpoint the spec asks for."""
    pods: list[PodStatus] = Field(default_factory=list)
    """Per-pod rank readiness from each pod's /readyz."""
    batching: BatchingStatus | None = None
    """Measured batch times and the max batch they allow, under spec.runtime.batching.latencyBudgetMs; absent
    without a budget or before a pod is ready."""
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=list_map("type"))
    """Ready (what Flux and Argo CD health checks read), Reconciling and Stalled (what kstatus reads), Valid,
    CheckpointReady, Available and Progressing."""


class PolicyServer(KubeModel):
    """PolicyServer serves one robot action policy checkpoint over the openpi WebSocket protocol. The operator
    downloads the checkpoint once into a shared volume, then runs `replicas` pods, each a torchrun job of
    cfgp x dp ranks (one GPU per rank), behind one Service."""

    api_version: Literal[API_VERSION] = API_VERSION  # type: ignore[valid-type]
    """APIVersion of this representation of the object."""
    kind: Literal[KIND] = KIND  # type: ignore[valid-type]
    """Kind of the object."""
    metadata: ObjectMeta | None = None
    """Standard object metadata."""
    spec: PolicyServerSpec
    """Desired state of the policy server."""
    status: PolicyServerStatus | None = None
    """Observed state, written by the operator."""
