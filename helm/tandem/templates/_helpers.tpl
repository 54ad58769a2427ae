{{/* Names, labels and the pieces every tandem pod shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
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

{{/* Component resource name: "<fullname>-<component>", within 63 characters. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag -}}
{{- if not $tag -}}
{{- $tag = ternary (printf "%s-cuda" .Chart.AppVersion) .Chart.AppVersion .Values.gpu.enabled -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.tlsSecretName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "tls")) .Values.tls.existingSecret -}}
{{- end -}}

{{- define "tandem.apiKeysSecretName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "api-keys")) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{/*
The --grace-ms a process gets: what terminationGracePeriodSeconds leaves after the preStop sleep
and a 5 s margin for the process to exit before Kubernetes sends SIGKILL.
*/}}
{{- define "tandem.graceMs" -}}
{{- $left := sub (sub (int .pool.terminationGracePeriodSeconds) (int (default 0 .pool.preStopSleepSeconds))) 5 -}}
{{- if lt (int $left) 1 -}}
{{- fail (printf "%s: terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) by more than 5 s" .component (int .pool.terminationGracePeriodSeconds) (int (default 0 .pool.preStopSleepSeconds))) -}}
{{- end -}}
{{- mul $left 1000 -}}
{{- end -}}

{{/* Pod annotations that roll every pod when the config or the secrets change. */}}
{{- define "tandem.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
checksum/secret: {{ include (print .root.Template.BasePath "/secret.yaml") .root | sha256sum }}
{{- with .pool.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The environment every tandem container gets: the ConfigMap plus its own pod's identity. */}}
{{- define "tandem.env" -}}
envFrom:
  - configMapRef:
      name: {{ include "tandem.componentName" (dict "root" .root "component" "config") }}
env:
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: POD_IP
    valueFrom:
      fieldRef:
        fieldPath: status.podIP
{{- range $k, $v := .root.Values.config.env }}
  - name: {{ $k }}
    value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* Volumes: the model, scratch /tmp (the root filesystem is read-only), TLS. */}}
{{- define "tandem.volumes" -}}
- name: model
{{- if eq .Values.model.source "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ required "model.persistentVolumeClaim.claimName is required when model.source is persistentVolumeClaim" .Values.model.persistentVolumeClaim.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tandem.tlsSecretName" . }}
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- name: model
  mountPath: /models
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* With model.source synth, an init container writes the model into the pod's emptyDir. */}}
{{- define "tandem.initContainers" -}}
{{- if eq .Values.model.source "synth" }}
initContainers:
  - name: synth-model
    image: {{ include "tandem.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["tandem"]
    args:
      - synth
      - --shape={{ .Values.model.synth.shape }}
      - --type={{ .Values.model.synth.type }}
      - --seed=1
      - --vocab-dir=/usr/share/tandem/vocab
      - --out=/models/{{ .Values.model.file }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    resources:
      requests: {cpu: 100m, memory: 256Mi}
      limits: {memory: 2Gi}
    volumeMounts:
      - name: model
        mountPath: /models
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}

{{/* The pod-level settings every tandem pod shares. */}}
{{- define "tandem.podCommon" -}}
serviceAccountName: {{ include "tandem.serviceAccountName" .root }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Probes against grpc.health.v1 (every tandem server serves it), or the TCP port with TLS on:
kubelet's gRPC probe has no TLS. .service names the health service asked ("" when unset): the
workers' liveness probe asks "liveness", which their engine-loop watchdog turns NOT_SERVING when
a step has wedged (docs/workers.md), so the kubelet restarts the pod.
*/}}
{{- define "tandem.probeAction" -}}
{{- if .tls }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.probes" -}}
startupProbe:
  {{- include "tandem.probeAction" . | trim | nindent 2 }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
readinessProbe:
  {{- include "tandem.probeAction" . | trim | nindent 2 }}
  periodSeconds: 5
  {{- /* Not the 1 s default: on a node whose cores are saturated, a health answer can take
         over 1 s, and two such answers took every pod out of its Service at once. */}}
  timeoutSeconds: 3
  failureThreshold: 2
livenessProbe:
  {{- include "tandem.probeAction" (dict "tls" .tls "port" .port "service" .livenessService) | trim | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* The --tls-* flags every tandem binary takes (services/common/tls.h). */}}
{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/tandem/tls/tls.crt
- --tls-key=/etc/tandem/tls/tls.key
{{- if .Values.tls.mutual }}
- --tls-ca=/etc/tandem/tls/ca.crt
- --tls-require-client-cert
{{- end }}
{{- with .Values.tls.serverName }}
- --tls-server-name={{ . }}
{{- end }}
{{- end }}
{{- range .Values.tls.args }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "tandem.preStop" -}}
{{- if gt (int (default 0 .preStopSleepSeconds)) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .preStopSleepSeconds }}"]
{{- end }}
{{- end -}}
