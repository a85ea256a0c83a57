{{/*
The chart name, or nameOverride; at most 63 characters (a label value).
*/}}
{{- define "preshard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's resources: fullnameOverride, or "<release>-<name>", or the release
name alone when it already contains the chart name. At most 63 characters (a DNS label).
*/}}
{{- define "preshard.fullname" -}}
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

{{/*
"<chart>-<version>", for the helm.sh/chart label.
*/}}
{{- define "preshard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every resource the chart creates.
*/}}
{{- define "preshard.labels" -}}
helm.sh/chart: {{ include "preshard.chart" . }}
{{ include "preshard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: preshard
{{- end }}

{{/*
The labels that select the operator's pod; they never change across upgrades.
*/}}
{{- define "preshard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "preshard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The operator's ServiceAccount: the one the chart creates, or the one named in the values.
*/}}
{{- define "preshard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "preshard.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}: the digest wins, the tag defaults to the
chart's appVersion. Call with (dict "image" <values> "context" $).
*/}}
{{- define "preshard.imageRef" -}}
{{- $tag := .image.tag | default .context.Chart.AppVersion }}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules, for a ClusterRole (whole cluster) or a Role (one watched namespace).
Each rule says why the operator needs it. There is no rule for Secrets: the operator never reads
them; only the Jobs and Deployments it creates or patches reference them, by name.
*/}}
{{- define "preshard.rules" -}}
# Follow ShardedModels; the operator framework patches its finalizer and bookkeeping
# annotations onto them.
- apiGroups: ["preshard.dev"]
  resources: ["shardedmodels"]
  verbs: ["get", "list", "watch", "patch"]
# Report conditions, shard sets and targets.
- apiGroups: ["preshard.dev"]
  resources: ["shardedmodels/status"]
  verbs: ["patch"]
# Jobs name their ShardedModel as owner with blockOwnerDeletion; clusters that enforce owner
# reference permissions (OwnerReferencesPermissionEnforcement) require this for that.
- apiGroups: ["preshard.dev"]
  resources: ["shardedmodels/finalizers"]
  verbs: ["update"]
# Run the serialize, verify and delete Jobs, and remove finished or superseded ones.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Read the outcome of each Job from its pod's termination message, and see whether the pods
# of a patched Deployment crash or never become ready.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Read the last lines of a running serialize or reshard Job's log for its progress (the
# operator reads no Secret and no S3; the data plane's logs redact credentials).
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Point target vLLM Deployments at their shard set, and restore them when the ShardedModel
# goes. The operator never creates or deletes Deployments and never changes replicas.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "patch"]
# Record what happens as events on the ShardedModel.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
The metrics Service: "<fullname>-metrics", at most 63 characters.
*/}}
{{- define "preshard.metricsServiceName" -}}
{{- printf "%s-metrics" (include "preshard.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}
