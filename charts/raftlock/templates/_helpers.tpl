{{/* Chart name, truncated to a DNS label. */}}
{{- define "raftlock.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name: the prefix of every resource. Kept to 40 characters so that a pod name
(<fullname>-NN) and its volume claim (data-<fullname>-NN) stay valid DNS labels, and so that the
StatefulSet's controller-revision-hash label fits.
*/}}
{{- define "raftlock.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "raftlock.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "raftlock.labels" -}}
helm.sh/chart: {{ include "raftlock.chart" . }}
app.kubernetes.io/name: {{ include "raftlock.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: raftlock
{{- end -}}

{{/* Selector labels of the lock nodes. */}}
{{- define "raftlock.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raftlock.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: lock-node
{{- end -}}

{{/* Selector labels of the data store. */}}
{{- define "raftlock.dataStore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raftlock.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: data-store
{{- end -}}

{{- define "raftlock.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{- define "raftlock.headlessName" -}}
{{- printf "%s-headless" (include "raftlock.fullname" .) -}}
{{- end -}}

{{- define "raftlock.dataStore.fullname" -}}
{{- printf "%s-data-store" (include "raftlock.fullname" .) -}}
{{- end -}}

{{- define "raftlock.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "raftlock.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Cluster DNS suffix of the headless service: <headless>.<namespace>.svc.cluster.local */}}
{{- define "raftlock.headlessDomain" -}}
{{- printf "%s.%s.svc.cluster.local" (include "raftlock.headlessName" .) .Release.Namespace -}}
{{- end -}}

{{/* Peer address of pod ordinal $i: call with (list $ $i). */}}
{{- define "raftlock.peerAddress" -}}
{{- $ctx := index . 0 -}}
{{- printf "%s-%d.%s:%d" (include "raftlock.fullname" $ctx) (int (index . 1)) (include "raftlock.headlessDomain" $ctx) (int $ctx.Values.ports.peer) -}}
{{- end -}}

{{/*
Peers a new pod asks to join through: the first three pods (fewer when replicas < 3). Any member
will do (a follower hands the join to the leader), and a list that does not grow with replicas
keeps the pod template unchanged when the StatefulSet is scaled, so scaling restarts no pod.
*/}}
{{- define "raftlock.joinList" -}}
{{- $addrs := list -}}
{{- range $i := until (min 3 (int .Values.replicas) | int) -}}
{{- $addrs = append $addrs (include "raftlock.peerAddress" (list $ $i)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* Client address of the client Service (any pod; followers forward to the leader). */}}
{{- define "raftlock.clientServiceAddress" -}}
{{- printf "%s.%s.svc.cluster.local:%d" (include "raftlock.fullname" .) .Release.Namespace (int .Values.service.port) -}}
{{- end -}}

{{- define "raftlock.dataStoreHost" -}}
{{- printf "%s.%s.svc.cluster.local" (include "raftlock.dataStore.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/*
Whether the pods get a cluster token: always, unless `insecure` is set. The token comes from
existingSecret, else from the chart's Secret <fullname>-token (clusterToken, or a generated
one: templates/secret.yaml).
*/}}
{{- define "raftlock.hasToken" -}}
{{- if not .Values.insecure -}}true{{- end -}}
{{- end -}}

{{/* Fails on values that contradict each other about the cluster token. */}}
{{- define "raftlock.validateToken" -}}
{{- if and .Values.insecure (or .Values.clusterToken .Values.existingSecret) -}}
{{- fail "insecure=true runs the lock nodes without a cluster token: unset clusterToken and existingSecret, or set insecure=false" -}}
{{- end -}}
{{- end -}}

{{/* Whether the chart generates the token (no clusterToken, no existingSecret, not insecure). */}}
{{- define "raftlock.generatesToken" -}}
{{- if not (or .Values.insecure .Values.existingSecret .Values.clusterToken) -}}true{{- end -}}
{{- end -}}

{{- define "raftlock.tokenSecretName" -}}
{{- if .Values.existingSecret -}}
{{- .Values.existingSecret -}}
{{- else -}}
{{- printf "%s-token" (include "raftlock.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* storageClassName for a persistence block: "" omits it (cluster default), "-" sets "". */}}
{{- define "raftlock.storageClass" -}}
{{- if eq .storageClass "-" -}}
storageClassName: ""
{{- else if .storageClass -}}
storageClassName: {{ .storageClass | quote }}
{{- end -}}
{{- end -}}

{{/* Fails on TLS settings without their Secret. */}}
{{- define "raftlock.validateTls" -}}
{{- if and .Values.tls.peer.enabled (not .Values.tls.peer.secretName) -}}
{{- fail "tls.peer.enabled needs tls.peer.secretName (a Secret with ca.pem, node-N.pem and node-N-key.pem: lockctl certs writes them)" -}}
{{- end -}}
{{- if and .Values.tls.client.enabled (not .Values.tls.client.secretName) -}}
{{- fail "tls.client.enabled needs tls.client.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- end -}}

{{/* Pod volumes for the TLS Secrets (and the client auth and fencing key Secrets). */}}
{{- define "raftlock.tlsVolumes" -}}
{{- with .Values.clientAuth.identitiesSecret }}
- name: client-auth
  secret:
    secretName: {{ . }}
{{- end }}
{{- with .Values.clientAuth.jwtKeySecret }}
- name: client-jwt
  secret:
    secretName: {{ . }}
{{- end }}
{{- with include "raftlock.fencingKeySecretName" . }}
- name: fencing-key
  secret:
    secretName: {{ . }}
    {{- if include "raftlock.generatesFencingKey" $ }}
    # The upgrade that first generates the key runs the pre-upgrade scale-down hook (which
    # mounts these volumes but needs no key) before the Secret exists.
    optional: true
    {{- end }}
{{- end }}
{{- if .Values.tls.peer.enabled }}
- name: peer-tls
  secret:
    secretName: {{ .Values.tls.peer.secretName }}
{{- end }}
{{- if .Values.tls.client.enabled }}
- name: client-tls
  secret:
    secretName: {{ .Values.tls.client.secretName }}
{{- end }}
{{- end -}}

{{/* Container mounts of those volumes. */}}
{{- define "raftlock.tlsMounts" -}}
{{- if .Values.clientAuth.identitiesSecret }}
- name: client-auth
  mountPath: /etc/raftlock/client-auth
  readOnly: true
{{- end }}
{{- if .Values.clientAuth.jwtKeySecret }}
- name: client-jwt
  mountPath: /etc/raftlock/client-jwt
  readOnly: true
{{- end }}
{{- if include "raftlock.fencingKeySecretName" . }}
- name: fencing-key
  mountPath: /etc/raftlock/fencing
  readOnly: true
{{- end }}
{{- if .Values.tls.peer.enabled }}
- name: peer-tls
  mountPath: /etc/raftlock/peer-tls
  readOnly: true
{{- end }}
{{- if .Values.tls.client.enabled }}
- name: client-tls
  mountPath: /etc/raftlock/client-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Environment that makes lockctl use the client port's TLS (and its bearer token). */}}
{{- define "raftlock.lockctlTlsEnv" -}}
{{- with .Values.clientAuth.lockctlTokenSecret }}
- name: RAFTLOCK_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: token
{{- end }}
{{- if .Values.tls.client.enabled }}
- name: RAFTLOCK_TLS_CA
  value: /etc/raftlock/client-tls/{{ .Values.tls.client.caKey }}
{{- end }}
{{- end -}}

{{/* Whether pods mount any Secret besides their data. */}}
{{- define "raftlock.mountsSecrets" -}}
{{- if or .Values.tls.peer.enabled .Values.tls.client.enabled .Values.clientAuth.identitiesSecret .Values.clientAuth.jwtKeySecret (include "raftlock.fencingKeySecretName" .) -}}true{{- end -}}
{{- end -}}

{{/*
Whether the chart generates the fencing key: no fencingKeySecret given, the data store on, and
dataStore.generateFencingKey (templates/fencing-key-secret.yaml).
*/}}
{{- define "raftlock.generatesFencingKey" -}}
{{- if and (not .Values.fencingKeySecret) .Values.dataStore.enabled .Values.dataStore.generateFencingKey -}}true{{- end -}}
{{- end -}}

{{/*
The Secret with the fencing key (`fencing.key`) that the lock nodes and the data store mount:
fencingKeySecret, else the generated one, else "" (no key).
*/}}
{{- define "raftlock.fencingKeySecretName" -}}
{{- if .Values.fencingKeySecret -}}
{{- .Values.fencingKeySecret -}}
{{- else if include "raftlock.generatesFencingKey" . -}}
{{- printf "%s-fencing-key" (include "raftlock.fullname" .) -}}
{{- end -}}
{{- end -}}
