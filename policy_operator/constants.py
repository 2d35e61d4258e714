"""Every name that crosses a process, pod or API boundary, in one place.

The operator writes these names into manifests and the runtime reads them back
from its environment; keeping both sides on the same constants is what makes a
rename safe.  Modelled on LeaderWorkerSet's typed constants.
"""

from __future__ import annotations

from typing import Final

# --- API ---------------------------------------------------------------------
GROUP: Final = "policyoperator.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "PolicyServer"
PLURAL: Final = "policyservers"
SINGULAR: Final = "policyserver"
SHORT_NAME: Final = "ps"

# --- Labels ------------------------------------------------------------------
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_VERSION: Final = "app.kubernetes.io/version"
LABEL_POLICYSERVER: Final = f"{GROUP}/policyserver"
LABEL_CHECKPOINT_KEY: Final = f"{GROUP}/checkpoint-key"
# every pod that mounts a ReadWriteOnce cache claim carries it; their pod affinity keeps them on one node
LABEL_CACHE_CLAIM: Final = f"{GROUP}/cache-claim"

APP_NAME: Final = "policy-server"
MANAGED_BY: Final = "policy-operator"
COMPONENT_SERVER: Final = "server"
COMPONENT_FETCH: Final = "checkpoint-fetch"
COMPONENT_CACHE: Final = "checkpoint-cache"
COMPONENT_CACHE_GC: Final = "checkpoint-gc"

# --- Annotations -------------------------------------------------------------
ANNOTATION_TEMPLATE_HASH: Final = f"{GROUP}/template-hash"
ANNOTATION_CHECKPOINT_SOURCE: Final = f"{GROUP}/checkpoint-source"
ANNOTATION_CHECKPOINT_REVISION: Final = f"{GROUP}/checkpoint-revision"
ANNOTATION_RANKS_READY: Final = f"{GROUP}/ranks-ready"
# on the StatefulSet while a rollout surges: "<template hash>/surge" (operator/rollout.py, plan_rollout)
ANNOTATION_SURGE: Final = f"{GROUP}/surge"
# on every object the operator server-side applies: a hash of the body it applied, so an unchanged object is not
# written again (operator/kube.py)
ANNOTATION_APPLIED_HASH: Final = f"{GROUP}/applied-hash"

# on the fetch Job and the StatefulSet: the Secrets their pod template names, comma-separated; the chart's
# admission policy refuses a template of the operator's ServiceAccount that names any other (operator/admission.py)
ANNOTATION_SECRETS: Final = f"{GROUP}/secrets"

# --- Conditions and phases -----------------------------------------------------
COND_VALID: Final = "Valid"
COND_CHECKPOINT_READY: Final = "CheckpointReady"
COND_AVAILABLE: Final = "Available"
COND_PROGRESSING: Final = "Progressing"
COND_STORAGE_READY: Final = "StorageReady"  # the cache claims are as the spec says (size, modes, class)
COND_READY: Final = "Ready"  # the summary Flux and Argo CD health checks read: True only when done and healthy
COND_RECONCILING: Final = "Reconciling"  # kstatus' abnormal-true conditions: True while working towards the spec ...
COND_STALLED: Final = "Stalled"  # ... and True when it cannot get there without a change (kstatus Failed)

PHASE_PENDING: Final = "Pending"
PHASE_DOWNLOADING: Final = "Downloading"
PHASE_STARTING: Final = "Starting"
PHASE_READY: Final = "Ready"
PHASE_DEGRADED: Final = "Degraded"
PHASE_FAILED: Final = "Failed"

# --- Environment variables (operator -> pod -> runtime) -------------------------
# The runtime's settings travel as `serve` flags (policy_operator/serve_flags.py), not env vars;
# these are the few variables that cross the boundary.
ENV_PORT: Final = "POLICY_PORT"
ENV_HF_TOKEN: Final = "HF_TOKEN"
ENV_HF_ENDPOINT: Final = "HF_ENDPOINT"
# server pods load from the cache only: huggingface_hub never reaches a hub, and resolves ORG/REPO in the view of the
# cache the fetch Job makes (DEST/.hub, runtime/checkpoint/references.py)
ENV_HF_HUB_OFFLINE: Final = "HF_HUB_OFFLINE"
ENV_HF_HUB_CACHE: Final = "HF_HUB_CACHE"

# --- Sampling defaults: what serve's flags default to, what the operator's spec model and the policies read --------
DEFAULT_STEPS: Final = 10  # a policy that does not name its own (Policy.default_steps)
DEFAULT_GUIDANCE: Final = 3.0  # a policy with an unconditional branch; one without gets 1.0 (no guidance)


def policy_guidance(guidance: float | None, has_unconditional: bool) -> float:
    """``--guidance`` as given, or the policy's own: DEFAULT_GUIDANCE with an unconditional branch, 1.0 without."""
    if guidance is not None:
        return guidance
    return DEFAULT_GUIDANCE if has_unconditional else 1.0


# --- Ports, paths, files --------------------------------------------------------
DEFAULT_PORT: Final = 8000  # openpi's default serve_policy port
PORT_NAME: Final = "ws"
LEROBOT_GRPC_PORT_NAME: Final = "lerobot-grpc"  # spec.service.lerobotGrpcPort on the container and the Service
CACHE_MOUNT_PATH: Final = "/models"
# <cache>/.compile: torch compile artifacts the server pods write and load (runtime/compile_cache.py), mounted
# writable at COMPILE_CACHE_MOUNT_PATH while the checkpoints stay read-only at CACHE_MOUNT_PATH
COMPILE_CACHE_DIR: Final = ".compile"
COMPILE_CACHE_MOUNT_PATH: Final = "/compile-cache"
COMPLETE_MARKER: Final = ".complete.json"
CONFIG_FILE: Final = "config.json"
WEIGHTS_FILE: Final = "model.safetensors"
MANIFEST_FILE: Final = "manifest.json"
HUB_VIEW_DIR: Final = ".hub"  # <cache>/.hub: the Hugging Face cache layout over the fetched repositories

# the fetch Job's container serves its newest progress line here (runtime/checkpoint/progress_server.py); the operator
# reads it as it reads the server pods' /readyz, so neither needs the pods' logs (pods/log)
FETCH_PROGRESS_PORT: Final = 8001
FETCH_PROGRESS_PORT_NAME: Final = "progress"
PROGRESS_PATH: Final = "/progress"
# the one program every container of the operator's Jobs and StatefulSets runs (its admission policy checks it)
ENTRYPOINT: Final = "policyserver"

HEALTHZ_PATH: Final = "/healthz"
READYZ_PATH: Final = "/readyz"
METRICS_PATH: Final = "/metrics"

# --- Resources -------------------------------------------------------------------
GPU_RESOURCE: Final = "nvidia.com/gpu"

# --- Operator (PolicyServer reconciler) --------------------------------------------
FINALIZER: Final = f"{GROUP}/finalizer"
FIELD_MANAGER: Final = MANAGED_BY  # server-side apply: the fields the operator owns on its children
PEERING_NAME: Final = "policy-operator"
ANNOTATION_LAST_HANDLED: Final = f"{GROUP}/last-handled-configuration"
SECRET_TOKEN_KEY: Final = "token"  # key of the Secrets named by checkpoint.secretRef / auth.secretRef
CHECKPOINT_TOKEN_DIR: Final = "/var/run/secrets/policy-checkpoint"
AUTH_TOKEN_DIR: Final = "/var/run/secrets/policy-auth"
LABEL_JOB_NAME: Final = "batch.kubernetes.io/job-name"  # set by the Job controller on its pods
ENV_HOME: Final = "HOME"  # pointed at the writable /tmp: the root filesystem is read-only
ENV_XDG_CACHE_HOME: Final = "XDG_CACHE_HOME"
ENV_HOST: Final = "POLICY_HOST"  # default of the runtime's --host (0.0.0.0 when unset)
# prometheus_client's own: the front-end processes keep their metrics there, and any of them answers /metrics
# for all (read when prometheus_client is imported, so set at the process's start)
ENV_PROMETHEUS_MULTIPROC_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"

# --- Labels the Kubernetes controllers put on the pods they create ---
LABEL_CONTROLLER_REVISION_HASH: Final = "controller-revision-hash"  # the StatefulSet controller's template revision
ENV_LOCAL_NODE_CONTAINER: Final = (
    "LOCAL_NODE_CONTAINER"  # test support: marks every process of one local-node container
)
