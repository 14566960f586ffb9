"""The tool-call formats by name (`--tool-call-parser`), and the choice for a model.

Without the flag the format is read off the model's chat template: a template that renders
tools writes the markers its model answers with. A model whose template names none gets
hermes, the format most open models are trained on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.server.tools.format import ToolFormat
from tandem.server.tools.hermes import HermesFormat
from tandem.server.tools.llama3_json import Llama3JsonFormat
from tandem.server.tools.mistral import MistralFormat

# A format object reads one answer (it keeps its place in it): the registry holds makers.
FORMATS: dict[str, Callable[[], ToolFormat]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
}
DEFAULT_FORMAT = "hermes"


def choose_format(flag: str | None, chat_template: Any) -> str:
    """The format's name: the flag's, else the one whose marker the template writes, else hermes."""
    if flag is not None:
        if flag not in FORMATS:
            raise ValueError(f"unknown tool-call parser {flag!r}; one of {', '.join(sorted(FORMATS))}")
        return flag
    text = chat_template if isinstance(chat_template, str) else str(chat_template or "")
    for name, make in FORMATS.items():
        if any(marker in text for marker in make().markers):
            return name
    return DEFAULT_FORMAT
