"""Pytest plugin: a real vLLM (the CPU build) serving the tiny model, for the tests marked ``vllm``.

``vllm`` (session scope) starts vLLM's OpenAI-compatible server from the virtualenv that
``make vllm`` fills under ``$TOKENFAIR_CACHE/vllm/<key>`` (the key as hack/vllm.mk computes it
from hack/vllm/versions.env, requirements/vllm.txt and hack/vllm/make_tiny_model.py), on a free
loopback port, waits until ``/health`` answers 200 (:data:`START_TIMEOUT_S`, generous: a cold
start on a busy 2-core machine imports torch three times), checks that the engine runs with the
block size, block count and context length it was asked for (read back from its ``/metrics`` and
``/v1/models``), yields a :class:`VllmServer`, and stops it (process group: SIGTERM, then
SIGKILL) at the end of the session. One server is shared by every test of a session.

Its output goes to ``vllm.log`` in a session temporary folder; a failed test that used it gets
the log's tail as a report section, and a server that did not start raises with the tail.

Without ``make vllm`` the tests are skipped with that hint, unless ``TOKENFAIR_REQUIRE_VLLM=1``
(CI), where they fail. Tests that use ``vllm`` get the ``vllm`` marker automatically
(``pytest -m "not vllm"`` leaves them out). :func:`running_vllm` is the same server as a context
manager, for benchmarks (bench/bench_vllm_throughput.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubecluster import cache_root, log_tail, read_versions, start_process, stop_process
from loopback_support import free_ports
from repo_paths import REPO_ROOT

VERSIONS_FILE = REPO_ROOT / "hack" / "vllm" / "versions.env"
LOCK_FILE = REPO_ROOT / "requirements" / "vllm.txt"
MODEL_SCRIPT = REPO_ROOT / "hack" / "vllm" / "make_tiny_model.py"
REQUIRE_ENV = "TOKENFAIR_REQUIRE_VLLM"
HOW_TO_GET = "run `make vllm` (docs/engine.md)"
# Measured 85-283 s on a 2-core machine shared with other test runs (three processes each
# import torch and vLLM; the first start after `make vllm` also writes their bytecode).
START_TIMEOUT_S = 600.0
LOG_NAME = "vllm"
LOG_TAIL_LINES = 60
START_ATTEMPTS = 3
# Filled by the vllm fixture, printed in the terminal summary.
_started: list[VllmServer] = []
# The running engine (closed after the last test that uses it, or at the end of the session)
# and that test.
_running = contextlib.ExitStack()
_last_user: list[pytest.Item] = []


# --- finding what `make vllm` installed ------------------------------------------------------


def install_key() -> str:
    """``<VLLM_VERSION>-torch<TORCH_VERSION>-<digest>``: hack/vllm.mk's folder name, the digest
    being the first 12 hex digits of sha256(lock bytes + model script bytes)."""
    pins = read_versions(VERSIONS_FILE)
    digest = hashlib.sha256(LOCK_FILE.read_bytes() + MODEL_SCRIPT.read_bytes()).hexdigest()[:12]
    return f"{pins['VLLM_VERSION']}-torch{pins['TORCH_VERSION']}-{digest}"


@dataclass(frozen=True)
class VllmInstall:
    """A folder filled by ``make vllm``: the engine's interpreter and the tiny model."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "model"


def find_install() -> VllmInstall | str:
    """The install for the current pins, or a skip/fail reason naming the folder and the hint."""
    install = VllmInstall(cache_root() / "vllm" / install_key())
    if not install.python.exists() or not (install.model / "config.json").is_file():
        return f"no vLLM install at {install.root}: {HOW_TO_GET}"
    return install


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``; fail instead when ``TOKENFAIR_REQUIRE_VLLM=1`` (CI must not skip)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_install() -> VllmInstall:
    """The install, or skip/fail the current test (see :func:`skip_or_fail`)."""
    found = find_install()
    if isinstance(found, str):
        skip_or_fail(found)
        raise AssertionError("unreachable")  # pytest.skip/fail raise
    return found


# --- the running server ----------------------------------------------------------------------


@dataclass(frozen=True)
class VllmSettings:
    """What the suite's engine is started with (docs/engine.md says why each)."""

    served_model_name: str = "tiny"
    #: ``--block-size``: vLLM's CPU attention takes multiples of 32 only (16, the GPU default
    #: and tokenfair's ``kvBlockTokens`` default, is refused).
    block_size_tokens: int = 32
    #: ``--num-gpu-blocks-override``: the KV cache's size in blocks, independent of the memory
    #: the machine has (512 x 32 = 16,384 tokens: four requests of the full context).
    kv_blocks: int = 512
    #: ``--max-model-len``: prompt + output limit per request (the model's own 4096).
    max_model_len_tokens: int = 4096
    #: ``--max-num-seqs``: requests in one batch at most; more wait in vLLM's own queue.
    max_num_seqs: int = 16
    #: ``--max-num-batched-tokens``: tokens one engine step computes at most (chunked prefill).
    max_num_batched_tokens: int = 2048
    #: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) the CPU worker sets aside; the block override caps what
    #: is used (512 blocks of this model are 32 MiB).
    kv_cache_space_gib: int = 1
    #: ``--enforce-eager``: no torch.compile. Measured: a compiled start takes ~110 s more (the
    #: inductor's C++ build) for no throughput gain on this model (docs/engine.md).
    enforce_eager: bool = True


@dataclass
class VllmServer:
    """A running vLLM and the facts the engine reports about itself."""

    base_url: str
    """``http://127.0.0.1:<port>``; the OpenAI routes are under ``/v1``."""
    model: str
    """The served model name (what a request's ``model`` must say)."""
    block_size_tokens: int
    """``block_size`` of ``vllm:cache_config_info``."""
    kv_blocks: int
    """``num_gpu_blocks`` of ``vllm:cache_config_info`` (the KV cache, in blocks)."""
    max_model_len_tokens: int
    """``max_model_len`` of the model in ``/v1/models``."""
    settings: VllmSettings
    log_path: Path
    startup_seconds: float = 0.0

    def get(self, path: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
        """One GET to the engine: (status, body); never raises on an HTTP error status."""
        return _get(self.base_url + path, timeout_s)

    def metrics(self) -> dict[str, float]:
        """The engine's Prometheus samples as ``{'name{labels}': value}`` (labels as printed)."""
        status, body = self.get("/metrics")
        assert status == 200, f"vLLM /metrics answered {status}"
        return parse_samples(body.decode())

    def counter(self, name: str) -> float:
        """The value of one unlabelled-by-us sample of the served model, e.g.
        ``vllm:prompt_tokens_total``."""
        return sample(self.metrics(), name, model_name=self.model)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path.parent, LOG_NAME, lines)


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text exposition (comments skipped)."""
    samples = {}
    for line in text.splitlines():
        if (match := _SAMPLE.match(line)) is not None:
            name, labels, value = match.groups()
            samples[name + (labels or "")] = float(value)
    return samples


def labels_of(key: str) -> dict[str, str]:
    """The labels of one :func:`parse_samples` key."""
    _, _, labels = key.partition("{")
    return dict(_LABEL.findall(labels))


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels``; raises when not exactly one."""
    found = [
        value
        for key, value in samples.items()
        if key.partition("{")[0] == name and labels.items() <= labels_of(key).items()
    ]
    assert len(found) == 1, f"{len(found)} samples of {name} with {labels}"
    return found[0]


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    # No ProxyHandler: an HTTP_PROXY in the environment must never see loopback traffic.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


def server_command(install: VllmInstall, port: int, settings: VllmSettings) -> list[str]:
    """The module entry point (the ``vllm`` console script looks up the distribution ``vllm``,
    which is named ``vllm-cpu`` here, and fails), with the suite's settings."""
    command = [
        str(install.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(install.model),
        "--served-model-name", settings.served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--block-size", str(settings.block_size_tokens),
        "--num-gpu-blocks-override", str(settings.kv_blocks),
        "--max-model-len", str(settings.max_model_len_tokens),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        # Off: loadgen's and the tests' prompts repeat, and cached prefixes would make the
        # engine's token counters and its KV usage disagree with what a request costs.
        "--no-enable-prefix-caching",
        "--seed", "0",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if settings.enforce_eager:
        command.append("--enforce-eager")
    return command


def server_environment(workdir: Path, settings: VllmSettings) -> dict[str, str]:
    """The engine's environment: offline, no usage statistics, caches in ``workdir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_space_gib),
        # The engine's processes talk over loopback only.
        VLLM_HOST_IP="127.0.0.1",
        # Nothing leaves the machine: no usage report, no model hub.
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(workdir / "hf-home"),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        VLLM_CONFIG_ROOT=str(workdir / "vllm-config"),
        PYTHONUNBUFFERED="1",
    )
    return env


def start_server(install: VllmInstall, workdir: Path, settings: VllmSettings,
                 stack: contextlib.ExitStack) -> VllmServer:  # fmt: skip
    """Start vLLM and return it once ``/health`` answers and its facts are read. Stopping it
    is pushed onto ``stack``; a start that fails raises with the log's tail."""
    started = time.monotonic()
    (port,) = free_ports(1)
    process = start_process(
        LOG_NAME, server_command(install, port, settings), workdir,
        env=server_environment(workdir, settings),
    )  # fmt: skip
    stack.callback(stop_process, process)
    base_url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"{LOG_NAME}.log"
    wait_healthy(base_url, process, log_path)
    server = VllmServer(
        base_url=base_url,
        model=settings.served_model_name,
        block_size_tokens=0,
        kv_blocks=0,
        max_model_len_tokens=0,
        settings=settings,
        log_path=log_path,
    )
    read_facts(server)
    server.startup_seconds = time.monotonic() - started
    return server


def wait_healthy(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    """Poll ``/health`` until 200; raise with the log's tail if vLLM exits or time runs out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {process.returncode} while starting\n"
                + log_tail(log_path.parent, LOG_NAME, LOG_TAIL_LINES)
            )
        with contextlib.suppress(OSError):
            if _get(base_url + "/health", 2.0)[0] == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"vLLM not healthy after {START_TIMEOUT_S:.0f} s\n"
        + log_tail(log_path.parent, LOG_NAME, LOG_TAIL_LINES)
    )


def read_facts(server: VllmServer) -> None:
    """Fill the server's facts from the engine itself, and check they are what was asked:
    ``vllm:cache_config_info``'s ``block_size``/``num_gpu_blocks``, ``/v1/models``'
    ``max_model_len``."""
    info_key = next(k for k in server.metrics() if k.startswith("vllm:cache_config_info{"))
    info = labels_of(info_key)
    server.block_size_tokens = int(info["block_size"])
    server.kv_blocks = int(info["num_gpu_blocks"])
    status, body = server.get("/v1/models")
    assert status == 200, f"vLLM /v1/models answered {status}"
    models: list[dict[str, Any]] = json.loads(body)["data"]
    assert [m["id"] for m in models] == [server.model], models
    server.max_model_len_tokens = int(models[0]["max_model_len"])
    asked = server.settings
    got = (server.block_size_tokens, server.kv_blocks, server.max_model_len_tokens)
    wanted = (asked.block_size_tokens, asked.kv_blocks, asked.max_model_len_tokens)
    if got != wanted:
        raise RuntimeError(
            f"vLLM runs with (block size, blocks, max model len) {got}, not the {wanted} asked"
        )


@contextlib.contextmanager
def running_vllm(install: VllmInstall, workdir: Path,
                 settings: VllmSettings | None = None) -> Iterator[VllmServer]:  # fmt: skip
    """:func:`start_server`, retried on a new port if its port was taken between picking and
    binding; stopped on exit."""
    settings = settings or VllmSettings()
    for attempt in range(1, START_ATTEMPTS + 1):
        with contextlib.ExitStack() as stack:
            try:
                server = start_server(install, workdir, settings, stack)
            except RuntimeError as err:
                if "address already in use" in str(err).lower() and attempt < START_ATTEMPTS:
                    continue
                raise
            yield server
            return


# --- pytest wiring ---------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Register ``vllm`` here too, so the plugin works in any project (pytester runs included)."""
    config.addinivalue_line("markers", "vllm: needs the real vLLM engine (make vllm)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the ``vllm`` fixture ``vllm``, so ``-m 'not vllm'`` leaves it
    out."""
    for item in items:
        if "vllm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Remember the last test that will use the engine (of those selected to run)."""
    users = [item for item in session.items if "vllm" in getattr(item, "fixturenames", ())]
    _last_user[:] = users[-1:]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, with ``TOKENFAIR_REQUIRE_VLLM=1``, fail) ``vllm`` tests without the install."""
    if item.get_closest_marker("vllm") is not None:
        require_install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, Any, None]:
    """A failed test that used the engine shows the tail of its log."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and "vllm" in getattr(item, "fixturenames", ()) and _started:
        server = _started[-1]
        report.sections.append((f"vllm log (tail of {server.log_path})", server.log_tail()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, None]:
    """Stop the engine right after the last test that uses it (its module's fixtures torn down
    first), not at the end of the session: the rest of the suite gets its core and ~3 GB."""
    yield
    if _last_user and item is _last_user[0]:
        _running.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Report how long the engine took to become healthy, and where its log is."""
    for server in _started:
        terminalreporter.write_line(
            f"vllm: healthy in {server.startup_seconds:.1f} s, log {server.log_path}"
        )


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The session's engine (see the module docstring); skips or fails without ``make vllm``."""
    install = require_install()
    workdir = tmp_path_factory.mktemp("vllm")
    with _running:
        server = _running.enter_context(running_vllm(install, workdir))
        _started.append(server)
        yield server
