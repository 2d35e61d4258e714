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
# find server pods to poll /readyz and the running fetch pod to poll /progress, read fetch pods' termination messages, annotate rank readiness; replace a server pod in a rollout (the StatefulSet's updateStrategy is OnDelete); delete the pods of completed fetch and cleanup Jobs (they would keep a deleted cache claim alive)
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch, delete]
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

{{/*
The spec of the admission policy that keeps the operator's ServiceAccount to the workloads the operator makes
(admission-policy.yaml adds the matchCondition on that ServiceAccount).
*/}}
{{/* BEGIN GENERATED: admission (make crd, from policy_operator/operator/admission.py: edit that, not this) */}}
{{- define "policy-operator.admission.spec" -}}
matchConstraints:
  resourceRules:
  - apiGroups:
    - batch
    apiVersions:
    - v1
    resources:
    - jobs
    operations:
    - CREATE
    - UPDATE
  - apiGroups:
    - apps
    apiVersions:
    - v1
    resources:
    - statefulsets
    operations:
    - CREATE
    - UPDATE
  - apiGroups:
    - ''
    apiVersions:
    - v1
    resources:
    - pods
    operations:
    - CREATE
    - UPDATE
variables:
- name: isPod
  expression: object.kind == 'Pod'
- name: template
  expression: 'variables.isPod ? object : object.spec.template'
- name: podSpec
  expression: variables.template.spec
- name: containers
  expression: 'variables.podSpec.containers + (has(variables.podSpec.initContainers) ? variables.podSpec.initContainers : [])'
- name: volumes
  expression: 'has(variables.podSpec.volumes) ? variables.podSpec.volumes : []'
- name: declaredSecrets
  expression: 'has(object.metadata.annotations) && "policyoperator.io/secrets" in object.metadata.annotations ? object.metadata.annotations["policyoperator.io/secrets"].split('','') : []'
- name: allowedImages
  expression: {{ .Values.admissionPolicy.allowedImages | default list | toJson | quote }}
- name: refusedImages
  expression: 'variables.isPod || size(variables.allowedImages) == 0 ? [] : variables.containers.map(c, has(c.image) ? c.image : '''').filter(i, !variables.allowedImages.exists(p, i == p || (p.endsWith(''/'') && i.startsWith(p)) || ((p.endsWith('':'') || p.endsWith(''@'')) && i.startsWith(p) && !i.substring(size(p)).contains(''/'')) || (!p.endsWith(''/'') && !p.contains(''@'') && !p.substring(p.lastIndexOf(''/'') + 1).contains('':'') && (i.startsWith(p + '':'') || i.startsWith(p + ''@'')) && !i.substring(size(p)).contains(''/''))))'
validations:
- expression: variables.isPod || (has(object.metadata.labels) && "app.kubernetes.io/managed-by" in object.metadata.labels && object.metadata.labels["app.kubernetes.io/managed-by"] == "policy-operator" && "policyoperator.io/policyserver" in object.metadata.labels)
  message: the operator's ServiceAccount creates only Jobs and StatefulSets labelled app.kubernetes.io/managed-by=policy-operator and policyoperator.io/policyserver
  reason: Forbidden
- expression: variables.isPod || (has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists_one(r, r.apiVersion.startsWith("policyoperator.io/") && r.kind == "PolicyServer" && has(r.controller) && r.controller && r.name == object.metadata.labels["policyoperator.io/policyserver"]))
  message: the operator's ServiceAccount creates only Jobs and StatefulSets controlled by the PolicyServer their policyoperator.io/policyserver label names
  reason: Forbidden
- expression: '!variables.isPod || (request.operation == ''UPDATE'' && object.spec == oldObject.spec)'
  message: the operator's ServiceAccount never creates a pod and never changes a pod's spec (it only annotates them)
  reason: Forbidden
- expression: variables.isPod || variables.containers.all(c, has(c.command) && size(c.command) >= 2 && c.command[0] == "policyserver" && c.command[1] in ["fetch", "checkpoint", "serve"] && (!has(c.args) || size(c.args) == 0))
  message: every container of the operator's workloads runs `policyserver fetch|checkpoint|serve` (command, no args)
  reason: Forbidden
- expression: variables.isPod || variables.volumes.all(v, !has(v.awsElasticBlockStore) && !has(v.azureDisk) && !has(v.azureFile) && !has(v.cephfs) && !has(v.cinder) && !has(v.fc) && !has(v.flexVolume) && !has(v.flocker) && !has(v.gcePersistentDisk) && !has(v.gitRepo) && !has(v.glusterfs) && !has(v.hostPath) && !has(v.image) && !has(v.iscsi) && !has(v.nfs) && !has(v.photonPersistentDisk) && !has(v.portworxVolume) && !has(v.quobyte) && !has(v.rbd) && !has(v.scaleIO) && !has(v.storageos) && !has(v.vsphereVolume))
  message: the operator's workloads mount no hostPath and no other volume that reaches the node or storage by address
  reason: Forbidden
- expression: variables.isPod || (has(variables.podSpec.automountServiceAccountToken) && !variables.podSpec.automountServiceAccountToken)
  message: 'the operator''s workloads mount no ServiceAccount token (automountServiceAccountToken: false)'
  reason: Forbidden
- expression: variables.isPod || variables.volumes.all(v, !has(v.secret) || v.secret.secretName in variables.declaredSecrets) && variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || v.projected.sources.all(s, !has(s.secret) || s.secret.name in variables.declaredSecrets)) && variables.containers.all(c, (!has(c.env) || c.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef) || e.valueFrom.secretKeyRef.name in variables.declaredSecrets)) && (!has(c.envFrom) || c.envFrom.all(f, !has(f.secretRef) || f.secretRef.name in variables.declaredSecrets)))
  message: every Secret the pod template names must be listed in the workload's policyoperator.io/secrets annotation (the Secrets its PolicyServer's spec names)
  reason: Forbidden
- expression: size(variables.refusedImages) == 0
  message: every container's image of the operator's workloads must be one that admissionPolicy.allowedImages admits
  messageExpression: '''image '' + variables.refusedImages.join('', '') + '' is not allowed: admissionPolicy.allowedImages is ['' + variables.allowedImages.join('', '') + ''] (an entry ending in / admits the path below it; any other names one repository, tag or digest)'''
  reason: Forbidden
{{- end }}
{{/* END GENERATED: admission */}}
