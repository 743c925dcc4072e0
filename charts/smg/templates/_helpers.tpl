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

{{/*
The admin token as the Secret's data holds it (base64), decided once per render (kept in .Values.auth) so that
the Secret and the pods' checksum annotation agree on a generated one:
  auth.existingSecret: that Secret's value when lookup sees it (install, upgrade), else "" (helm template, or
    the Secret not created yet): then no checksum can be known;
  auth.adminApiKey: that;
  else the chart's own Secret's value when lookup sees it (an upgrade keeps the token), else a new random one.
*/}}
{{- define "smg.adminTokenData" -}}
{{- $auth := .Values.auth }}
{{- if not (hasKey $auth "_tokenData") }}
{{- $data := "" }}
{{- $live := lookup "v1" "Secret" .Release.Namespace (include "smg.adminSecretName" .) }}
{{- $seen := and $live $live.data (hasKey $live.data $auth.secretKey) }}
{{- if $auth.existingSecret }}
{{- if $seen }}{{ $data = index $live.data $auth.secretKey }}{{ end }}
{{- else if $auth.adminApiKey }}
{{- $data = $auth.adminApiKey | b64enc }}
{{- else if $seen }}
{{- $data = index $live.data $auth.secretKey }}
{{- else }}
{{- $data = randAlphaNum 32 | b64enc }}
{{- end }}
{{- $_ := set $auth "_tokenData" $data }}
{{- end }}
{{- $auth._tokenData }}
{{- end }}

{{- define "smg.saltSecretName" -}}
{{- printf "%s-checksum-salt" (include "smg.fullname" .) }}
{{- end }}

{{/*
The salt of the pods' checksum annotations (base64), random, kept in the chart's Secret <fullname>-checksum-salt
across upgrades (lookup; `helm template` draws a new one each render: give auth.checksumSalt for byte-identical
renders).  Without it the annotation would be the
plain SHA-256 of the token: anyone who may read pods could test guesses of the token against it offline.
*/}}
{{- define "smg.checksumSalt" -}}
{{- $v := .Values }}
{{- if not (hasKey $v "_checksumSalt") }}
{{- $live := lookup "v1" "Secret" .Release.Namespace (include "smg.saltSecretName" .) }}
{{- $salt := "" }}
{{- if $v.auth.checksumSalt }}
{{- $salt = $v.auth.checksumSalt | b64enc }}
{{- else if and $live $live.data (hasKey $live.data "salt") }}
{{- $salt = index $live.data "salt" }}
{{- else }}
{{- $salt = randAlphaNum 32 | b64enc }}
{{- end }}
{{- $_ := set $v "_checksumSalt" $salt }}
{{- end }}
{{- $v._checksumSalt }}
{{- end }}

{{- define "smg.peerSecretName" -}}
{{- default (printf "%s-peers" (include "smg.fullname" .)) .Values.router.peers.existingSecret }}
{{- end }}

{{/*
The peer secret (the routers' --peer-secret, signing what the replicas tell each other; not the admin token) as
the Secret's data holds it (base64), decided once per render as smg.adminTokenData is: router.peers.existingSecret's
value when lookup sees it, else router.peers.secret, else the chart's own Secret's value (kept across upgrades), else
a new random one.
*/}}
{{- define "smg.peerSecretData" -}}
{{- $p := .Values.router.peers }}
{{- if not (hasKey $p "_secretData") }}
{{- $data := "" }}
{{- $live := lookup "v1" "Secret" .Release.Namespace (include "smg.peerSecretName" .) }}
{{- $seen := and $live $live.data (hasKey $live.data "peer-secret") }}
{{- if $p.existingSecret }}
{{- if $seen }}{{ $data = index $live.data "peer-secret" }}{{ end }}
{{- else if $p.secret }}
{{- $data = $p.secret | b64enc }}
{{- else if $seen }}
{{- $data = index $live.data "peer-secret" }}
{{- else }}
{{- $data = randAlphaNum 48 | b64enc }}
{{- end }}
{{- $_ := set $p "_secretData" $data }}
{{- end }}
{{- $p._secretData }}
{{- end }}

{{/*
Pod template annotations: salted checksums of the admin token and (on the routers, with peers) of the peer secret,
so that pods restart when one changes, and the user's.  (dict "ctx" $ "annotations" ... "peers" true)
*/}}
{{- define "smg.podAnnotations" -}}
{{- $salt := include "smg.checksumSalt" .ctx }}
{{- $token := include "smg.adminTokenData" .ctx }}
{{- if $token }}
checksum/admin-token: {{ sha256sum (printf "%s\n%s" $salt $token) }}
{{- end }}
{{- if and .peers .ctx.Values.router.peers.enabled }}
{{- $peer := include "smg.peerSecretData" .ctx }}
{{- if $peer }}
checksum/peer-secret: {{ sha256sum (printf "%s\n%s" $salt $peer) }}
{{- end }}
{{- end }}
{{- with .annotations }}
{{ toYaml . }}
{{- end }}
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

{{/* Ports and APIs ------------------------------------------------------------------------------ */}}

{{/* The router port of the worker lifecycle changes: router.adminPort, or router.port when that is 0. */}}
{{- define "smg.routerAdminPort" -}}
{{- .Values.router.adminPort | default .Values.router.port | int64 }}
{{- end }}

{{/*
PodDisruptionBudget's API: policy/v1 where the cluster serves it (1.21+), else policy/v1beta1 (1.20).  Helm
fills .Capabilities from the cluster on install and upgrade; `helm template` has a fixed list that always holds
policy/v1, so the Kubernetes version (--kube-version) decides there too.
*/}}
{{- define "smg.pdbApiVersion" -}}
{{- if and (.Capabilities.APIVersions.Has "policy/v1") (semverCompare ">=1.21.0-0" .Capabilities.KubeVersion.Version) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end }}
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
{{- if include "smg.inferencePools" . }}
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch]  # read only: a pool and its status belong to the gateway
{{- end }}
{{- end }}

{{/* "true" when the operator takes InferencePools: operator.inferencePools.enabled, or the chart renders one. */}}
{{- define "smg.inferencePools" -}}
{{- $o := .Values.operator -}}
{{- if and $o.enabled (or $o.inferencePools.enabled (and .Values.epp.enabled .Values.epp.inferencePool.create)) -}}
true
{{- end -}}
{{- end }}

{{- define "smg.inferencePoolName" -}}
{{- default (include "smg.fullname" .) .Values.epp.inferencePool.name -}}
{{- end }}

{{- define "smg.eppServiceName" -}}
{{- printf "%s-epp" (include "smg.routerName" .) -}}
{{- end }}

{{/* Router Services the operator may target: this release's router and operator.allowedRouterServices. */}}
{{- define "smg.allowedRouterServices" -}}
{{- $own := printf "%s/%s" .Release.Namespace (include "smg.routerName" .) }}
{{- join "," (uniq (prepend .Values.operator.allowedRouterServices $own)) }}
{{- end }}

{{/* Checks of combinations the schema cannot express well -------------------------------------- */}}

{{- define "smg.validate" -}}
{{- if and .Values.auth.existingSecret .Values.auth.adminApiKey }}
{{- fail "auth.adminApiKey and auth.existingSecret exclude each other (the token comes from one or the other)" }}
{{- end }}
{{- if eq (int .Values.router.adminPort) (int .Values.router.port) }}
{{- fail "router.adminPort must differ from router.port (0 puts the admin API on router.port)" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.router.adminPort) }}
{{- fail "networkPolicy.enabled needs router.adminPort (a policy cannot tell the admin API from the data plane on one port)" }}
{{- end }}
{{- if and .Values.router.pd.enabled .Values.router.workerUrls }}
{{- fail "router.workerUrls cannot be combined with router.pd.enabled (use router.pd.prefill and router.pd.decode)" }}
{{- end }}
{{- if and (not .Values.router.pd.enabled) (or .Values.router.pd.prefill .Values.router.pd.decode) }}
{{- fail "router.pd.prefill and router.pd.decode need router.pd.enabled" }}
{{- end }}
{{- if and .Values.sim.enabled .Values.sim.pd.enabled (not .Values.router.pd.enabled) }}
{{- fail "sim.pd.enabled needs router.pd.enabled (prefill and decode workers need a router in PD mode)" }}
{{- end }}
{{- with .Values.sim.kvEvents }}
{{- if and $.Values.sim.enabled .enabled }}
{{- $ports := list (int $.Values.sim.port) (int .port) (int .replayPort) }}
{{- if $.Values.sim.pd.enabled }}{{ $ports = append $ports (int $.Values.sim.pd.bootstrapPort) }}{{ end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail "sim.kvEvents.port and sim.kvEvents.replayPort must differ from each other, sim.port and sim.pd.bootstrapPort" }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.epp }}
{{- if .enabled }}
{{- $ports := list (int $.Values.router.port) (int $.Values.router.adminPort) (int .port) (int .healthPort) }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail "epp.port and epp.healthPort must differ from each other, router.port and router.adminPort" }}
{{- end }}
{{- if and .inferencePool.create (not .inferencePool.selector) }}
{{- fail "epp.inferencePool.create needs epp.inferencePool.selector (the matchLabels of the model-server pods)" }}
{{- end }}
{{- if and .inferencePool.create (not .inferencePool.model) }}
{{- fail "epp.inferencePool.create needs epp.inferencePool.model (its smg.dev/model annotation: the operator registers nothing without it)" }}
{{- end }}
{{- if and .httpRoute.enabled (not .httpRoute.parentRefs) }}
{{- fail "epp.httpRoute.enabled needs epp.httpRoute.parentRefs (the Gateway to attach to)" }}
{{- end }}
{{- else if .httpRoute.enabled }}
{{- fail "epp.httpRoute.enabled needs epp.enabled" }}
{{- end }}
{{- end }}
{{- if and .Values.sim.enabled .Values.router.pd.enabled (not .Values.sim.pd.enabled) }}
{{- fail "router.pd.enabled with sim.enabled needs sim.pd.enabled (a PD router does not route to regular workers)" }}
{{- end }}
{{- end }}

{{/*
The router's serving processes (SMG_PROCESSES): router.processes, else resources.limits.cpu rounded up ("500m": 1,
"1.5": 2), else nothing (the router reads its cgroup's limit; none: one process).
*/}}
{{- define "smg.routerProcesses" -}}
{{- $r := .Values.router -}}
{{- if $r.processes -}}
{{- $r.processes | int64 -}}
{{- else -}}
{{- $cpu := "" -}}
{{- with $r.resources }}{{ with .limits }}{{ with .cpu }}{{ $cpu = toString . }}{{ end }}{{ end }}{{ end -}}
{{- if $cpu -}}
{{- $cores := 0.0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $cores = divf (trimSuffix "m" $cpu | float64) 1000 -}}
{{- else -}}
{{- $cores = $cpu | float64 -}}
{{- end -}}
{{- max 1 (ceil $cores | int64) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The router's tokenizers (SMG_TOKENIZER, "MODEL=PATH" entries): router.tokenizers, then the simulated fleet's model
with the sim's tokenizer the image holds (sim.enabled and sim.kvEvents.enabled) unless router.tokenizers names it.
*/}}
{{- define "smg.simTokenizerPath" -}}/opt/smg/tokenizers/smg-sim{{- end }}
{{- define "smg.routerTokenizers" -}}
{{- $entries := list -}}
{{- $models := list -}}
{{- range .Values.router.tokenizers -}}
{{- $entries = append $entries (printf "%s=%s" .model .path) -}}
{{- $models = append $models .model -}}
{{- end -}}
{{- if and .Values.sim.enabled .Values.sim.kvEvents.enabled (not (has .Values.sim.model $models)) -}}
{{- $entries = append $entries (printf "%s=%s" .Values.sim.model (include "smg.simTokenizerPath" .)) -}}
{{- end -}}
{{- join "," $entries -}}
{{- end }}
