{{/* app.kubernetes.io/name stays "ckptwatch": the PodMonitor's jobLabel turns it into the
     scrape job name the alert rules match (up{job="ckptwatch"}). */}}
{{- define "ckptwatch.labels" -}}
app.kubernetes.io/name: ckptwatch
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: ckptwatch
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "ckptwatch.selectorLabels" -}}
app.kubernetes.io/name: ckptwatch
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "ckptwatch.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "ckptwatch.monitoringNamespace" -}}
{{ .Values.monitoring.namespace | default .Release.Namespace }}
{{- end }}

{{- define "ckptwatch.validate" -}}
{{- if not (has .Values.mode (list "daemonset" "sidecar")) }}
{{- fail (printf "mode must be daemonset or sidecar, not %q" .Values.mode) }}
{{- end }}
{{- if and .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled }}
{{- fail "enable one of monitoring.podMonitor and monitoring.serviceMonitor, not both" }}
{{- end }}
{{- if and .Values.monitoring.serviceMonitor.enabled (eq .Values.mode "sidecar") }}
{{- fail "monitoring.serviceMonitor needs mode=daemonset: sidecars have no Service; use the PodMonitor" }}
{{- end }}
{{- end }}

{{/* The agent's container-level security context: the same in both modes. */}}
{{- define "ckptwatch.agentSecurityContext" -}}
runAsUser: {{ .Values.agent.uid }}
runAsGroup: {{ .Values.agent.gid }}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "ckptwatch.probes" -}}
readinessProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 2
livenessProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  initialDelaySeconds: 10
  periodSeconds: 20
  timeoutSeconds: 2
  failureThreshold: 3
{{- end }}
