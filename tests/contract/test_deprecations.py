"""Names that moved in the models/planner/fast/engines layering (issue 26) still work from
their old homes for one release, with a ``DeprecationWarning``, and the layers import one
way: ``convo.models`` is a leaf, the planner and the fast path import it and not each other."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


SHIMS = ("convo.planner.model", "convo.engines.transformers", "convo.engines.kv", "convo.engines.models")


@pytest.mark.parametrize(
    ("old_module", "name", "new_module"),
    [
        ("convo.planner.model", "MemoryModel", "convo.planner.memory:VRAMModel"),
        ("convo.planner.model", "plan_grid", "convo.planner.grid:plan_grid"),
        ("convo.planner.model", "weight_bytes", "convo.planner.weights:weight_bytes"),
        ("convo.planner.model", "ModelShape", "convo.models:ModelShape"),
        ("convo.planner.model", "parse_size", "convo.models:parse_size"),
        ("convo.planner", "MemoryModel", "convo.planner:VRAMModel"),
        ("convo.planner", "Quant", "convo.models:Quant"),
        ("convo.engines.base", "Quant", "convo.models:Quant"),
        ("convo.engines.base", "INT4_GROUP_SIZE", "convo.models:INT4_GROUP_SIZE"),
        ("convo.engines.base", "FinishReason", "convo.models:FinishReason"),
        ("convo.engines.base", "Sampling", "convo.models:Sampling"),
        ("convo.engines.base", "Generation", "convo.models:Generation"),
        ("convo.engines.base", "empty_device_cache", "convo.models.device:empty_device_cache"),
        ("convo.engines", "Quant", "convo.models:Quant"),
        ("convo.engines.transformers", "TransformersEngine", "convo.engines.local.engine:TransformersEngine"),
        ("convo.engines.transformers", "DEFAULT_KV_SLOTS", "convo.models:DEFAULT_KV_SLOTS"),
        ("convo.engines.transformers", "auto_kv_slots", "convo.models:auto_kv_slots"),
        ("convo.engines.kv", "SlotKV", "convo.engines.local.kv:SlotKV"),
        ("convo.engines.models", "default_model_path", "convo.engines.local.loading:default_model_path"),
    ],
)
def test_an_old_name_is_the_new_object_and_warns(old_module: str, name: str, new_module: str) -> None:
    module_name, new_name = new_module.split(":")
    new = getattr(importlib.import_module(module_name), new_name)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        if old_module in SHIMS:  # a shim module warns when it is imported
            sys.modules.pop(old_module, None)
        value = getattr(importlib.import_module(old_module), name)
    assert value is new


def test_shared_defaults_are_one_object_wherever_they_are_read() -> None:
    import convo.fast.decoder
    import convo.fast.kv_pool
    import convo.fast.scheduler
    import convo.models

    assert convo.fast.scheduler.DEFAULT_STEP_TOKENS == convo.models.DEFAULT_STEP_TOKENS
    assert convo.fast.decoder.MIXED_CHUNK_TOKENS == convo.models.MIXED_CHUNK_TOKENS
    pool = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "slots": 4, "slot_tokens": 4096}
    assert convo.fast.kv_pool.KVSlotPool.predicted_nbytes(
        **pool, dtype_bytes=2
    ) == convo.models.kv_pool_bytes(**pool, dtype_bytes=2)


def test_the_deprecated_int4_helpers_still_work() -> None:
    pytest.importorskip("torch")
    import torch

    from convo.fast.int4 import Int4Linear, quantize_int4
    from convo.models import INT4_GROUP_SIZE, int4_group_size

    w = torch.randn(16, 64)
    with pytest.warns(DeprecationWarning, match="quantize_int4"):
        q = quantize_int4(w, group_size=32, layout="plain")
    assert torch.equal(q.dequantize(), Int4Linear.quantize(w, group_size=32, layout="plain").dequantize())
    from convo.planner.model import int4_group

    for in_features in (32, 64, 96, 128, 4096, 11008, 100):
        with pytest.warns(DeprecationWarning, match="int4_group"):
            old = int4_group(in_features)  # its default: the engine's group
        assert old == int4_group_size(in_features, INT4_GROUP_SIZE)


def _project_imports(path: Path) -> set[str]:
    """The ``convo...`` modules a file imports, at module level or anywhere."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("convo"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("convo"))
    return out


def _package_files(package: str) -> list[Path]:
    return sorted((ROOT / "convo" / package).rglob("*.py"))


def test_the_models_leaf_imports_only_errors() -> None:
    for path in _package_files("models"):
        # (convo.messages: ToolCall, under TYPE_CHECKING in generation.py; it imports only errors)
        assert _project_imports(path) <= {"convo.errors", "convo.messages"} | {
            m for m in _project_imports(path) if m.startswith("convo.models")
        }, path


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("planner", ("convo.fast", "convo.engines")), ("fast", ("convo.planner", "convo.engines"))],
)
def test_the_planner_and_the_fast_path_do_not_import_each_other_or_the_engines(
    package: str, forbidden: tuple[str, ...]
) -> None:
    for path in _package_files(package):
        bad = {m for m in _project_imports(path) if m.startswith(forbidden)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize(
    "relpath",
    [
        "engines/base.py",
        "engines/local/engine.py",
        "engines/local/kv.py",
        "engines/local/loading.py",
        "summarize.py",
        *(f"fast/{p.name}" for p in _package_files("fast")),
        *(f"planner/{p.name}" for p in _package_files("planner")),
        *(f"models/{p.name}" for p in _package_files("models")),
    ],
)
def test_no_project_import_inside_a_function(relpath: str) -> None:
    tree = ast.parse((ROOT / "convo" / relpath).read_text())
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("convo"):
                    pytest.fail(f"{relpath}:{node.lineno} imports {node.module} inside {func.name}()")
                if isinstance(node, ast.Import) and any(a.name.startswith("convo") for a in node.names):
                    pytest.fail(f"{relpath}:{node.lineno} imports convo inside {func.name}()")


def test_base_and_summaries_import_nothing_of_the_fast_path() -> None:
    for relpath in ("engines/base.py", "summarize.py"):
        assert not {m for m in _project_imports(ROOT / "convo" / relpath) if m.startswith("convo.fast")}


def test_importing_the_layers_loads_no_torch() -> None:
    code = (
        "import sys, convo.models, convo.planner, convo.fast, convo.engines.local.engine, convo.summarize;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# -- flat keywords that became config objects ----------------------------------------------------


def test_configs_validate_when_built() -> None:
    from convo.engines.local.config import KVConfig, LoadConfig
    from convo.errors import ConfigError
    from convo.fast import DecoderConfig

    for bad in ({"kv_slots": -1}, {"slot_tokens": 1}, {"step_tokens": 0}, {"prefill_chunk_tokens": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            KVConfig(**bad)
    with pytest.raises(ConfigError, match="int4_group_size"):
        LoadConfig(int4_group_size=100)
    with pytest.raises(ConfigError, match="int4_kernel"):
        LoadConfig(int4_kernel="cutlass")
    with pytest.raises(ConfigError, match="mixed_chunk_tokens"):
        DecoderConfig(mixed_chunk_tokens=-1)
    assert DecoderConfig(buckets=[1, 4]).buckets == (1, 4)
    with pytest.raises(TypeError):
        KVConfig(8)  # type: ignore[misc]  # keyword-only


def test_flat_engine_keywords_still_work_and_warn() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convo.engines.local.config import KVConfig, LoadConfig
    from convo.engines.local.engine import TransformersEngine

    with pytest.warns(
        DeprecationWarning, match=r"kv=KVConfig\(kv_slots=\.\.\., prefill_chunk_tokens=\.\.\.\)"
    ):
        old = TransformersEngine("random:tiny-llama", device="cpu", kv_slots=0, prefill_chunk_tokens=64)
    new = TransformersEngine.from_model(
        old.model, old.tokenizer, quant="fp32", kv=KVConfig(kv_slots=0, prefill_chunk_tokens=64)
    )
    try:
        assert old.kv_config == new.kv_config == KVConfig(kv_slots=0, prefill_chunk_tokens=64)
        assert old.load_config == LoadConfig() and old.prefill_chunk_tokens == 64
        with pytest.warns(DeprecationWarning, match="from_model"):
            private = TransformersEngine(
                _model=old.model, _tokenizer=old.tokenizer, quant="fp32", kv=KVConfig(kv_slots=0)
            )
        assert private.model is old.model
        private.close()
        with pytest.raises(TypeError, match="no_such_option"):
            TransformersEngine("random:tiny-llama", device="cpu", no_such_option=1)
    finally:
        old.close()
        new.close()


def test_importing_convo_raises_no_deprecation_warning_even_as_errors() -> None:
    """convo's own modules that still import the moved names do not warn (a program run
    with ``-W error`` can import convo); user code asking for an old name does."""
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import convo, convo.session, convo.testing, convo.engines, convo.planner, convo.fast\n"
        "try:\n    from convo.engines.base import Quant\n"
        "except DeprecationWarning as e:\n    print('warned', e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.startswith("warned") and "convo.models" in out.stdout
