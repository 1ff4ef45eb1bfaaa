"""The ``vllm`` plugin (tests/vllm_support.py) itself, without an engine.

Behaviours:

- the plugin looks for the engine where ``make vllm`` puts it: the folder name it computes from
  the pins, the lock and the model script is the one hack/vllm.mk computes;
- without the install a ``vllm`` test (marked, or using the fixture) is skipped with the hint
  ``make vllm``, and fails instead under ``TOKENFAIR_REQUIRE_VLLM=1``; other tests run;
- the engine's facts are read from its exposition as vLLM 0.32 writes it (``cache_config_info``'s
  labels; one sample picked by name and labels, and an ambiguous pick refused).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from kubecluster import cache_root
from repo_paths import REPO_ROOT, TESTS_DIR
from vllm_support import install_key, labels_of, parse_samples, sample

# Lines of vLLM 0.32.0's /metrics (CPU build, the suite's settings), labels shortened to those
# the plugin reads plus a few: the format is the engine's, the values what it reported.
EXPOSITION = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="False",\
engine="0",num_cpu_blocks="None",num_gpu_blocks="512",num_gpu_blocks_override="512"} 1.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 19000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 19000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 0.0
"""


def test_the_plugin_looks_where_make_vllm_installs(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENFAIR_CACHE": str(tmp_path)}
    printed = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval",
         "print-vllm-dir: ; @echo $(VLLM_DIR)", "print-vllm-dir"],
        cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert printed == str(tmp_path / "vllm" / install_key())
    assert install_key().startswith("0.32.0-torch2.13.0-")


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.setenv("TOKENFAIR_CACHE", str(tmp_path))
    assert cache_root() == tmp_path


def test_missing_install_skips_or_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKENFAIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))
    monkeypatch.delenv("TOKENFAIR_REQUIRE_VLLM", raising=False)
    pytester.makepyfile(
        test_needs_vllm="""
        import pytest

        @pytest.mark.vllm
        def test_marked():
            pass

        def test_uses_fixture(vllm):
            pass

        def test_plain():
            pass
        """
    )
    # The loop-scope option only silences pytest-asyncio (installed with pytest-aiohttp).
    args = ("-p", "vllm_support", "-p", "no:cacheprovider", "-rs",
            "-o", "asyncio_default_fixture_loop_scope=function")  # fmt: skip
    skipped = pytester.runpytest_subprocess(*args)
    skipped.assert_outcomes(passed=1, skipped=2)
    skipped.stdout.fnmatch_lines(["*no vLLM install at*make vllm*"])

    monkeypatch.setenv("TOKENFAIR_REQUIRE_VLLM", "1")
    failed = pytester.runpytest_subprocess(*args)
    failed.assert_outcomes(passed=1, errors=2)
    failed.stdout.fnmatch_lines(["*TOKENFAIR_REQUIRE_VLLM=1 but no vLLM install at*"])


def test_facts_are_read_from_the_engines_exposition() -> None:
    samples = parse_samples(EXPOSITION)
    info = next(key for key in samples if key.startswith("vllm:cache_config_info{"))
    labels = labels_of(info)
    assert (labels["block_size"], labels["num_gpu_blocks"]) == ("32", "512")
    assert sample(samples, "vllm:prompt_tokens_total", model_name="tiny") == 19000.0
    assert sample(samples, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0.0
    with pytest.raises(AssertionError, match="2 samples"):
        sample(samples, "vllm:prompt_tokens_by_source_total", model_name="tiny")
    with pytest.raises(AssertionError, match="0 samples"):
        sample(samples, "vllm:generation_tokens_total")
