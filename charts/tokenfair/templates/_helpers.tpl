{{/*
Expand the name of the chart.
*/}}
{{- define "tokenfair.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "tokenfair.fullname" -}}
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
Create chart name and version as used by the chart label.
*/}}
{{- define "tokenfair.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "tokenfair.labels" -}}
helm.sh/chart: {{ include "tokenfair.chart" . }}
{{ include "tokenfair.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels (never the version: a Deployment's selector is immutable).
*/}}
{{- define "tokenfair.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenfair.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "tokenfair.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenfair.operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator's objects: its name, and its selector labels (the common ones plus the component).
*/}}
{{- define "tokenfair.operator.fullname" -}}
{{- printf "%s-operator" (include "tokenfair.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenfair.operator.selectorLabels" -}}
{{ include "tokenfair.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
The image of the operator, the demo's model server and injected sidecars (one image, two
entrypoints): `repository@digest` when image.digest is set, else `repository:tag`, the tag
defaulting to the chart's appVersion.
*/}}
{{- define "tokenfair.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The restricted Pod Security Standard, for every container of the chart.
*/}}
{{- define "tokenfair.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "tokenfair.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurityContext.runAsUser }}
runAsGroup: {{ .Values.podSecurityContext.runAsGroup }}
fsGroup: {{ .Values.podSecurityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
The webhook's serving Secret (written by cert-manager, or by the operator without it) and the
Certificate that fills it.
*/}}
{{- define "tokenfair.webhook.secretName" -}}
{{- printf "%s-webhook-tls" (include "tokenfair.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenfair.webhook.certificateName" -}}
{{- printf "%s-webhook" (include "tokenfair.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Refuse value combinations the chart cannot honour, with the reason.
*/}}
{{- define "tokenfair.validate" -}}
{{- $chartEnv := list "TOKENFAIR_RESYNC_SECONDS" "TOKENFAIR_USAGE_SECONDS" "PYTHONUNBUFFERED" "TOKENFAIR_HTTP_PORT" "TOKENFAIR_HTTPS_PORT" "TOKENFAIR_HTTPS_CA" "TOKENFAIR_LEADER_ELECTION" "TOKENFAIR_LEASE_NAMESPACE" "TOKENFAIR_LEASE_NAME" "TOKENFAIR_CONFIG_URL_BASE" }}
{{- range .Values.operator.extraEnv }}
{{- if or (has .name $chartEnv) (hasPrefix "TOKENFAIR_SIDECAR_" .name) (hasPrefix "TOKENFAIR_WEBHOOK_" .name) }}
{{- fail (printf "operator.extraEnv: %s is set by the chart itself; change it through its value (docs/deploy.md)" .name) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Namespaces in which the operator may get/create/update Secrets (a JSON list): operator.
secretNamespaces, else operator.watchNamespaces, else the release namespace; plus the demo's.
*/}}
{{- define "tokenfair.secretNamespaces" -}}
{{- $namespaces := .Values.operator.secretNamespaces | default .Values.operator.watchNamespaces | default (list .Release.Namespace) }}
{{- if .Values.demo.enabled }}
{{- $namespaces = append $namespaces .Release.Namespace }}
{{- end }}
{{- $namespaces | uniq | toJson }}
{{- end }}

{{/*
Kopf's logging flags for operator.logLevel (Kopf logs at INFO without a flag, DEBUG with
--debug, WARNING with --quiet) and operator.logFormat.
*/}}
{{- define "tokenfair.operator.logArgs" -}}
{{- $args := list }}
{{- if eq .Values.operator.logLevel "debug" }}{{ $args = append $args "--debug" }}{{ end }}
{{- if eq .Values.operator.logLevel "warning" }}{{ $args = append $args "--quiet" }}{{ end }}
{{- $args = append $args (printf "--log-format=%s" .Values.operator.logFormat) }}
{{- toYaml $args }}
{{- end }}

{{/*
The webhook's certificate is the operator's own (no cert-manager): it keeps a CA and a serving
certificate in the webhook Secret and sets the webhook configurations' caBundle.
*/}}
{{- define "tokenfair.webhook.ownCertificate" -}}
{{- if and .Values.webhook.enabled (not .Values.certManager.enabled) }}true{{ end }}
{{- end }}

{{/*
The webhook Service's DNS names, as the API server may call it (the serving certificate's SANs).
*/}}
{{- define "tokenfair.webhook.dnsNames" -}}
{{- $service := include "tokenfair.operator.fullname" . -}}
{{ $service }},{{ $service }}.{{ .Release.Namespace }},{{ $service }}.{{ .Release.Namespace }}.svc,{{ $service }}.{{ .Release.Namespace }}.svc.cluster.local
{{- end }}
