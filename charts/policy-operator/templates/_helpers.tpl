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
The operator's API access, copied from policy_operator.operator.rbac.RULES
(tests/test_chart.py fails when the two differ in either direction).
"namespaced": what a Role in each watched namespace grants.
*/}}
{{- define "policy-operator.rules.namespaced" -}}
- apiGroups: [policyoperator.io]
  resources: [policyservers]
  verbs: [get, list, watch, patch]
- apiGroups: [policyoperator.io]
  resources: [policyservers/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, patch]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch, list]
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}

{{/* "cluster": what --all-namespaces needs on top (cluster-scoped objects kopf reads in that mode). */}}
{{- define "policy-operator.rules.cluster" -}}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
- apiGroups: [storage.k8s.io]
  resources: [storageclasses]
  verbs: [get]
{{- end }}
