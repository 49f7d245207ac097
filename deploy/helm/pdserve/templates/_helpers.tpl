{{/* Names, labels and the pieces every pdserve pod shares. */}}

{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* A role's image: its own imageTag during a staged upgrade, else the release's. */}}
{{- define "pdserve.roleImage" -}}
{{- if .values.imageTag -}}
{{ .root.Values.image.repository }}:{{ .values.imageTag }}
{{- else -}}
{{ include "pdserve.image" .root }}
{{- end -}}
{{- end -}}

{{/* --registry: the release's etcd, or the one named in etcd.endpoint. */}}
{{- define "pdserve.registry" -}}
{{- $endpoint := .Values.etcd.endpoint -}}
{{- if .Values.etcd.enabled -}}
{{- $endpoint = printf "%s-etcd:2379" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- if not $endpoint -}}
{{- fail "etcd.enabled is false: set etcd.endpoint to host:port of your etcd" -}}
{{- end -}}
etcd://{{ $endpoint }}{{ .Values.etcd.namespace }}
{{- end -}}

{{/* The pod's own name and address, for the instance id and --advertise-address. */}}
{{- define "pdserve.podEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end -}}

{{/* Flags every service shares: registry, mTLS, logs, traces. */}}
{{- define "pdserve.commonArgs" -}}
- --registry
- {{ include "pdserve.registry" . }}
{{- if .Values.tls.enabled }}
- --tls-ca
- /tls/ca.crt
- --tls-cert
- /tls/$(POD_NAME).crt
- --tls-key
- /tls/$(POD_NAME).key
{{- else }}
- --insecure
{{- end }}
- --log-level
- {{ .Values.logLevel }}
{{- with .Values.otlpEndpoint }}
- --otlp-endpoint
- {{ . }}
{{- end }}
{{- end -}}

{{/* Init container: issues this pod's certificate (instance id = pod name) from the CA. */}}
{{- define "pdserve.issueCertificate" -}}
- name: issue-certificate
  image: {{ include "pdserve.roleImage" . }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: [pdserve, certs, issue, --dir, /ca, --out, /tls, --role, {{ .role }},
            --instance-id, $(POD_NAME), --host, $(POD_IP),
            --days, {{ .root.Values.tls.days | quote }}]
  env:
    {{- include "pdserve.podEnv" . | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 64Mi}
    limits: {memory: 256Mi}
  volumeMounts:
    - {name: ca, mountPath: /ca, readOnly: true}
    - {name: tls, mountPath: /tls}
{{- end -}}

{{- define "pdserve.tlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: ca
  secret:
    secretName: {{ .Values.tls.caSecret }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: ca.key, path: ca.key}
- name: tls
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- end }}
{{- end -}}

{{- define "pdserve.podDisruptionBudget" -}}
{{- if .values.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pdserve.fullname" .root }}-{{ .component }}
  labels:
    {{- include "pdserve.labels" . | nindent 4 }}
spec:
  {{- if hasKey .values.podDisruptionBudget "minAvailable" }}
  minAvailable: {{ .values.podDisruptionBudget.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .values.podDisruptionBudget.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}
