"""The Tandem operator: the InferenceService CRD, its pure reconcile, the autoscaler and kopf handlers.

Data flow: CR -> spec.service_spec.parse_service -> reconcile.desired_children -> kubeapi (server-side
apply) -> observed Deployments -> status.build_status -> CR status. scaling.decision.decide feeds
replica counts in, and rollout.step.step moves them between model generations.

The top level holds the entry points (cli, __main__, runner, handlers) and the loop's glue (sync,
reconcile, status, conditions, kubeapi, telemetry, names); spec/, render/, security/, scaling/ and
rollout/ hold the rest, one sub-package per section of docs/operator.md.
Nothing here imports torch; the operator image carries kopf, httpx and pyyaml only.
"""
