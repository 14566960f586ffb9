"""The Tandem operator: the InferenceService CRD, its pure reconcile, the autoscaler and kopf handlers.

Data flow: CR -> spec.parse_service -> reconcile.desired_children -> kubeapi (server-side apply)
-> observed Deployments -> status.build_status -> CR status. scaling.decide feeds replica counts in.
Nothing here imports torch; the operator image carries kopf, httpx and pyyaml only.
"""
