{{- define "raymuter.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "raymuter.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "raymuter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raymuter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "raymuter.labels" -}}
{{ include "raymuter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The folder the pods read the model from, or "" for the bundled model. */}}
{{- define "raymuter.modelPath" -}}
{{- $m := .Values.model -}}
{{- if or (eq $m.source "pvc") (eq $m.source "hostPath") -}}
/models
{{- else if and (eq $m.source "hub") $m.hub.prefetch -}}
/models
{{- end -}}
{{- end -}}

{{/* The application's args: app.args with model, name and kind from `model`. */}}
{{- define "raymuter.args" -}}
{{- $args := deepCopy .Values.app.args -}}
{{- $path := include "raymuter.modelPath" . -}}
{{- if $path -}}
{{- $_ := set $args "model" $path -}}
{{- else if eq .Values.model.source "hub" -}}
{{- $_ := set $args "model" .Values.model.hub.id -}}
{{- end -}}
{{- $m := .Values.model -}}
{{- if $m.name -}}
{{- $_ := set $args "name" $m.name -}}
{{- else if eq $m.source "hub" -}}
{{- $_ := set $args "name" $m.hub.id -}}
{{- else if and (eq $m.source "pvc") $m.pvc.subPath -}}
{{- $_ := set $args "name" (base $m.pvc.subPath) -}}
{{- else if eq $m.source "hostPath" -}}
{{- $_ := set $args "name" (base $m.hostPath.path) -}}
{{- end -}}
{{- $_ := set $args "kind" $m.kind -}}
{{- toJson $args -}}
{{- end -}}

{{/* One deployment's Serve options: the code's defaults (files/deployments.json, written by
     `python -m cluster.render`) updated by .Values.deployments.<name>. */}}
{{- define "raymuter.deployment" -}}
{{- $d := deepCopy .entry -}}
{{- $part := ternary "decoder" (lower $d.name) (eq $d.name "Server") -}}{{/* colocated: the decoder's values */}}
{{- $v := index .values.deployments $part -}}
{{- $actor := deepCopy (default dict $d.ray_actor_options) -}}
{{- if hasKey $v "cpus" }}{{ $_ := set $actor "num_cpus" $v.cpus }}{{ end -}}
{{- if and (hasKey $v "gpus") (gt (int $v.gpus) 0) }}{{ $_ := set $actor "num_gpus" $v.gpus }}{{ end -}}
{{- if $v.memoryMiB }}{{ $_ := set $actor "memory" (mul $v.memoryMiB 1048576) }}{{ end -}}
{{- $_ := set $d "ray_actor_options" $actor -}}
{{- if $v.maxOngoingRequests }}{{ $_ := set $d "max_ongoing_requests" $v.maxOngoingRequests }}{{ end -}}
{{- if $v.maxQueuedRequests }}{{ $_ := set $d "max_queued_requests" $v.maxQueuedRequests }}{{ end -}}
{{- if and $v.router (ne $d.name "Server") }}{{ $_ := set $d "request_router_config" (dict "request_router_class" (index .routers $v.router)) }}{{ end -}}
{{- if and $v.autoscaling $v.autoscaling.enabled -}}
{{- $a := $v.autoscaling -}}
{{- $cfg := dict "min_replicas" $a.minReplicas "max_replicas" $a.maxReplicas "target_ongoing_requests" $a.targetOngoingRequests -}}
{{- if hasKey $a "upscaleDelayS" }}{{ $_ := set $cfg "upscale_delay_s" $a.upscaleDelayS }}{{ end -}}
{{- if hasKey $a "downscaleDelayS" }}{{ $_ := set $cfg "downscale_delay_s" $a.downscaleDelayS }}{{ end -}}
{{- if and (eq $part "decoder") (ne (default "occupancy" $a.policy) "ongoing") -}}
{{- $_ := set $cfg "policy" (dict "policy_function" "deployments.autoscaling:DecoderPolicy" "policy_kwargs" (dict "target_occupancy" (default 0.75 $a.targetOccupancy))) -}}
{{- end -}}
{{- $_ := set $d "autoscaling_config" $cfg -}}
{{- else -}}
{{- $_ := set $d "num_replicas" (default 1 $v.replicas) -}}
{{- end -}}
{{- toJson $d -}}
{{- end -}}

{{/* serveConfigV2: Serve's config file, the application of `raymuter serve`. */}}
{{- define "raymuter.serveConfig" -}}
{{- $parts := .Files.Get "files/deployments.json" | fromJson -}}
{{- $entries := index (ternary $parts.colocated $parts.kinds (eq (toString .Values.app.args.colocate) "true")) .Values.model.kind -}}
{{- $deployments := list -}}
{{- range $entries -}}
{{- if not (and (eq .name "Records") (eq (toString $.Values.app.args.records) "server")) -}}{{/* records in the Server's replica */}}
{{- $deployments = append $deployments (include "raymuter.deployment" (dict "entry" . "values" $.Values "routers" $parts.routers) | fromJson) -}}
{{- end -}}
{{- end -}}
{{- $app := dict "name" $parts.app_name "route_prefix" "/" "import_path" $parts.import_path "args" (include "raymuter.args" . | fromJson) "deployments" $deployments -}}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}

{{- define "raymuter.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}

{{/* Environment of every Ray container. */}}
{{- define "raymuter.env" -}}
- name: HF_HOME
  value: /tmp/huggingface
{{- if .Values.securityContext.readOnlyRootFilesystem }}
- name: HOME        # Ray and Python write dot-folders in the home; the root filesystem is read-only
  value: /tmp
{{- end }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- if .Values.app.fastPath }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH   # requests up to app.args.max_body_bytes between deployments
  value: "67108864"
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD  # replicas run their code on their own event loop
  value: "0"
{{- end }}
{{- if .Values.app.apiKeySecret.name }}
- name: RAYMUTER_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.app.apiKeySecret.name }}
      key: {{ .Values.app.apiKeySecret.key }}
{{- end }}
{{- if and (eq .Values.model.source "hub") .Values.model.hub.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hub.tokenSecret.name }}
      key: {{ .Values.model.hub.tokenSecret.key }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A Ray pod: the container (head or worker), the model's volume and its download. */}}
{{- define "raymuter.podTemplate" -}}
{{- $v := .root.Values -}}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "raymuter.selectorLabels" .root | nindent 4 }}
    raymuter.io/group: {{ .name }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  # time for the Serve replicas of a deleted or evicted pod to finish their requests
  terminationGracePeriodSeconds: {{ $v.drain.terminationGracePeriodSeconds }}
  {{- if and (eq $v.model.source "hub") $v.model.hub.prefetch }}
  initContainers:
    - name: fetch-model
      image: {{ include "raymuter.image" .root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["python", "-c", "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir='/models')", {{ $v.model.hub.id | quote }}, {{ $v.model.hub.revision | quote }}]
      env:
        {{- include "raymuter.env" .root | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      volumeMounts:
        - {name: model, mountPath: /models}
        - {name: tmp, mountPath: /tmp}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "raymuter.image" .root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      env:
        {{- include "raymuter.env" .root | nindent 8 }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      resources:
        requests:
          cpu: {{ $group.resources.cpu | quote }}
          memory: {{ $group.resources.memory | quote }}
        limits:
          cpu: {{ $group.resources.cpu | quote }}
          memory: {{ $group.resources.memory | quote }}
          {{- if .gpus }}
          nvidia.com/gpu: {{ .gpus }}
          {{- end }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        - {name: tmp, mountPath: /tmp}
        {{- if include "raymuter.modelPath" .root }}
        - name: model
          mountPath: /models
          readOnly: {{ ne $v.model.source "hub" }}
          {{- if and (eq $v.model.source "pvc") $v.model.pvc.subPath }}
          subPath: {{ $v.model.pvc.subPath }}
          {{- end }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $v.shm.sizeLimit }}}
    - name: tmp
      emptyDir: {}
    {{- if eq $v.model.source "pvc" }}
    - name: model
      persistentVolumeClaim: {claimName: {{ $v.model.pvc.claimName }}, readOnly: true}
    {{- else if eq $v.model.source "hostPath" }}
    - name: model
      hostPath: {path: {{ $v.model.hostPath.path }}, type: Directory}
    {{- else if include "raymuter.modelPath" .root }}
    - name: model
      emptyDir: {}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
