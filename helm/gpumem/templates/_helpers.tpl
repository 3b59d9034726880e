{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "gpumem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name (fullnameOverride wins). */}}
{{- define "gpumem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The image reference: by digest where given, else by tag (the chart's appVersion by default). */}}
{{- define "gpumem.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "gpumem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "gpumem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Labels that select the agent's pods. */}}
{{- define "gpumem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpumem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The service account name. */}}
{{- define "gpumem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpumem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The job label Prometheus gives the agents' targets: the Service's name for a
ServiceMonitor, <namespace>/<name> for a PodMonitor; "" when neither is on. */}}
{{- define "gpumem.scrapeJob" -}}
{{- if .Values.serviceMonitor.enabled -}}
{{- include "gpumem.fullname" . -}}
{{- else if .Values.podMonitor.enabled -}}
{{- printf "%s/%s" (.Values.podMonitor.namespace | default .Release.Namespace) (include "gpumem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Refuses an agent-job matcher that this chart's own monitor does not match: the
agent-down and agents-absent alerts would then never fire (a fullnameOverride without
"gpumem" in it, for example). */}}
{{- define "gpumem.checkAgentJob" -}}
{{- $job := include "gpumem.scrapeJob" . -}}
{{- if and $job (not (regexMatch (printf "^(?:%s)$" .Values.prometheusRule.agentJob) $job)) -}}
{{- fail (printf "prometheusRule.agentJob %q does not match the agents' scrape job %q: GpumemAgentDown and GpumemAgentsAbsent would never fire; set prometheusRule.agentJob (a regex) to match it" .Values.prometheusRule.agentJob $job) -}}
{{- end -}}
{{- end -}}

{{/* The port jobs on the pod network push to when it is not the scrape port: with TLS and
pod-network pushes, the plain push-only listener's; "" otherwise. Refuses a push port equal to
the scrape port. */}}
{{- define "gpumem.pushPort" -}}
{{- if and (.Values.webConfig).tls (.Values.podNetwork).enabled -}}
{{- if eq (int .Values.webConfig.pushPort) (int .Values.service.port) -}}
{{- fail "webConfig.pushPort equals service.port: the push-only listener needs a port of its own" -}}
{{- end -}}
{{- .Values.webConfig.pushPort -}}
{{- end -}}
{{- end -}}

{{/*
The host of recordings.urlTemplate, {node} made the node's name through the container's
GPUMEM_NODE_NAME (Kubernetes expands $(VAR) in args); empty without a template.
*/}}
{{- define "gpumem.recordingHost" -}}
{{- with (.Values.recordings).urlTemplate -}}
{{- regexReplaceAll "^https?://([^/:]+).*$" . "${1}" | replace "{node}" "$(GPUMEM_NODE_NAME)" -}}
{{- end -}}
{{- end }}

{{/* Whether the agent archives its recordings (non-empty when it does). */}}
{{- define "gpumem.archiving" -}}
{{- if and (.Values.recordings).enabled ((.Values.recordings).archive).url -}}
true
{{- end -}}
{{- end }}
