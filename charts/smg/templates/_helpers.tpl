{{/* Names ------------------------------------------------------------------------------------- */}}

{{- define "smg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release> when it already contains the chart name, else <release>-<chart>; room left for suffixes. */}}
{{- define "smg.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "smg.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "smg.routerName" -}}
{{- printf "%s-router" (include "smg.fullname" .) }}
{{- end }}

{{- define "smg.operatorName" -}}
{{- printf "%s-operator" (include "smg.fullname" .) }}
{{- end }}

{{- define "smg.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "smg.routerName" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "smg.operatorServiceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "smg.operatorName" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "smg.adminSecretName" -}}
{{- default (printf "%s-admin" (include "smg.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Labels ------------------------------------------------------------------------------------ */}}

{{- define "smg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "smg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "smg.labels" -}}
helm.sh/chart: {{ include "smg.chart" . }}
{{ include "smg.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: smg
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "router"). */}}
{{- define "smg.componentLabels" -}}
{{ include "smg.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "smg.componentSelectorLabels" -}}
{{ include "smg.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image --------------------------------------------------------------------------------------- */}}

{{- define "smg.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Operator ------------------------------------------------------------------------------------ */}}

{{/* Namespaces the namespaced operator watches (default: the release namespace), as a JSON list. */}}
{{- define "smg.watchNamespaces" -}}
{{- $namespaces := .Values.operator.watchNamespaces | default (list .Release.Namespace) }}
{{- toJson (uniq $namespaces) }}
{{- end }}

{{/* Namespaces that get the operator's Role: the watched ones plus the router's (router pods, Service). */}}
{{- define "smg.roleNamespaces" -}}
{{- $namespaces := fromJsonArray (include "smg.watchNamespaces" .) }}
{{- toJson (uniq (append $namespaces .Release.Namespace)) }}
{{- end }}

{{- define "smg.leaderElection" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end }}
{{- end }}

{{/* The operator's rules on namespaced resources (Role in each namespace, or ClusterRole). */}}
{{- define "smg.operatorRules" -}}
- apiGroups: [""]
  resources: [pods, services]
  verbs: [get, list, watch]
- apiGroups: [smg.dev]
  resources: [smgworkers]
  verbs: [get, list, watch, patch, update]
- apiGroups: [smg.dev]
  resources: [smgworkers/status]
  verbs: [get, patch, update]
- apiGroups: [smg.dev]
  resources: [smgworkers/finalizers]
  verbs: [update]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}

{{/* Checks of combinations the schema cannot express well -------------------------------------- */}}

{{- define "smg.validate" -}}
{{- if and .Values.router.pd.enabled .Values.router.workerUrls }}
{{- fail "router.workerUrls cannot be combined with router.pd.enabled (use router.pd.prefill and router.pd.decode)" }}
{{- end }}
{{- if and (not .Values.router.pd.enabled) (or .Values.router.pd.prefill .Values.router.pd.decode) }}
{{- fail "router.pd.prefill and router.pd.decode need router.pd.enabled" }}
{{- end }}
{{- if and .Values.sim.enabled .Values.sim.pd.enabled (not .Values.router.pd.enabled) }}
{{- fail "sim.pd.enabled needs router.pd.enabled (prefill and decode workers need a router in PD mode)" }}
{{- end }}
{{- if and .Values.sim.enabled .Values.router.pd.enabled (not .Values.sim.pd.enabled) }}
{{- fail "router.pd.enabled with sim.enabled needs sim.pd.enabled (a PD router does not route to regular workers)" }}
{{- end }}
{{- end }}
