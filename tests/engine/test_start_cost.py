"""What a worker's start pays before it serves: building the model must not import torch's
compiler stack (dynamo, sympy). Each once cost a second or two of every scheduler process's
start, to fill values the loader then overwrote: nn.Embedding's normal_ init and to_empty()'s
empty_like on meta tensors both run torch's Python refs, which import them."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch import nn

from tandem.engine.models.loader import _materialize

LOAD = """
import json, sys, torch
from tandem.engine.model_config import ModelConfig
from tandem.engine.models.loader import load_model
model = load_model(ModelConfig.from_pretrained(sys.argv[1]), torch.float32, torch.device("cpu"), 64)
print(json.dumps([m for m in ("torch._dynamo", "sympy") if m in sys.modules]))
"""


def test_loading_a_model_imports_no_compiler(model_path):
    out = subprocess.run([sys.executable, "-c", LOAD, str(model_path("tiny"))], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_materialize_keeps_shared_tensors_shared():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("table", torch.zeros(3))
            self.alias = self.embed  # the same module reached twice

    with torch.device("meta"):
        m = Tied()
    _materialize(m)
    assert m.embed.weight.device.type == "cpu" and m.table.device.type == "cpu"
    assert m.head.weight is m.embed.weight
    assert isinstance(m.head.weight, nn.Parameter) and m.head.weight.requires_grad
    assert m.embed.weight.shape == (8, 4) and m.table.shape == (3,)
