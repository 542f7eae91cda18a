{{/* Names and labels, the usual helm create conventions. */}}
{{- define "ckptkeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ckptkeeper.fullname" -}}
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

{{- define "ckptkeeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ckptkeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ckptkeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ckptkeeper.labels" -}}
helm.sh/chart: {{ include "ckptkeeper.chart" . }}
{{ include "ckptkeeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: node-agent
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ckptkeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ckptkeeper.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ckptkeeper.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "ckptkeeper.priorityClassName" -}}
{{- if .Values.priorityClass.create }}
{{- default (include "ckptkeeper.fullname" .) .Values.priorityClassName }}
{{- else }}
{{- .Values.priorityClassName }}
{{- end }}
{{- end }}

{{/* The tiers, fastest first, as the JSON list CKPTKEEPER_TIERS holds. Local tiers are mounted at
their node path, so the url is that path. */}}
{{- define "ckptkeeper.tiers" -}}
{{- $tiers := list }}
{{- $hot := deepCopy (.Values.hot.config | default dict) }}
{{- $_ := set $hot "name" .Values.hot.name }}
{{- $_ := set $hot "url" .Values.hot.hostPath }}
{{- $tiers = append $tiers $hot }}
{{- if .Values.warm.enabled }}
{{- $warm := deepCopy (.Values.warm.config | default dict) }}
{{- $_ := set $warm "name" .Values.warm.name }}
{{- $_ := set $warm "url" .Values.warm.hostPath }}
{{- $tiers = append $tiers $warm }}
{{- end }}
{{- if .Values.cold.enabled }}
{{- $cold := deepCopy (.Values.cold.config | default dict) }}
{{- $_ := set $cold "name" .Values.cold.name }}
{{- $_ := set $cold "url" .Values.cold.url }}
{{- if .Values.cold.storageOptions }}
{{- $_ := set $cold "storage_options" .Values.cold.storageOptions }}
{{- end }}
{{- $tiers = append $tiers $cold }}
{{- end }}
{{- toJson $tiers }}
{{- end }}

{{/* The daemon section: the user's keys plus what the pod needs (probes and scraping reach the
pod's IP; logs go to stdout, the container's log). */}}
{{- define "ckptkeeper.daemonConfig" -}}
{{- $daemon := deepCopy (.Values.config.daemon | default dict) }}
{{- $addr := .Values.metrics.bindAddress }}
{{- if contains ":" $addr }}{{ $addr = printf "[%s]" $addr }}{{ end }}
{{- $_ := set $daemon "metrics_addr" (printf "%s:%d" $addr (int .Values.metrics.port)) }}
{{- $_ := set $daemon "log_stream" "stdout" }}
{{- toJson $daemon }}
{{- end }}
