"""The README's engine example (its one ```python block) type-checks under ``mypy --strict``
and runs as written, so the front page can neither rot nor mislead a typed engine: it passes
``mode="align"`` as a string, which ``MambaSpec`` accepts and normalises to the enum."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, "the README should hold exactly one python block (the engine example)"
    return blocks[0]


def test_readme_example_runs() -> None:
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    from mambakv import KVCacheConfig, MambaCacheMode, MambaSpec

    config = namespace["config"]
    assert isinstance(config, KVCacheConfig)
    spec = config.kv_cache_groups[1].kv_cache_spec
    assert isinstance(spec, MambaSpec) and spec.mode is MambaCacheMode.ALIGN  # the string, normalised
    assert isinstance(namespace["copies"], dict) and isinstance(namespace["fresh"], dict)


def test_readme_example_type_checks(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    example = tmp_path / "readme_example.py"
    # and what a typed engine relies on afterwards: `spec.mode` reads as the enum, never a str
    example.write_text(readme_example() + "\n"
                       "from mambakv import MambaCacheMode\n"
                       "_spec = MambaSpec(64, shapes=((3, 8),), dtypes=('bfloat16',), mode='align')\n"
                       "_mode: MambaCacheMode = _spec.mode\n")
    # The project's own settings (strict, and its per-module overrides); a private cache so
    # that runs do not share state.
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "mypy_cache"), "--strict", str(example)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
