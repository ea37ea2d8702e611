{{/* The chart's name (nameOverride) and the objects' full name (fullnameOverride), as in
     `helm create`. */}}
{{- define "ckptwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ckptwatch.fullname" -}}
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

{{/* The scrape job name is set to "ckptwatch" by the monitors' relabelings (the alert rules
     match up{job="ckptwatch"}), whatever nameOverride makes of app.kubernetes.io/name. */}}
{{- define "ckptwatch.labels" -}}
app.kubernetes.io/name: {{ include "ckptwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: ckptwatch
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "ckptwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ckptwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "ckptwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-agent" (include "ckptwatch.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ckptwatch.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "ckptwatch.monitoringNamespace" -}}
{{ .Values.monitoring.namespace | default .Release.Namespace }}
{{- end }}

{{/* Checks values.schema.json cannot express (across keys), most specific first. */}}
{{- define "ckptwatch.validate" -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (eq .Values.mode "sidecar") }}
{{- fail "monitoring.serviceMonitor needs mode=daemonset: a sidecar has no Service to select; in sidecar mode use the PodMonitor (monitoring.podMonitor.enabled=true, monitoring.serviceMonitor.enabled=false)" }}
{{- end }}
{{- if and .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled }}
{{- fail "enable one of monitoring.podMonitor and monitoring.serviceMonitor, not both (set monitoring.podMonitor.enabled=false to use the ServiceMonitor)" }}
{{- end }}
{{- if and .Values.daemonset.watchCapabilities (not .Values.daemonset.watchPaths) }}
{{- fail "daemonset.watchCapabilities are for daemonset.watchPaths: with no watched directory the agent needs none" }}
{{- end }}
{{- end }}

{{/* uid the agent container runs as: 0 when it needs capabilities (Kubernetes grants added
     capabilities to uid 0 only; there are no ambient capabilities), else agent.uid. */}}
{{- define "ckptwatch.agentUid" -}}
{{- if and (eq .Values.mode "daemonset") .Values.daemonset.watchCapabilities }}0{{ else }}{{ .Values.agent.uid }}{{ end }}
{{- end }}

{{/* The agent's container-level security context, securityContext merged over it. */}}
{{- define "ckptwatch.agentSecurityContext" -}}
{{- $caps := list }}
{{- if eq .Values.mode "daemonset" }}{{ $caps = .Values.daemonset.watchCapabilities }}{{ end }}
{{- $base := dict "runAsUser" (int (include "ckptwatch.agentUid" .)) "runAsGroup" (int .Values.agent.gid) "runAsNonRoot" (not $caps) "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true }}
{{- $capabilities := dict "drop" (list "ALL") }}
{{- if $caps }}{{ $_ := set $capabilities "add" $caps }}{{ end }}
{{- $_ := set $base "capabilities" $capabilities }}
{{- toYaml (mustMergeOverwrite $base (deepCopy .Values.securityContext)) }}
{{- end }}

{{/* Liveness on /-/healthy (restart what a restart cures), readiness on /-/ready (started and
     keeping up: an agent behind its queue is alive, a restart would lose the queue). */}}
{{- define "ckptwatch.probes" -}}
readinessProbe:
  httpGet: {path: /-/ready, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 2
livenessProbe:
  httpGet: {path: /-/healthy, port: {{ .port }}}
  initialDelaySeconds: 10
  periodSeconds: 20
  timeoutSeconds: 2
  failureThreshold: 3
{{- end }}

{{/* The monitors' relabelings: the scrape job name the rules match, the node, then the
     user's. */}}
{{- define "ckptwatch.relabelings" -}}
- targetLabel: job
  replacement: ckptwatch
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- with .Values.monitoring.relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}
