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

{{/*
Fails on values that contradict each other about the cluster token, and on a short token: a
clusterToken under 32 characters, or (when `lookup` reaches the cluster) an existingSecret whose
token is. The generated token has 48.
*/}}
{{- define "raftlock.validateToken" -}}
{{- if and .Values.insecure (or .Values.clusterToken .Values.existingSecret) -}}
{{- fail "insecure=true runs the lock nodes without a cluster token: unset clusterToken and existingSecret, or set insecure=false" -}}
{{- end -}}
{{- if and .Values.clusterToken (not .Values.existingSecret) (lt (len (toString .Values.clusterToken)) 32) -}}
{{- fail (printf "clusterToken has %d characters: a cluster token must have at least 32 (e.g. --set clusterToken=\"$(openssl rand -hex 24)\"), or leave it empty and the chart generates one" (len (toString .Values.clusterToken))) -}}
{{- end -}}
{{- with .Values.existingSecret -}}
{{- $existing := lookup "v1" "Secret" $.Release.Namespace . -}}
{{- $encoded := dig "data" $.Values.existingSecretKey "" ($existing | default dict) -}}
{{- if and $encoded (lt (len (b64dec $encoded)) 32) -}}
{{- fail (printf "the cluster token in Secret %s (key %s) has %d characters: a cluster token must have at least 32" . $.Values.existingSecretKey (len (b64dec $encoded))) -}}
{{- end -}}
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

{{/*
Fails on TLS settings without their Secret, and on Secrets mounted into pods that are known to
hold a key they must not: a CA's key (ca-key.pem, client-ca-key.pem) in any of them, the
operator's key in the node Secret every lock-node pod mounts. Known only when `lookup` reaches
the cluster (helm install/upgrade); `helm template` and client-side dry runs cannot check.
*/}}
{{- define "raftlock.validateTls" -}}
{{- if and .Values.tls.peer.enabled (not .Values.tls.peer.secretName) -}}
{{- fail "tls.peer.enabled needs tls.peer.secretName (a Secret with ca.pem, node-N.pem and node-N-key.pem: lockctl certs writes them)" -}}
{{- end -}}
{{- if and .Values.tls.peer.enabled .Values.scaleDown.enabled (not .Values.tls.peer.operatorSecretName) -}}
{{- fail "tls.peer.enabled with scaleDown.enabled needs tls.peer.operatorSecretName: a Secret with ca.pem, operator.pem and operator-key.pem (the operator certificate, DNS name operator.raftlock, from lockctl certs) for the scale-down hook, which removes members it is not" -}}
{{- end -}}
{{- if and .Values.tls.client.enabled (not .Values.tls.client.secretName) -}}
{{- fail "tls.client.enabled needs tls.client.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- $mounted := dict -}}
{{- if .Values.tls.peer.enabled -}}
{{- $_ := set $mounted .Values.tls.peer.secretName (list "operator-key.pem") -}}
{{- with .Values.tls.peer.operatorSecretName -}}
{{- $_ := set $mounted . (list) -}}
{{- end -}}
{{- end -}}
{{- if .Values.tls.client.enabled -}}
{{- $_ := set $mounted .Values.tls.client.secretName (list) -}}
{{- end -}}
{{- range $name, $forbidden := $mounted -}}
{{- $secret := lookup "v1" "Secret" $.Release.Namespace $name | default dict -}}
{{- $keys := keys (get $secret "data" | default dict) -}}
{{- range $key := concat (list "ca-key.pem" "client-ca-key.pem") $forbidden -}}
{{- if has $key $keys -}}
{{- $why := "with a CA's key anyone in such a pod can issue certificates for every node and the operator" -}}
{{- if eq $key "operator-key.pem" -}}
{{- $why = "every lock-node pod would hold the operator's rights" -}}
{{- end -}}
{{- fail (printf "Secret %s holds %s, and the chart mounts that Secret into pods: %s. Create the Secret with only the files it needs, naming each (docs/kubernetes.md, TLS), e.g. kubectl create secret generic %s --from-file=ca.pem=certs/ca.pem ... --dry-run=client -o yaml | kubectl apply -f -" $name $key $why $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (include "raftlock.mountsSecrets" .) (not .Values.podSecurityContext.fsGroup) -}}
{{- fail "the pods mount Secrets with mode 0440 (owner root): they need podSecurityContext.fsGroup set to the container's group (10001 in the image) to read them" -}}
{{- end -}}
{{- end -}}

{{/*
Mode of the files of every mounted Secret: 0440 (decimal 288). The kubelet writes them owned by
root; with podSecurityContext.fsGroup it gives them that group and adds group read (a Secret
volume is read-only: the kubelet's ownership pass ORs in 0440), so 0400 would end up 0440 all
the same. The container runs as uid/gid 10001 and reads them through the group; other users in
the container cannot.
*/}}
{{- define "raftlock.secretMode" -}}
288
{{- end -}}

{{/* Pod volumes for the TLS Secrets (and the client auth and fencing key Secrets). */}}
{{- define "raftlock.tlsVolumes" -}}
{{- with .Values.clientAuth.identitiesSecret }}
- name: client-auth
  secret:
    secretName: {{ . }}
    defaultMode: {{ include "raftlock.secretMode" $ }}
{{- end }}
{{- with .Values.clientAuth.jwtKeySecret }}
- name: client-jwt
  secret:
    secretName: {{ . }}
    defaultMode: {{ include "raftlock.secretMode" $ }}
{{- end }}
{{- with include "raftlock.fencingKeySecretName" . }}
- name: fencing-key
  secret:
    secretName: {{ . }}
    defaultMode: {{ include "raftlock.secretMode" $ }}
    {{- if include "raftlock.generatesFencingKey" $ }}
    # The upgrade that first generates the key runs the pre-upgrade scale-down hook (which
    # mounts these volumes but needs no key) before the Secret exists.
    optional: true
    {{- end }}
{{- end }}
{{- if .Values.tls.peer.enabled }}
# Every node's key: the pod template is the same for every ordinal, so it cannot name only its
# own (docs/kubernetes.md, TLS: what a pod holds).
- name: peer-tls
  secret:
    secretName: {{ .Values.tls.peer.secretName }}
    defaultMode: {{ include "raftlock.secretMode" $ }}
{{- end }}
{{- if .Values.tls.client.enabled }}
- name: client-tls
  secret:
    secretName: {{ .Values.tls.client.secretName }}
    defaultMode: {{ include "raftlock.secretMode" $ }}
{{- end }}
{{- end -}}

{{/*
The client port's CA certificate alone (tls.client.caKey of tls.client.secretName), for pods that
only dial the client port (the scale-down hook, `helm test`): not the port's key.
*/}}
{{- define "raftlock.clientCaVolume" -}}
- name: client-tls
  secret:
    secretName: {{ .Values.tls.client.secretName }}
    defaultMode: {{ include "raftlock.secretMode" . }}
    items:
      - key: {{ .Values.tls.client.caKey }}
        path: {{ .Values.tls.client.caKey }}
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
