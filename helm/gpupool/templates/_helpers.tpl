{{/* Names. */}}
{{- define "gpupool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpupool.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpupool.routerSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{/* The headless Service (and StatefulSet) name of engine group `.group`. */}}
{{- define "gpupool.engineName" -}}
{{- printf "%s-engine-%s" (include "gpupool.fullname" .root) .group.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpupool.engineSelector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: engine
gpupool.io/engine-group: {{ .group.name }}
{{- end -}}

{{- define "gpupool.engineKeySecret" -}}
{{- .Values.engines.apiKeySecret | default (printf "%s-engine-key" (include "gpupool.fullname" .)) -}}
{{- end -}}

{{- define "gpupool.apiKeySecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "gpupool.fullname" .)) -}}
{{- end -}}

{{/* The GPU product label (NVIDIA GPU feature discovery) of each gpuType gpupool knows;
     the names are kvcache_model's GPU table, whose roofline priors the router uses. */}}
{{- define "gpupool.gpuProducts" -}}
A100: NVIDIA-A100-SXM4-80GB
A100-40GB: NVIDIA-A100-SXM4-40GB
H100: NVIDIA-H100-80GB-HBM3
H100-PCIE: NVIDIA-H100-PCIe
H100-NVL: NVIDIA-H100-NVL
H200: NVIDIA-H200
L40S: NVIDIA-L40S
B200: NVIDIA-B200
{{- end -}}

{{/* The vLLM server arguments of one engine group: the flags gpupool's local launcher
     derives (pools/launchers/engine_args.py; tests/unit/test_helm_chart.py holds them equal),
     then the group's own vllmArgs. */}}
{{- define "gpupool.engineArgs" -}}
{{- $v := .root.Values -}}
{{- $g := .group -}}
{{- $args := list "--model" $v.model.path "--served-model-name" $v.model.name "--host" "0.0.0.0" "--port" (toString $v.engines.port) "--dtype" (include "gpupool.engineDtype" .) -}}
{{- if ne $v.model.loadFormat "auto" -}}
{{- $args = concat $args (list "--load-format" $v.model.loadFormat) -}}
{{- end -}}
{{- if $v.model.maxModelLenTokens -}}
{{- $args = concat $args (list "--max-model-len" (toString (int $v.model.maxModelLenTokens))) -}}
{{- end -}}
{{- if $g.kvCacheBytes -}}
{{- $args = concat $args (list "--kv-cache-memory-bytes" (toString (int64 $g.kvCacheBytes))) -}}
{{- end -}}
{{- if eq $g.gpuType "cpu" -}}
{{- $args = concat $args (list "--distributed-executor-backend" "uni" "--enforce-eager") -}}
{{- else if gt (int $g.gpusPerInstance) 1 -}}
{{- $args = concat $args (list "--tensor-parallel-size" (toString (int $g.gpusPerInstance))) -}}
{{- end -}}
{{- if and $v.model.devModel (not (has "--enable-auto-tool-choice" $g.vllmArgs)) -}}
{{- $args = concat $args (list "--enable-auto-tool-choice" "--tool-call-parser" "hermes") -}}
{{- end -}}
{{- $args = concat $args (list "--disable-uvicorn-access-log" "--max-log-len" "0") -}}
{{- if $v.engines.guardMiddleware -}}
{{- $args = concat $args (list "--middleware" "pools.launchers.engine_guard.EngineKeyGuard") -}}
{{- end -}}
{{- if $v.engines.kvEvents.enabled -}}
{{- $events := printf "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:%d\",\"replay_endpoint\":\"tcp://*:%d\",\"topic\":\"\"}" (int $v.engines.kvEvents.port) (int $v.engines.kvEvents.replayPort) -}}
{{- $args = concat $args (list "--kv-events-config" $events "--prefix-caching-hash-algo" "sha256_cbor") -}}
{{- end -}}
{{- with (include "gpupool.engineTracesUrl" .root) -}}
{{- if not (has "--otlp-traces-endpoint" $g.vllmArgs) -}}
{{- $args = concat $args (list "--otlp-traces-endpoint" .) -}}
{{- end -}}
{{- end -}}
{{- $args = concat $args $g.vllmArgs -}}
{{- toJson $args -}}
{{- end -}}

{{/* The OTLP/HTTP traces URL the engines export vLLM's spans to: the router's collector
     (config.observability.otlp_endpoint, /v1/traces added to a bare base URL as the router
     does) when observability.engineTraces; "" otherwise. */}}
{{- define "gpupool.engineTracesUrl" -}}
{{- $url := ((.Values.config.observability | default dict).otlp_endpoint | default "") -}}
{{- if and $url .Values.observability.engineTraces -}}
{{- if regexMatch "^https?://[^/]+/?$" $url -}}
{{- printf "%s/v1/traces" (trimSuffix "/" $url) -}}
{{- else -}}
{{- $url -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* --dtype: as given; `auto` on a CPU group is float32 (gpupool's engine plan picks bfloat16
     only where the CPU has native bf16, which a chart cannot see); on a GPU vLLM's auto. */}}
{{- define "gpupool.engineDtype" -}}
{{- if and (eq .root.Values.model.dtype "auto") (eq .group.gpuType "cpu") -}}
float32
{{- else -}}
{{- .root.Values.model.dtype -}}
{{- end -}}
{{- end -}}

{{/* Engine group `.group` with engines.groupDefaults filled in: resources, nodeSelector and
     tolerations whole, the rest key by key. */}}
{{- define "gpupool.group" -}}
{{- $d := deepCopy .root.Values.engines.groupDefaults -}}
{{- $g := merge (deepCopy .group) (omit $d "resources" "nodeSelector" "tolerations") -}}
{{- range $key := list "resources" "nodeSelector" "tolerations" -}}
{{- if not (hasKey $g $key) -}}{{- $_ := set $g $key (index $d $key) -}}{{- end -}}
{{- end -}}
{{- toJson $g -}}
{{- end -}}

{{/* Whether the router pods share a PostgreSQL store: "true" or "". */}}
{{- define "gpupool.sharedStore" -}}
{{- if or .Values.store.url (and .Values.store.existingSecret .Values.store.urlKey) (.Values.config.store | default dict).url -}}true{{- end -}}
{{- end -}}

{{/* Router pods: router.replicas, or (null) 2 with a shared store and 1 without. More than
     one without a shared store fails the render. */}}
{{- define "gpupool.routerReplicas" -}}
{{- $shared := include "gpupool.sharedStore" . -}}
{{- $n := .Values.router.replicas -}}
{{- if kindIs "invalid" $n -}}{{- $n = ternary 2 1 (eq $shared "true") -}}{{- end -}}
{{- if and (gt (int $n) 1) (ne $shared "true") -}}
{{- fail (printf "router.replicas: %d router pods need a shared PostgreSQL store (set store.url, or store.existingSecret with the URL under store.urlKey): with the embedded SQLite store each router would keep its own budgets, ledger and rebalancer" (int $n)) -}}
{{- end -}}
{{- int $n -}}
{{- end -}}
