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
# create each PolicyServer's compile key Secret once (a POST; an existing one is kept): never get, list, watch, update or patch, so no Secret of the namespace is read or changed; the admission policy admits only that Secret's shape
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
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
  - apiGroups:
    - ''
    apiVersions:
    - v1
    resources:
    - secrets
    operations:
    - CREATE
    - UPDATE
variables:
- name: isPod
  expression: object.kind == 'Pod'
- name: isSecret
  expression: object.kind == 'Secret'
- name: noTemplate
  expression: variables.isPod || variables.isSecret
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
  expression: 'variables.noTemplate || size(variables.allowedImages) == 0 ? [] : variables.containers.map(c, has(c.image) ? c.image : '''').filter(i, !variables.allowedImages.exists(p, i == p || (p.endsWith(''/'') && i.startsWith(p)) || ((p.endsWith('':'') || p.endsWith(''@'')) && i.startsWith(p) && !i.substring(size(p)).contains(''/'')) || (!p.endsWith(''/'') && !p.contains(''@'') && !p.substring(p.lastIndexOf(''/'') + 1).contains('':'') && (i.startsWith(p + '':'') || i.startsWith(p + ''@'')) && !i.substring(size(p)).contains(''/''))))'
validations:
- expression: variables.isPod || (has(object.metadata.labels) && "app.kubernetes.io/managed-by" in object.metadata.labels && object.metadata.labels["app.kubernetes.io/managed-by"] == "policy-operator" && "policyoperator.io/policyserver" in object.metadata.labels)
  message: the operator's ServiceAccount creates only Jobs, StatefulSets and Secrets labelled app.kubernetes.io/managed-by=policy-operator and policyoperator.io/policyserver
  reason: Forbidden
- expression: variables.isPod || (has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists_one(r, r.apiVersion.startsWith("policyoperator.io/") && r.kind == "PolicyServer" && has(r.controller) && r.controller && r.name == object.metadata.labels["policyoperator.io/policyserver"]))
  message: the operator's ServiceAccount creates only Jobs, StatefulSets and Secrets controlled by the PolicyServer their policyoperator.io/policyserver label names
  reason: Forbidden
- expression: '!variables.isSecret || (object.metadata.name == object.metadata.labels["policyoperator.io/policyserver"] + "-compile-key" && object.type == ''Opaque'' && (!has(object.data) || object.data.all(k, k == "key")) && (!has(object.stringData) || object.stringData.all(k, k == "key")))'
  message: the operator's ServiceAccount creates only Opaque Secrets named <policyserver>-compile-key holding one key, key (a PolicyServer's compile key)
  reason: Forbidden
- expression: '!variables.isPod || (request.operation == ''UPDATE'' && object.spec == oldObject.spec)'
  message: the operator's ServiceAccount never creates a pod and never changes a pod's spec (it only annotates them)
  reason: Forbidden
- expression: variables.noTemplate || variables.containers.all(c, has(c.command) && size(c.command) >= 2 && c.command[0] == "policyserver" && c.command[1] in ["fetch", "checkpoint", "serve"] && (!has(c.args) || size(c.args) == 0))
  message: every container of the operator's workloads runs `policyserver fetch|checkpoint|serve` (command, no args)
  reason: Forbidden
- expression: variables.noTemplate || variables.volumes.all(v, !has(v.awsElasticBlockStore) && !has(v.azureDisk) && !has(v.azureFile) && !has(v.cephfs) && !has(v.cinder) && !has(v.fc) && !has(v.flexVolume) && !has(v.flocker) && !has(v.gcePersistentDisk) && !has(v.gitRepo) && !has(v.glusterfs) && !has(v.hostPath) && !has(v.image) && !has(v.iscsi) && !has(v.nfs) && !has(v.photonPersistentDisk) && !has(v.portworxVolume) && !has(v.quobyte) && !has(v.rbd) && !has(v.scaleIO) && !has(v.storageos) && !has(v.vsphereVolume))
  message: the operator's workloads mount no hostPath and no other volume that reaches the node or storage by address
  reason: Forbidden
- expression: variables.noTemplate || (has(variables.podSpec.automountServiceAccountToken) && !variables.podSpec.automountServiceAccountToken)
  message: 'the operator''s workloads mount no ServiceAccount token (automountServiceAccountToken: false)'
  reason: Forbidden
- expression: variables.noTemplate || variables.volumes.all(v, !has(v.secret) || v.secret.secretName in variables.declaredSecrets) && variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || v.projected.sources.all(s, !has(s.secret) || s.secret.name in variables.declaredSecrets)) && variables.containers.all(c, (!has(c.env) || c.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef) || e.valueFrom.secretKeyRef.name in variables.declaredSecrets)) && (!has(c.envFrom) || c.envFrom.all(f, !has(f.secretRef) || f.secretRef.name in variables.declaredSecrets)))
  message: every Secret the pod template names must be listed in the workload's policyoperator.io/secrets annotation (the Secrets its PolicyServer's spec names)
  reason: Forbidden
- expression: variables.noTemplate || (!(has(variables.podSpec.hostNetwork) && variables.podSpec.hostNetwork) && !(has(variables.podSpec.hostPID) && variables.podSpec.hostPID) && !(has(variables.podSpec.hostIPC) && variables.podSpec.hostIPC) && !(has(variables.podSpec.hostUsers) && variables.podSpec.hostUsers) && !has(variables.podSpec.nodeName) && has(variables.podSpec.securityContext) && has(variables.podSpec.securityContext.runAsNonRoot) && variables.podSpec.securityContext.runAsNonRoot && (!has(variables.podSpec.securityContext.runAsUser) || variables.podSpec.securityContext.runAsUser != 0) && (!has(variables.podSpec.tolerations) || variables.podSpec.tolerations.all(t, has(t.key) && t.key != '')) && variables.containers.all(c, has(c.securityContext) && has(c.securityContext.allowPrivilegeEscalation) && !c.securityContext.allowPrivilegeEscalation && (!has(c.securityContext.privileged) || !c.securityContext.privileged) && (!has(c.securityContext.runAsUser) || c.securityContext.runAsUser != 0) && has(c.securityContext.capabilities) && !has(c.securityContext.capabilities.add) && has(c.securityContext.capabilities.drop) && 'ALL' in c.securityContext.capabilities.drop && (!has(c.ports) || c.ports.all(p, !has(p.hostPort)))))
  message: the operator's workloads share no host namespace, name no node, tolerate no taint by an empty key, run as non-root, and every container drops ALL capabilities, adds none, is not privileged, cannot escalate and opens no host port
  reason: Forbidden
- expression: variables.noTemplate || (variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || v.projected.sources.all(s, !has(s.serviceAccountToken))) && variables.volumes.all(v, !has(v.csi) || !has(v.csi.nodePublishSecretRef) || v.csi.nodePublishSecretRef.name in variables.declaredSecrets))
  message: the operator's workloads mount no projected serviceAccountToken source, and a csi volume's nodePublishSecretRef must be listed in the policyoperator.io/secrets annotation
  reason: Forbidden
- expression: 'variables.noTemplate || variables.containers.all(c, (!has(c.env) || c.env.all(e, !(e.name in [''HOME'', ''XDG_CACHE_HOME'', ''PATH'', ''HF_HUB_OFFLINE'', ''HF_HUB_CACHE'', ''HF_TOKEN'', ''HF_HOME'', ''HF_MODULES_CACHE'', ''HF_TOKEN_PATH'', ''TRANSFORMERS_CACHE'', ''TRANSFORMERS_OFFLINE'', ''BASH_ENV'', ''ENV'', ''GCONV_PATH'', ''LOCPATH'', ''CC'', ''CXX'', ''CUDA_HOME'', ''CUDA_PATH'', ''NCCL_NET_PLUGIN'', ''NCCL_TUNER_PLUGIN'', ''NCCL_PROFILER_PLUGIN'', ''NCCL_ENV_PLUGIN''] || e.name.startsWith(''PYTHON'') || e.name.startsWith(''LD_'') || e.name.startsWith(''TORCH'') || e.name.startsWith(''TRITON_'')) || (has(e.value) && (e.name + ''='' + e.value) in ["HOME=/tmp", "XDG_CACHE_HOME=/tmp/.cache", "HF_HUB_OFFLINE=1", "HF_HUB_CACHE=/models/.hub"]) || (e.name == "HF_TOKEN" && has(e.valueFrom)))) && (!has(c.volumeMounts) || c.volumeMounts.all(m, !(m.mountPath == ''/'' || ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/opt", "/src", "/root", "/home", "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.cache"].exists(r, m.mountPath == r || m.mountPath.startsWith(r + ''/'') || r.startsWith(m.mountPath.endsWith(''/'') ? m.mountPath : m.mountPath + ''/''))))))'
  message: the operator's containers set no environment name the interpreter or loader reads (HOME, XDG_CACHE_HOME, PATH, HF_HUB_OFFLINE, HF_HUB_CACHE, HF_TOKEN, HF_HOME, HF_MODULES_CACHE, HF_TOKEN_PATH, TRANSFORMERS_CACHE, TRANSFORMERS_OFFLINE, BASH_ENV, ENV, GCONV_PATH, LOCPATH, CC, CXX, CUDA_HOME, CUDA_PATH, NCCL_NET_PLUGIN, NCCL_TUNER_PLUGIN, NCCL_PROFILER_PLUGIN, NCCL_ENV_PLUGIN and every name starting with PYTHON, LD_, TORCH, TRITON_) other than the operator's own values, and mount nothing at, under or above /bin, /sbin, /lib, /lib32, /lib64, /libx32, /usr, /opt, /src, /root, /home, /etc/ld.so.preload, /etc/ld.so.conf, /etc/ld.so.conf.d, /etc/ld.so.cache
  reason: Forbidden
- expression: variables.noTemplate || variables.containers.all(c, !has(c.command) || (c.command.all(w, !w.startsWith("--to") || w == "--token-file") && size(c.command.filter(w, w == "--token-file")) <= 1 && (!("--token-file" in c.command) || "/var/run/secrets/policy-checkpoint/token" in c.command) && c.command.all(w, !w.startsWith("--compile-k") || w == "--compile-key-file") && size(c.command.filter(w, w == "--compile-key-file")) <= 1 && (!("--compile-key-file" in c.command) || "/var/run/secrets/policy-compile/token" in c.command) && (size(c.command) < 3 || c.command[1] != 'checkpoint' || c.command[2] in ['verify', 'prune'])))
  message: the operator's commands pass --token-file only once, as `--token-file /var/run/secrets/policy-checkpoint/token` and --compile-key-file only once, as `--compile-key-file /var/run/secrets/policy-compile/token` (the operator's own Secret mounts) and run `policyserver checkpoint verify|prune` only
  reason: Forbidden
- expression: size(variables.refusedImages) == 0
  message: every container's image of the operator's workloads must be one that admissionPolicy.allowedImages admits
  messageExpression: '''image '' + variables.refusedImages.join('', '') + '' is not allowed: admissionPolicy.allowedImages is ['' + variables.allowedImages.join('', '') + ''] (an entry ending in / admits the path below it; any other names one repository, tag or digest)'''
  reason: Forbidden
{{- end }}
{{- define "policy-operator.admission.authors" -}}
matchConstraints:
  resourceRules:
  - apiGroups:
    - policyoperator.io
    apiVersions:
    - '*'
    resources:
    - policyservers
    operations:
    - CREATE
    - UPDATE
matchConditions:
- name: spec-changes
  expression: request.operation == 'CREATE' || object.spec != oldObject.spec
variables:
- name: allowedServiceAccounts
  expression: {{ .Values.admissionPolicy.allowedServiceAccounts | default list | toJson | quote }}
- name: volumes
  expression: 'has(object.spec.volumes) ? object.spec.volumes : []'
- name: mounts
  expression: 'has(object.spec.volumeMounts) ? object.spec.volumeMounts : []'
- name: env
  expression: '(has(object.spec.runtime) && has(object.spec.runtime.env) ? object.spec.runtime.env : []) + (has(object.spec.checkpoint.fetchJob) && has(object.spec.checkpoint.fetchJob.env) ? object.spec.checkpoint.fetchJob.env : [])'
- name: refSecrets
  expression: '(has(object.spec.checkpoint.secretRef) ? [object.spec.checkpoint.secretRef.name] : []) + (has(object.spec.auth) && has(object.spec.auth.secretRef) ? [object.spec.auth.secretRef.name] : []) + (has(object.spec.imagePullSecrets) ? object.spec.imagePullSecrets.map(r, r.name) : [])'
- name: unreadableRefs
  expression: variables.refSecrets.filter(n, !authorizer.group('').resource('secrets').namespace(request.namespace).name(n).check('get').allowed())
- name: unreadableEnv
  expression: variables.env.filter(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef) && !authorizer.group('').resource('secrets').namespace(request.namespace).name(e.valueFrom.secretKeyRef.name).check('get').allowed()).map(e, e.name)
- name: unreadableVolumes
  expression: variables.volumes.filter(v, (has(v.secret) && has(v.secret.secretName) && !authorizer.group('').resource('secrets').namespace(request.namespace).name(v.secret.secretName).check('get').allowed()) || (has(v.projected) && has(v.projected.sources) && v.projected.sources.exists(s, has(s.secret) && has(s.secret.name) && !authorizer.group('').resource('secrets').namespace(request.namespace).name(s.secret.name).check('get').allowed())) || (has(v.csi) && has(v.csi.nodePublishSecretRef) && !authorizer.group('').resource('secrets').namespace(request.namespace).name(v.csi.nodePublishSecretRef.name).check('get').allowed())).map(v, v.name)
validations:
- expression: '!has(object.spec.serviceAccountName) || object.spec.serviceAccountName in variables.allowedServiceAccounts'
  message: 'spec.serviceAccountName: the pods run as the namespace''s default ServiceAccount unless admissionPolicy.allowedServiceAccounts lists the one named (a PolicyServer must not lend its author another identity)'
  messageExpression: '''spec.serviceAccountName: '' + object.spec.serviceAccountName + '' is not in admissionPolicy.allowedServiceAccounts ['' + variables.allowedServiceAccounts.join('', '') + '']: a PolicyServer must not lend its author the identity of another ServiceAccount'''
  reason: Forbidden
- expression: size(variables.unreadableRefs) == 0
  message: 'spec.checkpoint.secretRef, spec.auth.secretRef, spec.imagePullSecrets: a Secret the requesting user may not get themselves'
  reason: Forbidden
- expression: size(variables.unreadableEnv) == 0
  message: 'spec.runtime.env, spec.checkpoint.fetchJob.env: valueFrom.secretKeyRef of a Secret the requesting user may not get themselves'
  reason: Forbidden
- expression: size(variables.unreadableVolumes) == 0
  message: 'spec.volumes: a secret, projected secret or csi nodePublishSecretRef the requesting user may not get themselves'
  reason: Forbidden
- expression: '!variables.volumes.exists(v, (has(v.downwardAPI) && has(v.downwardAPI.items) && v.downwardAPI.items.exists(i, has(i.fieldRef) && (i.fieldRef.fieldPath.startsWith(''metadata.annotations'') || i.fieldRef.fieldPath.startsWith(''metadata.labels'')))) || (has(v.projected) && has(v.projected.sources) && v.projected.sources.exists(s, has(s.downwardAPI) && has(s.downwardAPI.items) && s.downwardAPI.items.exists(i, has(i.fieldRef) && (i.fieldRef.fieldPath.startsWith(''metadata.annotations'') || i.fieldRef.fieldPath.startsWith(''metadata.labels''))))))'
  message: 'spec.volumes: a downwardAPI file of the pod''s annotations or labels: the PolicyServer''s author writes them (podAnnotations, podLabels), and their text must not become a file the pod can be told to run'
  reason: Forbidden
- expression: variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || v.projected.sources.all(s, !has(s.serviceAccountToken)))
  message: 'spec.volumes: a projected serviceAccountToken: the pods need no API access, and a token would lend the PolicyServer''s author the ServiceAccount''s identity'
  reason: Forbidden
- expression: variables.volumes.all(v, !has(v.persistentVolumeClaim) || !(v.persistentVolumeClaim.claimName.endsWith("-cache") || v.persistentVolumeClaim.claimName.startsWith("checkpoint-cache-"))) && (!has(object.spec.storage) || !has(object.spec.storage.existingClaim) || object.spec.storage.existingClaim == object.metadata.name + "-cache" || !(object.spec.storage.existingClaim.endsWith("-cache") || object.spec.storage.existingClaim.startsWith("checkpoint-cache-")))
  message: 'spec.volumes[].persistentVolumeClaim, spec.storage.existingClaim: a claim named like a PolicyServer''s cache (<name>-cache, checkpoint-cache-*) holds another PolicyServer''s checkpoints and compile artifacts: rename your own claim'
  reason: Forbidden
- expression: '!variables.mounts.exists(m, (m.mountPath == ''/'' || ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/opt", "/src", "/root", "/home", "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.cache"].exists(r, m.mountPath == r || m.mountPath.startsWith(r + ''/'') || r.startsWith(m.mountPath.endsWith(''/'') ? m.mountPath : m.mountPath + ''/''))))'
  message: 'spec.volumeMounts: a mount at, under or above a directory the interpreter or the loader reads code from (/bin, /sbin, /lib, /lib32, /lib64, /libx32, /usr, /opt, /src, /root, /home, /etc/ld.so.preload, /etc/ld.so.conf, /etc/ld.so.conf.d, /etc/ld.so.cache)'
  reason: Forbidden
{{- end }}
{{- define "policy-operator.admission.children" -}}
paramKind:
  apiVersion: policyoperator.io/v1alpha1
  kind: PolicyServer
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
variables:
- name: isPod
  expression: object.kind == 'Pod'
- name: isSecret
  expression: object.kind == 'Secret'
- name: noTemplate
  expression: variables.isPod || variables.isSecret
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
- name: mine
  expression: '!variables.noTemplate && has(object.metadata.labels) && "policyoperator.io/policyserver" in object.metadata.labels && object.metadata.labels["policyoperator.io/policyserver"] == params.metadata.name'
- name: psVolumes
  expression: 'has(params.spec.volumes) ? params.spec.volumes : []'
- name: psEnv
  expression: '(has(params.spec.runtime) && has(params.spec.runtime.env) ? params.spec.runtime.env : []) + (has(params.spec.checkpoint.fetchJob) && has(params.spec.checkpoint.fetchJob.env) ? params.spec.checkpoint.fetchJob.env : [])'
validations:
- expression: '!variables.mine || (has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, has(r.controller) && r.controller && r.uid == params.metadata.uid))'
  message: the operator's workloads are controlled by the PolicyServer their policyoperator.io/policyserver label names (its uid)
  reason: Forbidden
- expression: '!variables.mine || variables.containers.all(c, !has(c.command) || size(c.command) < 3 || c.command[1] != ''fetch'' || c.command[2] == params.spec.checkpoint.source)'
  message: a fetch downloads the PolicyServer's own spec.checkpoint.source (its token goes to no other host)
  reason: Forbidden
- expression: '!variables.mine || variables.declaredSecrets.all(n, n == params.metadata.name + "-compile-key" || (has(params.spec.checkpoint.secretRef) && params.spec.checkpoint.secretRef.name == n) || (has(params.spec.auth) && has(params.spec.auth.secretRef) && params.spec.auth.secretRef.name == n) || variables.psVolumes.exists(v, (has(v.secret) && has(v.secret.secretName) && v.secret.secretName == n) || (has(v.projected) && has(v.projected.sources) && v.projected.sources.exists(s, has(s.secret) && has(s.secret.name) && s.secret.name == n)) || (has(v.csi) && has(v.csi.nodePublishSecretRef) && v.csi.nodePublishSecretRef.name == n)) || variables.psEnv.exists(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef) && e.valueFrom.secretKeyRef.name == n))'
  message: every Secret a workload declares (policyoperator.io/secrets) is one its PolicyServer's spec names, or its compile key
  reason: Forbidden
- expression: '!variables.mine || !has(variables.podSpec.tolerations) || variables.podSpec.tolerations.all(t, has(params.spec.tolerations) && params.spec.tolerations.exists(p, p == t))'
  message: every toleration of the operator's workloads is one its PolicyServer's spec.tolerations lists
  reason: Forbidden
- expression: '!variables.mine || variables.containers.all(c, !has(c.env) || c.env.all(e, (e.name in [''HOME'', ''XDG_CACHE_HOME'', ''PATH'', ''HF_HUB_OFFLINE'', ''HF_HUB_CACHE'', ''HF_TOKEN'', ''HF_HOME'', ''HF_MODULES_CACHE'', ''HF_TOKEN_PATH'', ''TRANSFORMERS_CACHE'', ''TRANSFORMERS_OFFLINE'', ''BASH_ENV'', ''ENV'', ''GCONV_PATH'', ''LOCPATH'', ''CC'', ''CXX'', ''CUDA_HOME'', ''CUDA_PATH'', ''NCCL_NET_PLUGIN'', ''NCCL_TUNER_PLUGIN'', ''NCCL_PROFILER_PLUGIN'', ''NCCL_ENV_PLUGIN''] || e.name.startsWith(''PYTHON'') || e.name.startsWith(''LD_'') || e.name.startsWith(''TORCH'') || e.name.startsWith(''TRITON_'')) || variables.psEnv.exists(p, p.name == e.name && (has(p.value) ? has(e.value) && p.value == e.value : !has(e.value)))))'
  message: every environment entry of the operator's workloads is the operator's own or one its PolicyServer's spec sets (runtime.env, checkpoint.fetchJob.env)
  reason: Forbidden
{{- end }}
{{/* END GENERATED: admission */}}
