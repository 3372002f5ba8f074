{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix; also the RayCluster's name. KubeRay appends suffixes such as
"-head-svc" and "-<group>-worker-xxxxx", so keep it well under 63 characters.
*/}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "pdserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Secret holding the Ray token (key auth_token). */}}
{{- define "pdserve.rayAuthSecret" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* Secret holding the cluster's internal secret (key cluster_secret). */}}
{{- define "pdserve.clusterSecret" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* Address of the Ray dashboard, where jobs are submitted. */}}
{{- define "pdserve.rayAddress" -}}
http://{{ include "pdserve.fullname" . }}-head-svc.{{ .Release.Namespace }}.svc:8265
{{- end }}

{{/*
Token auth env for a container. Ray containers get it from the chart unless KubeRay's
authOptions wires it ("ray" = true); the launcher always needs it to submit its job.
*/}}
{{- define "pdserve.rayAuthEnv" -}}
{{- $root := index . 0 }}
{{- $rayContainer := index . 1 }}
{{- if and $root.Values.ray.auth.enabled (not (and $rayContainer $root.Values.ray.auth.useAuthOptions)) }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.rayAuthSecret" $root }}
      key: auth_token
{{- end }}
{{- end }}

{{/* Where the head pod mounts the router's TLS and token Secrets (router.tls / router.auth). */}}
{{- define "pdserve.routerTLSDir" -}}/etc/pdserve-router/tls{{- end }}
{{- define "pdserve.routerAuthDir" -}}/etc/pdserve-router/auth{{- end }}

{{/*
The cluster config (orchestrator/config/cluster.py's schema) built from values. Each worker group
advertises a Ray custom resource pdserve_<role> and each rank asks for one unit of it, so that
Ray places prefill ranks only on prefill pods and decode ranks only on decode pods. Each rank
runs as many torch threads as the CPUs it requests (cpuPerRank). Workers bind every interface
(worker_host 0.0.0.0) and register their pod's IP: the router on the head pod dials them and
the PodMonitor scrapes them there; fabric.node stays unset, so libfabric picks the pod's NIC
(or fabric.nics lists the pod's interfaces to use).
The router's TLS files and token file are those of the Secrets the head pod mounts.
*/}}
{{- define "pdserve.clusterConfig" -}}
{{- $groups := dict }}
{{- range $role, $group := .Values.workerGroups }}
{{- $resources := dict "cpu" $group.cpuPerRank "gpu" $group.gpuPerRank "custom" (dict (printf "pdserve_%s" $role) 1) }}
{{- $fabric := dict "provider" $.Values.fabric.provider }}
{{- if ne (toString $.Values.fabric.nics) "auto" }}
{{- $_ := set $fabric "nics" $.Values.fabric.nics }}
{{- end }}
{{- $entry := dict "replicas" $group.replicas "tp" $group.tpPerPod "resources_per_rank" $resources "threads" $group.cpuPerRank "fabric" $fabric }}
{{- if $group.limits }}
{{- $_ := set $entry "limits" $group.limits }}
{{- end }}
{{- $_ := set $groups $role $entry }}
{{- end }}
{{- $ports := dict "address" (printf "0.0.0.0:%v" .Values.router.grpcPort) "http_address" (printf "0.0.0.0:%v" .Values.router.httpPort) }}
{{- if .Values.router.tls.existingSecret }}
{{- $dir := include "pdserve.routerTLSDir" . }}
{{- $tls := dict "cert" (printf "%s/tls.crt" $dir) "key" (printf "%s/tls.key" $dir) }}
{{- if .Values.router.tls.verifyClients }}
{{- $_ := set $tls "ca" (printf "%s/ca.crt" $dir) }}
{{- end }}
{{- $_ := set $ports "tls" $tls }}
{{- end }}
{{- if .Values.router.auth.existingSecret }}
{{- $_ := set $ports "auth" (dict "token_file" (printf "%s/token" (include "pdserve.routerAuthDir" .))) }}
{{- end }}
{{- $router := merge $ports (deepCopy .Values.clusterConfig.router) }}
{{- $config := merge (dict "model" .Values.model.path "groups" $groups "router" $router "worker_host" "0.0.0.0") (omit (deepCopy .Values.clusterConfig) "router") }}
{{- toYaml $config }}
{{- end }}

{{/*
Bytes of a size as orchestrator/config/cluster.py reads it ("4MiB", "1 GB", 4194304), as a float:
its int() truncates, so compare the floor. The schema has checked the spelling.
*/}}
{{- define "pdserve.bytes" -}}
{{- if kindIs "string" . }}
{{- $text := lower (trim .) }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $text }}
{{- $units := dict "" 1 "b" 1 "kb" 1e3 "mb" 1e6 "gb" 1e9 "tb" 1e12 "kib" 1024 "mib" 1048576 "gib" 1073741824 "tib" 1099511627776 }}
{{- mulf (float64 $number) (index $units (trim (trimPrefix $number $text))) | floor }}
{{- else }}
{{- float64 . }}
{{- end }}
{{- end }}

{{/*
Rules across values that the JSON schema cannot express; the orchestrator checks the same ones
at launch, but a failed `helm install` beats a launcher Job that crash-loops.
*/}}
{{- define "pdserve.validate" -}}
{{- /*
The router's ports share one Service (which refuses a repeated port) and the head pod, where
Ray already listens: GCS, dashboard and client (the head's container ports), and KubeRay's
defaults for metrics export and the dashboard agent, which are on every pod.
*/}}
{{- $rayPorts := dict "6379" "Ray GCS" "8265" "Ray dashboard" "10001" "Ray client" "8080" "Ray metrics export" "52365" "Ray dashboard agent" }}
{{- $routerPorts := dict }}
{{- range $key := list "grpcPort" "httpPort" "metricsPort" }}
{{- $port := index $.Values.router $key | int | toString }}
{{- with index $rayPorts $port }}
{{- fail (printf "router.%s: %s is the %s port on the Ray head; pick another" $key $port .) }}
{{- end }}
{{- with index $routerPorts $port }}
{{- fail (printf "router.%s: %s is router.%s too; the router's ports must differ" $key $port .) }}
{{- end }}
{{- $_ := set $routerPorts $port $key }}
{{- end }}
{{- $workerPort := .Values.workerMetricsPort | int | toString }}
{{- if has $workerPort (list "8080" "52365") }}
{{- fail (printf "workerMetricsPort: %s is the %s port on every Ray pod; pick another" $workerPort (index $rayPorts $workerPort)) }}
{{- end }}
{{- $prefill := .Values.workerGroups.prefill.replicas | int }}
{{- $decode := .Values.workerGroups.decode.replicas | int }}
{{- if or (gt $prefill (mul 16 $decode)) (gt $decode (mul 16 $prefill)) }}
{{- fail (printf "workerGroups: prefill:decode replicas %d:%d is beyond 1:16 either way; one side would sit idle" $prefill $decode) }}
{{- end }}
{{- if and .Values.router.tls.existingSecret .Values.clusterConfig.router.tls }}
{{- fail "clusterConfig.router.tls: router.tls.existingSecret sets it; give one or the other" }}
{{- end }}
{{- if and .Values.router.auth.existingSecret .Values.clusterConfig.router.auth }}
{{- fail "clusterConfig.router.auth: router.auth.existingSecret sets it; give one or the other" }}
{{- end }}
{{- if and .Values.router.tls.verifyClients (not .Values.router.tls.existingSecret) }}
{{- fail "router.tls.verifyClients: needs router.tls.existingSecret (its ca.crt verifies clients)" }}
{{- end }}
{{- if ne .Values.fabric.provider "tcp;ofi_rxm" }}
{{- range $role, $group := .Values.workerGroups }}
{{- if lt ($group.rdmaDevicesPerPod | int) 1 }}
{{- fail (printf "workerGroups.%s.rdmaDevicesPerPod: fabric.provider %q moves KV over RDMA devices; request at least one (%s)" $role $.Values.fabric.provider $.Values.fabric.rdmaResource) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* auto runs a rank on the GPU it reserves (orchestrator/config/cluster.py): cuda's rules there. */}}
{{- $device := .Values.clusterConfig.device | default "cpu" }}
{{- range $role, $group := .Values.workerGroups }}
{{- $gpus := $group.gpuPerRank | int }}
{{- if and (hasPrefix "cuda" $device) (lt $gpus 1) }}
{{- fail (printf "workerGroups.%s.gpuPerRank: clusterConfig.device %s runs every rank on a GPU; request at least one" $role $device) }}
{{- end }}
{{- if and (gt $gpus 0) (ne $device "cpu") (eq $.Values.fabric.provider "tcp;ofi_rxm") }}
{{- fail (printf "fabric.provider: tcp;ofi_rxm cannot register GPU memory for KV transfers, where clusterConfig.device %s puts them (workerGroups.%s.gpuPerRank %d); use efa or verbs;ofi_rxm" $device $role $gpus) }}
{{- end }}
{{- end }}
{{- /* Byte sizes within the orchestrator's bounds (config_sections.py), which a pattern cannot say. */}}
{{- with .Values.clusterConfig.router.max_request_bytes }}
{{- $bytes := include "pdserve.bytes" . | float64 }}
{{- if or (lt $bytes 1024.0) (gt $bytes 1073741824.0) }}
{{- fail (printf "clusterConfig.router.max_request_bytes: %v is %.0f bytes; give 1KiB to 1GiB" . $bytes) }}
{{- end }}
{{- end }}
{{- $limits := dict "clusterConfig.limits" .Values.clusterConfig.limits }}
{{- range $role, $group := .Values.workerGroups }}
{{- $_ := set $limits (printf "workerGroups.%s.limits" $role) $group.limits }}
{{- end }}
{{- range $path, $section := $limits }}
{{- with and $section (index $section "kv_memory_bytes") }}
{{- if lt (include "pdserve.bytes" . | float64) 1.0 }}
{{- fail (printf "%s.kv_memory_bytes: %v is 0 bytes (the orchestrator truncates); give at least one" $path .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
