"""The InferenceService custom resource: its openAPI schema and CRDs, the schema's defaults, and
the typed, checked ServiceSpec parsed from a CR (with the fields the schema does not declare)."""
