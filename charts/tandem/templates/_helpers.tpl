{{/* Common names and labels. */}}
{{- define "tandem.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The kopf peering name, or "" for a standalone operator (one replica, Recreate). */}}
{{- define "tandem.peeringName" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) -}}
{{- .Values.leaderElection.name -}}
{{- end -}}
{{- end -}}

{{/*
Namespaced rules: exactly what the operator's code uses (tests/operator/test_operator_rbac.py
holds the table). Its own client (operator/kubeapi.py) does server-side apply (a PATCH that
creates: create + patch), a plain create (the PD Secret), merge patches, get, list and delete;
kopf lists, watches and patches InferenceServices and posts events. Nothing is updated (PUT)
and children are never watched.
*/}}
{{- define "tandem.namespacedRules" -}}
# kopf: the watch stream, finalizer and progress annotations, and the status subresource.
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["patch"]
# RoleScalers: one per role, applied by the operator; their status carries the scale readout.
- apiGroups: ["tandem.dev"]
  resources: ["rolescalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["tandem.dev"]
  resources: ["rolescalers/status"]
  verbs: ["get", "patch"]
# Children: applied, read back (Deployments), listed to prune strays, deleted.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "delete"]
# spec.gateway's children: the Gateway API Inference Extension's InferencePool and Gateway API's
# HTTPRoute. Granted whether or not their CRDs are installed (RBAC names resources, not CRDs).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Pods: listed for metrics scraping, patched for the pod-deletion-cost annotation (and for nothing
# else: templates/admission-policy.yaml); get/list/watch are also held because the router's Role
# grants them, and RBAC forbids granting what one lacks.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
# Secrets: the PD control key, one per InferenceService, created once and read back to check it
# (operator/security/pd_secret.py); never listed, watched, patched or deleted (the garbage collector
# removes it with its InferenceService). The API key Secret is the pods' to read, not the operator's.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# HPAs: read only, to notice one that targets a role and would fight the built-in autoscaler.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list"]
# kopf posts core/v1 events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* kopf peering: keep-alives are patches to the peering object's status, watched by all peers. */}}
{{- define "tandem.peeringRule" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ if .Values.watch.allNamespaces }}"clusterkopfpeerings"{{ else }}"kopfpeerings"{{ end }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}
