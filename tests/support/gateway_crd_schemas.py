"""The upstream openAPIV3Schemas the operator's gateway children must satisfy (render/gateway.py),
for tests/operator/test_operator_gateway.py; validated with crd_validate.py.

Copied from the upstream CRDs, with every `description` removed and `status` left out (the
operator never writes it); everything else is verbatim, CEL rules included:

- INFERENCE_POOL_V1: kubernetes-sigs/gateway-api-inference-extension at 84436a96,
  config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, version v1, whole.
- HTTP_ROUTE_V1: kubernetes-sigs/gateway-api at 4564255a, config/crd/standard/
  gateway.networking.k8s.io_httproutes.yaml (standard channel), version v1, cut to the fields the
  operator renders: spec.parentRefs, spec.hostnames, spec.rules[].matches[].path,
  spec.rules[].backendRefs[] without filters, and spec.rules[].timeouts whole. A field rendered
  outside the cut fails the unknown-field check, which is the prompt to copy its schema here as well.

Upgrading: take the same parts of the newer CRD, drop descriptions, and keep the commit above current.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

INFERENCE_POOL_V1: Schema = {
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "properties": {
                "appProtocol": {"default": "http", "enum": ["http", "kubernetes.io/h2c"], "type": "string"},
                "endpointPickerRef": {
                    "properties": {
                        "failureMode": {"default": "FailClose", "enum": ["FailOpen", "FailClose"], "type": "string"},
                        "group": {
                            "default": "",
                            "maxLength": 253,
                            "minLength": 0,
                            "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                            "type": "string",
                        },
                        "kind": {
                            "default": "Service",
                            "maxLength": 63,
                            "minLength": 1,
                            "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                            "type": "string",
                        },
                        "name": {"maxLength": 253, "minLength": 1, "type": "string"},
                        "port": {
                            "properties": {
                                "number": {"format": "int32", "maximum": 65535, "minimum": 1, "type": "integer"},
                            },
                            "required": ["number"],
                            "type": "object",
                        },
                    },
                    "required": ["name"],
                    "type": "object",
                    "x-kubernetes-validations": [
                        {
                            "message": (
                                "port is required when kind is 'Service' or unspecified (defaults to 'Service')"
                            ),
                            "rule": "self.kind != 'Service' || has(self.port)",
                        },
                    ],
                },
                "selector": {
                    "properties": {
                        "matchLabels": {
                            "additionalProperties": {
                                "maxLength": 63,
                                "minLength": 0,
                                "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                                "type": "string",
                            },
                            "maxProperties": 64,
                            "minProperties": 1,
                            "type": "object",
                        },
                    },
                    "required": ["matchLabels"],
                    "type": "object",
                },
                "targetPorts": {
                    "items": {
                        "properties": {
                            "number": {"format": "int32", "maximum": 65535, "minimum": 1, "type": "integer"},
                        },
                        "required": ["number"],
                        "type": "object",
                    },
                    "maxItems": 8,
                    "minItems": 1,
                    "type": "array",
                    "x-kubernetes-list-type": "atomic",
                    "x-kubernetes-validations": [
                        {
                            "message": "port number must be unique",
                            "rule": "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
                        },
                    ],
                },
            },
            "required": ["selector", "targetPorts"],
            "type": "object",
        },
    },
    "required": ["spec"],
    "type": "object",
}

HTTP_ROUTE_V1: Schema = {
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "properties": {
                "hostnames": {
                    "items": {
                        "maxLength": 253,
                        "minLength": 1,
                        "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                        "type": "string",
                    },
                    "maxItems": 16,
                    "type": "array",
                    "x-kubernetes-list-type": "atomic",
                },
                "parentRefs": {
                    "items": {
                        "properties": {
                            "group": {
                                "default": "gateway.networking.k8s.io",
                                "maxLength": 253,
                                "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                                "type": "string",
                            },
                            "kind": {
                                "default": "Gateway",
                                "maxLength": 63,
                                "minLength": 1,
                                "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                                "type": "string",
                            },
                            "name": {"maxLength": 253, "minLength": 1, "type": "string"},
                            "namespace": {
                                "maxLength": 63,
                                "minLength": 1,
                                "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                "type": "string",
                            },
                            "port": {"format": "int32", "maximum": 65535, "minimum": 1, "type": "integer"},
                            "sectionName": {
                                "maxLength": 253,
                                "minLength": 1,
                                "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                                "type": "string",
                            },
                        },
                        "required": ["name"],
                        "type": "object",
                    },
                    "maxItems": 32,
                    "type": "array",
                    "x-kubernetes-list-type": "atomic",
                    "x-kubernetes-validations": [
                        {
                            "message": (
                                "sectionName must be specified when parentRefs includes 2 or more references to "
                                "the same parent"
                            ),
                            "rule": (
                                "self.all(p1, self.all(p2, p1.group == p2.group && p1.kind == p2.kind && p1.name "
                                "== p2.name && (((!has(p1.__namespace__) || p1.__namespace__ == '') && "
                                "(!has(p2.__namespace__) || p2.__namespace__ == '')) || (has(p1.__namespace__) && "
                                "has(p2.__namespace__) && p1.__namespace__ == p2.__namespace__ )) ? "
                                "((!has(p1.sectionName) || p1.sectionName == '') == (!has(p2.sectionName) || "
                                "p2.sectionName == '')) : true))"
                            ),
                        },
                        {
                            "message": (
                                "sectionName must be unique when parentRefs includes 2 or more references to the "
                                "same parent"
                            ),
                            "rule": (
                                "self.all(p1, self.exists_one(p2, p1.group == p2.group && p1.kind == p2.kind && "
                                "p1.name == p2.name && (((!has(p1.__namespace__) || p1.__namespace__ == '') && "
                                "(!has(p2.__namespace__) || p2.__namespace__ == '')) || (has(p1.__namespace__) && "
                                "has(p2.__namespace__) && p1.__namespace__ == p2.__namespace__ )) && "
                                "(((!has(p1.sectionName) || p1.sectionName == '') && (!has(p2.sectionName) || "
                                "p2.sectionName == '')) || (has(p1.sectionName) && has(p2.sectionName) && "
                                "p1.sectionName == p2.sectionName))))"
                            ),
                        },
                    ],
                },
                "rules": {
                    "default": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}]}],
                    "items": {
                        "properties": {
                            "matches": {
                                "default": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                "items": {
                                    "properties": {
                                        "path": {
                                            "default": {"type": "PathPrefix", "value": "/"},
                                            "properties": {
                                                "type": {
                                                    "default": "PathPrefix",
                                                    "enum": ["Exact", "PathPrefix", "RegularExpression"],
                                                    "type": "string",
                                                },
                                                "value": {"default": "/", "maxLength": 1024, "type": "string"},
                                            },
                                            "type": "object",
                                            "x-kubernetes-validations": [
                                                {
                                                    "message": (
                                                        "value must be an absolute path and start with '/' when "
                                                        "type one of ['Exact', 'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "self.value.startsWith('/') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not contain '//' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.contains('//') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not contain '/./' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.contains('/./') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not contain '/../' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.contains('/../') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not contain '%2f' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.contains('%2f') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not contain '%2F' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.contains('%2F') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not contain '#' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.contains('#') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not end with '/..' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.endsWith('/..') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must not end with '/.' when type one of ['Exact', "
                                                        "'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        "!self.value.endsWith('/.') : true"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "type must be one of ['Exact', 'PathPrefix', "
                                                        "'RegularExpression']"
                                                    ),
                                                    "rule": (
                                                        "self.type in ['Exact','PathPrefix'] || self.type == "
                                                        "'RegularExpression'"
                                                    ),
                                                },
                                                {
                                                    "message": (
                                                        "must only contain valid characters (matching "
                                                        "^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$) "
                                                        "for types ['Exact', 'PathPrefix']"
                                                    ),
                                                    "rule": (
                                                        "(self.type in ['Exact','PathPrefix']) ? "
                                                        'self.value.matches(r"""^(?:[-A-Za-z0-9/._~!$&\'()*+,;=:@]'
                                                        '|[%][0-9a-fA-F]{2})+$""") : true'
                                                    ),
                                                },
                                            ],
                                        },
                                    },
                                    "type": "object",
                                },
                                "maxItems": 64,
                                "type": "array",
                                "x-kubernetes-list-type": "atomic",
                            },
                            "backendRefs": {
                                "items": {
                                    "properties": {
                                        "group": {
                                            "default": "",
                                            "maxLength": 253,
                                            "pattern": (
                                                r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])"
                                                "?)*$"
                                            ),
                                            "type": "string",
                                        },
                                        "kind": {
                                            "default": "Service",
                                            "maxLength": 63,
                                            "minLength": 1,
                                            "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                                            "type": "string",
                                        },
                                        "name": {"maxLength": 253, "minLength": 1, "type": "string"},
                                        "namespace": {
                                            "maxLength": 63,
                                            "minLength": 1,
                                            "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                            "type": "string",
                                        },
                                        "port": {
                                            "format": "int32",
                                            "maximum": 65535,
                                            "minimum": 1,
                                            "type": "integer",
                                        },
                                        "weight": {
                                            "default": 1,
                                            "format": "int32",
                                            "maximum": 1000000,
                                            "minimum": 0,
                                            "type": "integer",
                                        },
                                    },
                                    "required": ["name"],
                                    "type": "object",
                                    "x-kubernetes-validations": [
                                        {
                                            "message": "Must have port for Service reference",
                                            "rule": (
                                                "(size(self.group) == 0 && self.kind == 'Service') ? "
                                                "has(self.port) : true"
                                            ),
                                        },
                                    ],
                                },
                                "maxItems": 16,
                                "type": "array",
                                "x-kubernetes-list-type": "atomic",
                            },
                            "timeouts": {
                                "properties": {
                                    "backendRequest": {
                                        "pattern": "^([0-9]{1,5}(h|m|s|ms)){1,4}$",
                                        "type": "string",
                                    },
                                    "request": {
                                        "pattern": "^([0-9]{1,5}(h|m|s|ms)){1,4}$",
                                        "type": "string",
                                    },
                                },
                                "type": "object",
                                "x-kubernetes-validations": [
                                    {
                                        "message": "backendRequest timeout cannot be longer than request timeout",
                                        "rule": (
                                            "!(has(self.request) && has(self.backendRequest) && "
                                            "duration(self.request) != duration('0s') && "
                                            "duration(self.backendRequest) > duration(self.request))"
                                        ),
                                    },
                                ],
                            },
                        },
                        "type": "object",
                        "x-kubernetes-validations": [
                            {
                                "message": "RequestRedirect filter must not be used together with backendRefs",
                                "rule": (
                                    "(has(self.backendRefs) && size(self.backendRefs) > 0) ? (!has(self.filters) "
                                    "|| self.filters.all(f, !has(f.requestRedirect))): true"
                                ),
                            },
                            {
                                "message": (
                                    "When using RequestRedirect filter with path.replacePrefixMatch, exactly one "
                                    "PathPrefix match must be specified"
                                ),
                                "rule": (
                                    "(has(self.filters) && self.filters.exists_one(f, has(f.requestRedirect) && "
                                    "has(f.requestRedirect.path) && f.requestRedirect.path.type == "
                                    "'ReplacePrefixMatch' && has(f.requestRedirect.path.replacePrefixMatch))) ? "
                                    "((size(self.matches) != 1 || !has(self.matches[0].path) || "
                                    "self.matches[0].path.type != 'PathPrefix') ? false : true) : true"
                                ),
                            },
                            {
                                "message": (
                                    "When using URLRewrite filter with path.replacePrefixMatch, exactly one "
                                    "PathPrefix match must be specified"
                                ),
                                "rule": (
                                    "(has(self.filters) && self.filters.exists_one(f, has(f.urlRewrite) && "
                                    "has(f.urlRewrite.path) && f.urlRewrite.path.type == 'ReplacePrefixMatch' && "
                                    "has(f.urlRewrite.path.replacePrefixMatch))) ? ((size(self.matches) != 1 || "
                                    "!has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') ? "
                                    "false : true) : true"
                                ),
                            },
                            {
                                "message": (
                                    "Within backendRefs, when using RequestRedirect filter with "
                                    "path.replacePrefixMatch, exactly one PathPrefix match must be specified"
                                ),
                                "rule": (
                                    "(has(self.backendRefs) && self.backendRefs.exists_one(b, (has(b.filters) && "
                                    "b.filters.exists_one(f, has(f.requestRedirect) && has(f.requestRedirect.path) "
                                    "&& f.requestRedirect.path.type == 'ReplacePrefixMatch' && "
                                    "has(f.requestRedirect.path.replacePrefixMatch))) )) ? ((size(self.matches) != "
                                    "1 || !has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') "
                                    "? false : true) : true"
                                ),
                            },
                            {
                                "message": (
                                    "Within backendRefs, When using URLRewrite filter with "
                                    "path.replacePrefixMatch, exactly one PathPrefix match must be specified"
                                ),
                                "rule": (
                                    "(has(self.backendRefs) && self.backendRefs.exists_one(b, (has(b.filters) && "
                                    "b.filters.exists_one(f, has(f.urlRewrite) && has(f.urlRewrite.path) && "
                                    "f.urlRewrite.path.type == 'ReplacePrefixMatch' && "
                                    "has(f.urlRewrite.path.replacePrefixMatch))) )) ? ((size(self.matches) != 1 || "
                                    "!has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') ? "
                                    "false : true) : true"
                                ),
                            },
                        ],
                    },
                    "maxItems": 16,
                    "minItems": 1,
                    "type": "array",
                    "x-kubernetes-list-type": "atomic",
                    "x-kubernetes-validations": [
                        {
                            "message": (
                                "While 16 rules and 64 matches per rule are allowed, the total number of matches "
                                "across all rules in a route must be less than 128"
                            ),
                            "rule": (
                                "(self.size() > 0 ? self[0].matches.size() : 0) + (self.size() > 1 ? "
                                "self[1].matches.size() : 0) + (self.size() > 2 ? self[2].matches.size() : 0) + "
                                "(self.size() > 3 ? self[3].matches.size() : 0) + (self.size() > 4 ? "
                                "self[4].matches.size() : 0) + (self.size() > 5 ? self[5].matches.size() : 0) + "
                                "(self.size() > 6 ? self[6].matches.size() : 0) + (self.size() > 7 ? "
                                "self[7].matches.size() : 0) + (self.size() > 8 ? self[8].matches.size() : 0) + "
                                "(self.size() > 9 ? self[9].matches.size() : 0) + (self.size() > 10 ? "
                                "self[10].matches.size() : 0) + (self.size() > 11 ? self[11].matches.size() : 0) + "
                                "(self.size() > 12 ? self[12].matches.size() : 0) + (self.size() > 13 ? "
                                "self[13].matches.size() : 0) + (self.size() > 14 ? self[14].matches.size() : 0) + "
                                "(self.size() > 15 ? self[15].matches.size() : 0) <= 128"
                            ),
                        },
                    ],
                },
            },
            "type": "object",
        },
    },
    "required": ["spec"],
    "type": "object",
}
