{{- define "loraplane.fullname" -}}
{{- printf "%s" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplane.labels" -}}
app.kubernetes.io/name: loraplane
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "loraplane.selector" -}}
app.kubernetes.io/name: loraplane
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "loraplane.image" -}}
image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{- define "loraplane.kafkaBootstrap" -}}
{{- if .Values.kafka.strimzi.enabled -}}
{{ include "loraplane.fullname" . }}-kafka-kafka-bootstrap:9092
{{- else -}}
{{ .Values.kafka.bootstrap }}
{{- end -}}
{{- end -}}

{{- define "loraplane.registryUrl" -}}
{{ if .Values.tls.enabled }}https{{ else }}http{{ end }}://{{ include "loraplane.fullname" . }}-registry:{{ .Values.registry.port }}
{{- end -}}

{{/* Settings every process gets: the shared ConfigMap, the secrets, TLS and the database. */}}
{{- define "loraplane.envFrom" -}}
- configMapRef:
    name: {{ include "loraplane.fullname" . }}-env
{{- if .Values.secretEnv.existingSecret }}
- secretRef:
    name: {{ .Values.secretEnv.existingSecret }}
{{- end }}
{{- if .Values.postgres.existingSecret }}
- secretRef:
    name: {{ .Values.postgres.existingSecret }}
{{- end }}
{{- end -}}

{{- define "loraplane.env" -}}
{{- if .Values.postgres.cloudnativepg.enabled }}
{{- /* CloudNativePG's app secret, as the SQLAlchemy URL the services read */}}
- name: PG_USER
  valueFrom: {secretKeyRef: {name: {{ include "loraplane.fullname" . }}-pg-app, key: username}}
- name: PG_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ include "loraplane.fullname" . }}-pg-app, key: password}}
- name: LORAPLANE_DATABASE_URL
  value: "postgresql+psycopg://$(PG_USER):$(PG_PASSWORD)@{{ include "loraplane.fullname" . }}-pg-rw:5432/loraplane"
{{- end }}
{{- if .Values.tls.enabled }}
- name: LORAPLANE_TLS_CERT_FILE
  value: /etc/loraplane/tls/tls.crt
- name: LORAPLANE_TLS_KEY_FILE
  value: /etc/loraplane/tls/tls.key
- name: LORAPLANE_TLS_CA_FILE
  value: /etc/loraplane/tls/ca.crt
- name: LORAPLANE_TLS_CLIENT_AUTH
  value: {{ .Values.tls.clientAuth | toJson | quote }}
{{- if .Values.tls.serverName }}
- name: LORAPLANE_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "loraplane.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/loraplane/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "loraplane.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end -}}

{{/* A readiness or liveness probe that runs `loraplane health SERVICE` (TLS-aware). */}}
{{- define "loraplane.probe" -}}
exec:
  command: ["loraplane", "health", {{ . | quote }}]
periodSeconds: 10
timeoutSeconds: 8
failureThreshold: 3
{{- end -}}
