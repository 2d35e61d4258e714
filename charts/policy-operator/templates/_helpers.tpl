{{/*
Names, labels, image and RBAC rules of the policy-operator chart, in one place.
*/}}

{{- define "policy-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RELEASE-policy-operator, or RELEASE alone when it already contains the chart name. */}}
{{- define "policy-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "policy-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The immutable labels: the Deployment selector uses exactly these. */}}
{{- define "policy-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "policy-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "policy-operator.releaseLabels" -}}
helm.sh/chart: {{ include "policy-operator.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: policy-server
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels of every object of the operator itself. */}}
{{- define "policy-operator.labels" -}}
{{ include "policy-operator.selectorLabels" . }}
{{ include "policy-operator.releaseLabels" . }}
{{- end }}

{{/* Labels of the sample PolicyServer: same release, its own component. */}}
{{- define "policy-operator.sampleLabels" -}}
app.kubernetes.io/name: {{ include "policy-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: sample
{{ include "policy-operator.releaseLabels" . }}
{{- end }}

{{- define "policy-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "policy-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* REPOSITORY:TAG or REPOSITORY@DIGEST; the tag defaults to the chart's appVersion. */}}
{{- define "policy-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The namespaces the operator reconciles in namespaced mode, as a JSON list. */}}
{{- define "policy-operator.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}
{{- toJson (uniq .Values.watchNamespaces) }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/*
The operator's API access: "namespaced" is what a Role in each watched namespace grants, "cluster" what
--all-namespaces needs on top (cluster-scoped objects kopf reads in that mode).
*/}}
{{/* BEGIN GENERATED: rbac (make crd, from policy_operator/operator/rbac.py RULES: edit that list, not this) */}}
{{- define "policy-operator.rules.namespaced" -}}
# watch PolicyServers; kopf patches its finalizer and progress annotations
- apiGroups: [policyoperator.io]
  resources: [policyservers]
  verbs: [get, list, watch, patch]
# write status (phase, conditions, per-rank readiness)
- apiGroups: [policyoperator.io]
  resources: [policyservers/status]
  verbs: [get, patch]
# create the checkpoint cache (server-side apply); adopt/release it as retainOnDelete changes; grow it (and list and grow the per-pod claims of storage.mode perPod) when storage.size increases; watch them, so a pass at rest reads nothing from the API (operator/informer.py)
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch]
# create the fetch and cleanup Jobs (a server-side apply: PATCH that creates) and react to their completion; delete a finished fetch Job before a cleanup may remove its checkpoint
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# run, roll and scale the server pods; react to their rollout
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch]
# server-side apply the ClusterIP and headless Services every pass (drift is put back); watch them
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
# server-side apply the PodDisruptionBudget while replicas > 1; delete it below that; watch them
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# find server pods to poll /readyz, read fetch pods' termination messages, annotate rank readiness; replace a server pod in a rollout (the StatefulSet's updateStrategy is OnDelete); delete the pods of completed fetch and cleanup Jobs (they would keep a deleted cache claim alive)
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch, delete]
# read the last progress line of the running fetch pod's log (status.checkpoint.progress)
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# post Events on every transition (kopf.event); list the Job's and StatefulSet's FailedCreate Events (a pod refused by a ResourceQuota, PodSecurity or a missing PriorityClass) to say so in status
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch, list]
# leader election between operator replicas (kopf peering, namespaced)
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- define "policy-operator.rules.cluster" -}}
# leader election between operator replicas (kopf peering, cluster-wide)
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
# kopf follows namespaces when watching all of them
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
# kopf notices CRD changes when watching all namespaces
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
# read allowVolumeExpansion before growing a cache claim (without it, a namespaced operator lets the apiserver's resize admission decide)
- apiGroups: [storage.k8s.io]
  resources: [storageclasses]
  verbs: [get]
{{- end }}
{{/* END GENERATED: rbac */}}
